"""The copy kernels (``engine/kernel_copies.py``): which pairs fold into tiles (CPU), and
on CUDA every table bit for bit against the sources, NaN payloads included, through the
engine's copy batches and the colocated transport's alike. The CUDA tests skip without a
device; with ``TRITON_INTERPRET=1`` and Triton installed they run on CPU tensors too."""

import os
import threading

import pytest
import torch

from megatron_reshard.engine import kernel_copies
from megatron_reshard.engine.colocated_copies import CopyBatch
from megatron_reshard.engine.copies import Copies, as_bits, word_bytes, words_pair
from megatron_reshard.engine.kernel_copies import (ROWS, TRANSPOSED, BlockTable, KernelCopies,
                                                   TileTable, tiled)


def _strided(shape, stride):
    return torch.empty(4096, dtype=torch.bfloat16).as_strided(shape, stride)


@pytest.mark.parametrize("dst, src, want", [
    # a column block of a wider destination: rows of unit stride on both sides
    ((8, 16), (32, 1), (ROWS, 1, 8, 16, (0, 32), (0, 16))),
    # the destination transposed: the source's unit stride runs along the tile's rows
    (((16, 8), (1, 16)), ((16, 8), (8, 1)), (TRANSPOSED, 1, 8, 16, (0, 16), (0, 8))),
    # dims that merge: [4, 3, 8] of a [4, 3, 16] block, source contiguous
    (((4, 3, 8), (48, 16, 1)), ((4, 3, 8), (24, 8, 1)), (ROWS, 1, 12, 8, (0, 16), (0, 8))),
    # three dims, transposed in the last two
    (((2, 8, 4), (32, 1, 8)), ((2, 8, 4), (32, 4, 1)), (TRANSPOSED, 2, 4, 8, (32, 8), (32, 4))),
    # contiguous: one row
    (((6, 5), (5, 1)), ((6, 5), (5, 1)), (ROWS, 1, 1, 30, (0, 0), (0, 0))),
    # no unit stride in the destination
    (((6, 5), (10, 2)), ((6, 5), (5, 1)), None),
    # a 4-D permutation: more dims than a tile folds
    (((2, 2, 2, 2), (1, 2, 4, 8)), ((2, 2, 2, 2), (8, 4, 2, 1)), None),
])
def test_pairs_fold_into_tiles_where_their_strides_allow(dst, src, want):
    if isinstance(dst[0], int):  # a column block: (rows, cols), (row stride, 1)
        dst, src = (dst, src), (dst, (dst[1], 1))
    got = tiled(_strided(*dst), _strided(*src))
    assert got == (None if want is None else kernel_copies.Tiled(*want))


def _kernel_device():
    """CUDA, or the CPU under Triton's interpreter; else the test skips."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and kernel_copies.triton_kernels():
        return torch.device("cpu")
    pytest.skip("needs CUDA with Triton (or TRITON_INTERPRET=1 with Triton installed)")


@pytest.fixture
def device(monkeypatch):
    dev = _kernel_device()
    if dev.type == "cpu":  # the interpreter runs the kernels on CPU tensors
        monkeypatch.setattr(kernel_copies, "kernels_for", lambda d: kernel_copies.triton_kernels())
    return dev


def _bits(shape, dtype, device, seed):
    """Random bits with NaN payloads (0x7f81), negative zeros and infinities among them."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype.itemsize == 2:
        x.view(torch.int16)[:8] = torch.tensor([0x7F81, -0x3D, 0x7F80, -0x8000, 1, 0, -1, 0x7FC1],
                                               dtype=torch.int16)
    return x.view(dtype).view(shape).to(device)


def _pairs(device, seed):
    """(dst, src) pairs of every kind the kernels take, and two they leave."""
    bf16, f32 = torch.bfloat16, torch.float32
    z = lambda *s, dtype=bf16: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
    return [
        (z(96, 64), _bits((96, 64), bf16, device, seed)),                      # block
        (z(1000, dtype=f32), _bits((1000,), f32, device, seed + 1)),            # block
        (z(40, 70)[:, 3:38], _bits((40, 35), bf16, device, seed + 2)),          # rows, bf16
        (z(70, 33).t(), _bits((33, 70), bf16, device, seed + 3)),               # transposed
        (z(3, 20, 17, dtype=f32).transpose(1, 2),
         _bits((3, 17, 20), f32, device, seed + 4)),                            # 3-D transposed
        (z(64, 50), _bits((50, 64), bf16, device, seed + 5).t()),               # strided source
        (z(13, dtype=torch.uint8), _bits((13,), torch.uint8, device, seed + 6)),  # rows, bytes
        (z(130, 70)[:, ::2], _bits((130, 35), bf16, device, seed + 7)),         # left: stride 2
        (z(2, 2, 2, 2).permute(3, 2, 1, 0), _bits((2, 2, 2, 2), bf16, device, seed + 8)),
    ]


def _equal(dst, src) -> bool:
    return torch.equal(dst.contiguous().view(torch.uint8).cpu(),
                       src.contiguous().view(torch.uint8).cpu())


def test_the_kernels_copy_every_kind_of_pair_bit_for_bit(device):
    pairs = _pairs(device, 0)
    kernels = KernelCopies(pairs, device)
    kinds = sorted((type(t).__name__, getattr(t, "kind", -1), len(t._keep)) for t in kernels.tables)
    assert kinds == [("BlockTable", -1, 2), ("TileTable", ROWS, 1), ("TileTable", ROWS, 1),
                     ("TileTable", TRANSPOSED, 1), ("TileTable", TRANSPOSED, 2)]
    assert [id(d) for d, _ in kernels.rest] == [id(pairs[-2][0]), id(pairs[-1][0])]
    kernels.run()
    for k, (dst, src) in enumerate(pairs[:-2]):
        assert _equal(dst, src), k
    assert not pairs[-2][0].any()  # left for the caller


