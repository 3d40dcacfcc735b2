"""The engine's copy batches: strided views copied as wider words, bit for bit."""

import pytest
import torch

from megatron_reshard.engine.copies import MEMCPY_BYTES, WIDEN_BYTES, Copies, word_bytes, words_pair


@pytest.mark.parametrize("size, stride, itemsize, words", [
    ((4, 8), (16, 1), 2, 8),   # bf16 rows of 16 bytes, row stride 32 bytes
    ((4, 2), (16, 1), 2, 4),   # rows of 4 bytes
    ((4, 3), (16, 1), 2, 0),   # rows of 6 bytes
    ((4, 8), (8, 2), 2, 0),    # last dim not unit-stride
    ((4, 8), (13, 1), 2, 0),   # row stride of 26 bytes: rows do not stay aligned
    ((4, 8), (14, 1), 2, 4),   # row stride of 28 bytes
    ((4, 2), (4, 1), 4, 8),    # fp32
    ((4, 1), (4, 1), 4, 0),    # one fp32 per row
    ((4, 4), (8, 1), 8, 0),    # no word wider than an 8-byte element
    ((2, 0), (4, 1), 2, 0),    # empty
    ((3, 5, 16), (160, 32, 1), 1, 8),  # fp8 bytes, 3-D
])
def testword_bytes_follow_the_view_dtype_rule(size, stride, itemsize, words):
    assert word_bytes(size, stride, itemsize) == words
    if words:  # torch agrees: the view as words exists at an aligned offset
        base = torch.empty(4096, dtype=torch.uint8).view({1: torch.uint8, 2: torch.bfloat16,
                                                          4: torch.float32}[itemsize])
        view = base.as_strided(size, stride, 0)
        assert view.view({8: torch.int64, 4: torch.int32}[words]).shape[-1] == \
            size[-1] * itemsize // words


def _random_bits(shape, dtype):
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8).view(dtype).view(shape)


@pytest.mark.parametrize("offset, as_words", [(0, True), (1, False), (4, True)])
def test_strided_pairs_copy_as_words_only_where_addresses_align(offset, as_words):
    torch.manual_seed(offset)
    # bf16 with random bits: NaN payloads and negative zeros must come through unchanged
    full = _random_bits((64 * 32 + 8,), torch.bfloat16)
    src = full[offset:offset + 64 * 32].view(64, 32)[:, 16:]  # strided, rows of 32 bytes
    dst = torch.zeros(64, 16, dtype=torch.bfloat16)
    words = word_bytes(tuple(src.shape), src.stride(), 2)
    assert words == 8
    d, s = words_pair(dst, src, words)
    assert (d.dtype == torch.int64 and s.dtype == torch.int64) is as_words
    copies = Copies()
    copies.typed(dst, src, words)
    copies.run()
    assert torch.equal(dst.view(torch.int16), src.contiguous().view(torch.int16))


def test_a_batch_mixes_large_and_small_contiguous_pairs_and_strided_ones():
    torch.manual_seed(0)
    big_src = _random_bits((MEMCPY_BYTES,), torch.uint8)  # one memcpy of its own
    small_src = [_random_bits((n,), torch.uint8) for n in (1, 7, 4096)]
    strided_src = _random_bits((8, 10), torch.float8_e4m3fn)[:, 2:]  # 8 bytes a row
    big_dst = torch.zeros_like(big_src)
    small_dst = [torch.zeros_like(x) for x in small_src]
    strided_dst = torch.zeros(8, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    copies = Copies()
    copies.flat(big_dst, big_src, big_src.numel())
    for d, s in zip(small_dst, small_src):
        copies.flat(d, s, s.numel())
    copies.typed(strided_dst, strided_src, word_bytes((8, 8), strided_src.stride(), 1))
    copies.run()
    assert torch.equal(big_dst, big_src)
    assert all(torch.equal(d, s) for d, s in zip(small_dst, small_src))
    assert torch.equal(strided_dst.view(torch.uint8), strided_src.contiguous().view(torch.uint8))


@pytest.mark.parametrize("offset, nbytes, widened", [
    (0, WIDEN_BYTES, True),          # aligned, a multiple of 8: int64 words
    (3, WIDEN_BYTES, False),         # a misaligned address stays bytes
    (0, WIDEN_BYTES + 4, False),     # a length that is no multiple of 8 stays bytes
    (0, WIDEN_BYTES - 8, False),     # too small to be worth the check
])
def test_contiguous_pairs_copy_as_int64_words_where_size_and_address_allow(offset, nbytes,
                                                                           widened):
    src_base = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8)
    dst_base = torch.zeros(nbytes + 16, dtype=torch.uint8)
    src, dst = src_base[offset:offset + nbytes], dst_base[offset:offset + nbytes]
    copies = Copies()
    copies.flat(dst, src, nbytes)
    assert bool(copies.word_dst) == widened
    assert all(t.dtype == torch.int64 for t in copies.word_dst + copies.word_src)
    copies.run()
    assert torch.equal(dst, src)
    assert not dst_base[:offset].any() and not dst_base[offset + nbytes:].any()


def test_typed_pairs_are_copied_as_integers_of_their_element_size():
    # CUDA's foreach copy of a float dtype rewrites NaN payloads (found on an H200: the
    # fused small params of the GPU engine worker); integer views keep every bit
    copies = Copies()
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32),
                        (torch.float8_e4m3fn, torch.uint8), (torch.int64, torch.int64)):
        src = _random_bits((4, 6), dtype)
        copies.exact(torch.zeros(4, 6, dtype=dtype)[:, :3], src[:, :3])
        assert copies.typed_dst[-1].dtype == bits and copies.typed_src[-1].dtype == bits
    copies.run()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nan_payloads_survive_every_cuda_copy_path():
    from megatron_reshard.engine.fuse import scatter

    # NaNs with payloads (0x7f81, 0xffc3 as int16), +inf, the smallest subnormal
    payload = torch.tensor([0x7F81, 0xFFC3 - 0x10000, 0x7F80, 0x0001] * 256, dtype=torch.int16)
    src = payload.view(torch.bfloat16).cuda().view(64, 16)
    copies = Copies()
    dst = torch.zeros(64, 32, dtype=torch.bfloat16, device="cuda")[:, ::2]
    copies.exact(dst, src)
    whole = torch.zeros_like(src)
    copies.exact(whole, src)
    copies.run()
    outs = [torch.zeros(16, dtype=torch.bfloat16, device="cuda") for _ in range(64)]
    scatter([(src, outs)])
    for got in (dst, whole, torch.stack(outs)):
        assert torch.equal(got.contiguous().view(torch.int16).cpu(), payload.view(64, 16))