def test_large_pairs_span_many_programs_and_tiles(device):
    """Pairs longer than a program's block or tile, with ragged edges."""
    small = device.type == "cpu"  # the interpreter is slow
    n = 600 if small else 3000
    pairs = [(torch.zeros(n, n + 7, dtype=torch.bfloat16, device=device).t(),
              _bits((n + 7, n), torch.bfloat16, device, 1)),
             (torch.zeros(n, n, dtype=torch.bfloat16, device=device).t(),  # 16-byte vectors
              _bits((n, n), torch.bfloat16, device, 4)),
             (torch.zeros(n, 96, dtype=torch.uint8, device=device).t(),    # fp8-sized
              _bits((96, n), torch.uint8, device, 5)),
             (torch.zeros(BlockTable.BLOCK * 3 + 5, dtype=torch.int64, device=device),
              _bits((BlockTable.BLOCK * 3 + 5,), torch.int64, device, 2)),
             (torch.zeros(n, 2 * n + 8, dtype=torch.float32, device=device)[:, 8:n + 8],
              _bits((n, n), torch.float32, device, 3))]
    kernels = KernelCopies(pairs, device)
    units = sorted(getattr(t, "unit", 0) for t in kernels.tables)
    # a block table; tiles of 2 and 1 bytes, 16-byte vectors of fp32 and bf16
    assert not kernels.rest and units == [0, 1, 1, 4, 8]
    kernels.run()
    for k, (dst, src) in enumerate(pairs):
        assert _equal(dst, src), k


def test_an_engine_batch_hands_its_pairs_to_the_kernels_and_keeps_the_rest(device):
    pairs = _pairs(device, 10)
    copies = Copies()
    for dst, src in pairs[2:]:
        copies.typed(dst, src, min(word_bytes(tuple(x.shape), x.stride(), x.element_size())
                                   for x in (dst, src)))
    copies.flat(pairs[0][0].view(-1).view(torch.uint8), pairs[0][1].view(-1).view(torch.uint8),
                pairs[0][0].numel() * 2)
    copies.flat(pairs[1][0].view(torch.uint8), pairs[1][1].view(torch.uint8), 4000)
    for run in range(4):  # the same tables every run; on CUDA replayed from the third
        if run:
            for k, (_, src) in enumerate(pairs):
                as_bits(src).copy_(as_bits(_bits(tuple(src.shape), src.dtype, device,
                                                  100 * run + k)))
        copies.run()
        for k, (dst, src) in enumerate(pairs):
            assert _equal(dst, src), (run, k)
        for dst, _ in pairs:
            dst.zero_()
    assert len(copies.kernels.tables) == 5
    assert len(copies.typed_dst) == 2 and not copies.flat_dst and not copies.word_dst
    if device.type == "cuda":
        assert copies._launch.error is None, copies._launch.error
        assert copies._launch.graph is not None and copies._launch.runs == 2


def test_switched_off_the_kernels_leave_every_pair_to_torch(device, monkeypatch):
    monkeypatch.setenv("MEGATRON_RESHARD_COPY_KERNELS", "0")
    pairs = _pairs(device, 20)
    assert not KernelCopies(pairs, device).tables
    copies = Copies()
    for dst, src in pairs[:7]:
        copies.exact(dst, src)
    copies.run()
    assert not copies.kernels.tables and len(copies.typed_dst) == 7
    for k, (dst, src) in enumerate(pairs[:7]):
        assert _equal(dst, src), k


def test_a_colocated_batch_copies_strided_pairs_through_tiles(device):
    pairs = _pairs(device, 30)[:-2]
    batch = CopyBatch(pairs, device)
    assert {type(t) for t in batch.kernels.tables} == {BlockTable, TileTable}
    assert not batch.dsts and not batch.memcpy
    batch.run()
    for k, (dst, src) in enumerate(pairs):
        assert _equal(dst, src), k


def test_words_of_a_column_block_go_as_int64_rows(device):
    src = _bits((64, 32), torch.bfloat16, device, 40)[:, 8:]
    dst = torch.zeros(64, 24, dtype=torch.bfloat16, device=device)
    d, s = words_pair(dst, src, word_bytes(tuple(src.shape), src.stride(), 2))
    kernels = KernelCopies([(d, s)], device)
    (table,) = kernels.tables
    assert isinstance(table, TileTable) and table.kind == ROWS and d.dtype == torch.int64
    kernels.run()
    assert _equal(dst, src)


def test_copies_replayed_off_the_main_thread_stay_eager():
    """A staged refit receives on its own thread beside generation: recording a CUDA graph
    there makes the generating thread's device-wide sync fail (seen on an H100), so off the
    main thread ``Replayed`` never records. (On this CPU-only torch, a recording attempt
    raises at its first CUDA call: the old code failed here.)"""
    calls, errors = [], []

    def on_a_side_thread():
        try:
            replayed = kernel_copies.Replayed(lambda: calls.append(1), torch.device("cuda"), after=1)
            for _ in range(3):
                replayed()
            errors.append(replayed.graph)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    worker = threading.Thread(target=on_a_side_thread)
    worker.start()
    worker.join(timeout=30)
    assert errors == [None] and len(calls) == 3
