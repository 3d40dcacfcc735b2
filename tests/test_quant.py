"""megatron_reshard.fp8.quant against an independent reference written here in plain Python.

The reference works element by element on Python floats: fp32 rounding through ``struct``,
the e4m3 byte by nearest-value search over all 127 finite non-negative e4m3 values (ties to
the even byte), block amaxes by explicit loops. Block FP8's numerics are vLLM 0.33's online
block quantization (``tests/real_vllm/test_online_fp8.py`` checks the module against vLLM's
own function). It shares no code with the module; the
comparison is byte for byte (weights) and bit for bit (scales).
"""

import bisect
import math
import struct

import pytest
import torch

from megatron_reshard.fp8.quant import (
    blockwise_scale_shape,
    dequantize_blockwise_fp8,
    dequantize_mxfp8,
    fp8_bytes,
    mxfp8_scale_shape,
    owns_whole_blocks,
    quantize_blockwise_fp8,
    quantize_mxfp8,
)

# ---- the independent reference --------------------------------------------------------


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 (inf past the fp32 range)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def e4m3_value(byte: int) -> float:
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    return (man / 8) * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_POSITIVE = [e4m3_value(b) for b in range(0x7F)]  # bytes 0..126; 0x7F is NaN
assert E4M3_POSITIVE[-1] == 448.0 and E4M3_POSITIVE == sorted(E4M3_POSITIVE)


def e4m3_byte(v: float) -> int:
    """Round-to-nearest-even e4m3fn byte of a finite ``v`` with ``|v| <= 448``."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    i = bisect.bisect_left(E4M3_POSITIVE, a)
    if E4M3_POSITIVE[i] == a:
        return sign | i
    lo, hi = i - 1, i
    d_lo, d_hi = a - E4M3_POSITIVE[lo], E4M3_POSITIVE[hi] - a
    return sign | (lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi)


def clamp448(v: float) -> float:
    return max(-448.0, min(448.0, v))


def ceil_log2(r: float) -> int:
    m, e = math.frexp(r)
    return e - 1 if m == 0.5 else e


def ref_block_fp8(matrix: list, pow2: bool = False):
    """(bytes, scale_inv) of one [N][K] matrix in 128x128 tiles."""
    n, k = len(matrix), len(matrix[0])
    q = [[0] * k for _ in range(n)]
    scale_inv = [[0.0] * -(-k // 128) for _ in range(-(-n // 128))]
    for bi in range(0, n, 128):
        for bj in range(0, k, 128):
            cells = [(i, j) for i in range(bi, min(bi + 128, n)) for j in range(bj, min(bj + 128, k))]
            amax = max(abs(matrix[i][j]) for i, j in cells)
            if pow2:
                e = -127 if amax == 0 else max(-127, min(127, ceil_log2(f32(amax / 448.0))))
                scale = 1.0 if e == -127 else 2.0**-e
                scale_inv[bi // 128][bj // 128] = f32(1.0 / scale)
            else:  # vLLM's online block quantization: sf = max(amax, 1e-4) / 448, w * (1 / sf)
                scale = f32(1.0 / block_scale_inv(amax))
                scale_inv[bi // 128][bj // 128] = block_scale_inv(amax)
            for i, j in cells:
                q[i][j] = e4m3_byte(clamp448(f32(matrix[i][j] * scale)))
    return q, scale_inv


AMAX_FLOOR = f32(1e-4)


def block_scale_inv(amax: float) -> float:
    """A tile's fp32 scale_inv: its amax (at least fp32(1e-4)) / 448, rounded once."""
    return f32(max(amax, AMAX_FLOOR) / 448.0)


def ref_mxfp8(row: list):
    """(bytes, E8M0 scale bytes) of one row in blocks of 32 (the last may be shorter)."""
    q, scales = [], []
    for start in range(0, len(row), 32):
        block = row[start:start + 32]
        amax = max(max(abs(x) for x in block), 2.0**-126)
        biased = max(0, min(254, ceil_log2(f32(amax / 448.0)) + 127))
        descale = 2.0 ** (biased - 127)
        scales.append(biased)
        q.extend(e4m3_byte(clamp448(x / descale)) for x in block)
    return q, scales


def over_leading_dims(fn, values, depth):
    """Apply a reference to every matrix (depth 2) or row (depth 1) of nested lists."""
    if _depth(values) == depth:
        return fn(values)
    parts = [over_leading_dims(fn, v, depth) for v in values]
    return [p[0] for p in parts], [p[1] for p in parts]


def _depth(values) -> int:
    return 1 + _depth(values[0]) if isinstance(values, list) else 0


# ---- inputs ---------------------------------------------------------------------------


def weights(shape, dtype, seed):
    """Random weights whose magnitude changes from tile to tile (so scales differ), with an
    all-zero tile, a tile of tiny values and one of huge values where the shape allows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float32)
    rows = torch.arange(shape[-2]).reshape(-1, 1) // 64
    cols = torch.arange(shape[-1]).reshape(1, -1) // 16
    w = w * torch.pow(10.0, ((rows * 7 + cols * 3) % 9 - 4).float())
    if shape[-2] > 128 and shape[-1] > 128:
        w[..., :128, :128] = 0
        w[..., 128:, :128] *= 1e-30 if dtype == torch.float32 else 1e-6
        w[..., :128, 128:] *= {torch.float32: 1e20, torch.bfloat16: 1e3}.get(dtype, 1.0)
    w = w.to(dtype)
    assert bool(torch.isfinite(w).all())
    return w


SHAPES = [(256, 384), (130, 260), (129, 127), (1, 1), (3, 200), (2, 200, 136)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def as_bytes(q: torch.Tensor) -> list:
    assert q.dtype == torch.float8_e4m3fn
    return q.view(torch.uint8).tolist()


# ---- block FP8 ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_fp8_matches_the_reference_bit_for_bit(shape, dtype):
    w = weights(shape, dtype, seed=sum(shape))
    q, scale_inv = quantize_blockwise_fp8(w)
    ref_q, ref_s = over_leading_dims(ref_block_fp8, w.float().tolist(), depth=2)
    assert q.shape == w.shape and scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == blockwise_scale_shape(shape)
    assert scale_inv.tolist() == ref_s
    assert as_bytes(q) == ref_q


@pytest.mark.parametrize("shape", [(256, 384), (130, 260), (2, 200, 136)])
def test_block_fp8_power_of_two_scales_match_the_reference(shape):
    w = weights(shape, torch.float32, seed=7)
    q, scale_inv = quantize_blockwise_fp8(w, pow2_scales=True)
    ref_q, ref_s = over_leading_dims(lambda m: ref_block_fp8(m, pow2=True), w.tolist(), depth=2)
    assert scale_inv.tolist() == ref_s
    assert as_bytes(q) == ref_q
    mantissas, _ = torch.frexp(scale_inv)
    assert bool((mantissas == 0.5).all())


def test_block_fp8_zero_tile_has_the_floor_scale_and_zero_bytes():
    w = torch.zeros(130, 5, dtype=torch.bfloat16)
    w[129, 4] = 3.0
    q, scale_inv = quantize_blockwise_fp8(w)
    assert scale_inv.tolist() == [[f32(f32(1e-4) / 448.0)], [f32(3.0 / 448.0)]]
    assert as_bytes(q)[0] == [0] * 5
    assert as_bytes(q)[129][4] == e4m3_byte(448.0) == 0x7E


def test_block_fp8_edge_tile_amax_uses_only_its_own_elements():
    # The last tile holds one element; the tensor's last element is the biggest elsewhere.
    w = torch.ones(129, 129)
    w[128, 128] = 0.5
    w[0, 128] = 100.0  # tile (0, 1): independent of the tile (1, 1)
    _, scale_inv = quantize_blockwise_fp8(w)
    assert scale_inv[1, 1].item() == f32(0.5 / 448.0)
    assert scale_inv[0, 1].item() == f32(100.0 / 448.0)


def test_block_fp8_tiles_below_the_amax_floor_share_its_scale():
    # amax 1e-5 and 0 both take vLLM's floor 1e-4; the bytes are w * 448 / 1e-4
    w = torch.zeros(256, 4)
    w[0, 0], w[128, 1] = 1e-5, -5e-5
    q, scale_inv = quantize_blockwise_fp8(w)
    assert scale_inv.flatten().tolist() == [f32(f32(1e-4) / 448.0)] * 2
    inverse = f32(1.0 / f32(f32(1e-4) / 448.0))
    assert as_bytes(q)[0][0] == e4m3_byte(f32(f32(1e-5) * inverse))
    assert as_bytes(q)[128][1] == e4m3_byte(f32(f32(-5e-5) * inverse))


def test_block_fp8_round_trip_error_is_within_half_an_e4m3_step():
    w = weights((130, 260), torch.float32, seed=3)
    q, scale_inv = quantize_blockwise_fp8(w)
    back = dequantize_blockwise_fp8(q, scale_inv, dtype=torch.float32)
    ref_q, ref_s = ref_block_fp8(w.tolist())
    expected = [[e4m3_value(b & 0x7F) * (-1 if b & 0x80 else 1) * ref_s[i // 128][j // 128]
                 for j, b in enumerate(row)] for i, row in enumerate(ref_q)]
    assert back.tolist() == [[f32(v) for v in row] for row in expected]
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself.
    normal = (w.abs() / scale_inv.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :260]) >= 2**-6
    assert bool(((back - w).abs() <= w.abs() / 16 + 1e-45)[normal].all())


def test_a_shard_of_whole_tiles_quantizes_to_the_full_tensors_tiles():
    w = weights((300, 260), torch.bfloat16, seed=11)
    full_q, full_s = quantize_blockwise_fp8(w)
    for lo, hi in [(0, 128), (128, 256), (256, 300), (128, 300)]:
        assert owns_whole_blocks(lo, hi - lo, 300, 128)
        q, s = quantize_blockwise_fp8(w[lo:hi])
        assert as_bytes(q) == as_bytes(full_q[lo:hi])
        assert s.tolist() == full_s[lo // 128:-(-hi // 128)].tolist()
    q, s = quantize_blockwise_fp8(w[:, 128:])
    assert as_bytes(q) == as_bytes(full_q[:, 128:]) and s.tolist() == full_s[:, 1:].tolist()


@pytest.mark.parametrize(
    "offset, length, total, whole",
    [(0, 128, 300, True), (128, 172, 300, True), (0, 300, 300, True), (64, 64, 300, False),
     (0, 100, 300, False), (256, 44, 300, True), (0, 0, 300, True), (128, 100, 300, False)],
)
def test_owns_whole_blocks(offset, length, total, whole):
    assert owns_whole_blocks(offset, length, total, 128) is whole


def test_owns_whole_blocks_rejects_a_shard_outside_the_dim():
    with pytest.raises(ValueError, match=r"\[256, 384\) is not inside a dim of 300"):
        owns_whole_blocks(256, 128, 300, 128)


def test_block_fp8_rejects_integer_weights_and_1d_weights():
    with pytest.raises(TypeError, match="torch.int32"):
        quantize_blockwise_fp8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"at least 2 dims, got shape \(4,\)"):
        quantize_blockwise_fp8(torch.ones(4))


def test_block_fp8_dequantize_rejects_mismatched_scales():
    q, s = quantize_blockwise_fp8(torch.ones(130, 4))
    with pytest.raises(ValueError, match=r"scale_inv shape \(1, 1\) .* expected \(2, 1\)"):
        dequantize_blockwise_fp8(q, s[:1])


# ---- MXFP8 ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES + [(4, 64), (2, 3, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_matches_the_reference_bit_for_bit(shape, dtype):
    w = weights(shape, dtype, seed=sum(shape) + 1)
    q, scales = quantize_mxfp8(w)
    ref_q, ref_s = over_leading_dims(ref_mxfp8, w.float().tolist(), depth=1)
    assert q.shape == w.shape and scales.dtype == torch.uint8
    assert tuple(scales.shape) == mxfp8_scale_shape(shape)
    assert scales.tolist() == ref_s
    assert as_bytes(q) == ref_q


def test_mxfp8_scale_bytes_of_known_blocks():
    # amax 448 -> 2^0 (byte 127); amax 449 -> 2^1 (128); amax 1 -> ceil(log2(1/448)) = -8 (119);
    # zero block -> the smallest exponent, clamped at byte 0.
    w = torch.zeros(4, 32)
    w[0, 5], w[1, 0], w[2, 31] = 448.0, 449.0, -1.0
    q, scales = quantize_mxfp8(w)
    assert scales.flatten().tolist() == [127, 128, 119, 0]
    assert as_bytes(q)[0][5] == 0x7E and as_bytes(q)[2][31] == 0x80 | e4m3_byte(256.0)


def test_mxfp8_round_trip_matches_the_reference_decode():
    w = weights((3, 200), torch.bfloat16, seed=5)
    q, scales = quantize_mxfp8(w)
    back = dequantize_mxfp8(q, scales, dtype=torch.float32)
    ref_q, ref_s = over_leading_dims(ref_mxfp8, w.float().tolist(), depth=1)
    expected = [[e4m3_value(b & 0x7F) * (-1 if b & 0x80 else 1) * 2.0 ** (s[j // 32] - 127)
                 for j, b in enumerate(row)] for row, s in zip(ref_q, ref_s)]
    assert back.tolist() == [[f32(v) for v in row] for row in expected]


def test_mxfp8_dequantize_rejects_mismatched_scales():
    q, s = quantize_mxfp8(torch.ones(2, 64))
    with pytest.raises(ValueError, match=r"expected \(2, 2\) torch.uint8"):
        dequantize_mxfp8(q, s.float())


# ---- sizes ----------------------------------------------------------------------------


def test_fp8_bytes_count_weights_and_scales():
    assert fp8_bytes((256, 384), "block_fp8") == 256 * 384 + 4 * 2 * 3
    assert fp8_bytes((2, 130, 260), "block_fp8") == 2 * 130 * 260 + 4 * 2 * 2 * 3
    assert fp8_bytes((4, 65), "mxfp8") == 4 * 65 + 4 * 3
    with pytest.raises(ValueError, match="'nvfp4'"):
        fp8_bytes((4, 4), "nvfp4")


def test_the_oracles_cuda_variant_divides_as_cuda_does():
    """On CUDA torch runs ``amax / 448`` (a Python-scalar divisor, vLLM's and ours) as
    ``amax * fp32(1 / 448)``: the oracle models it for refits quantized on a GPU. Some amax
    values round differently from the true division (that is why it matters)."""
    from megatron_reshard.testing.fp8_reference import reference_block_fp8

    w = weights((256, 384), torch.bfloat16, seed=34).float()
    amaxes = [max(abs(x) for r in w[i:i + 128].tolist() for x in r[j:j + 128])
              for i in (0, 128) for j in (0, 128, 256)]
    q, s = reference_block_fp8(w, device_type="cuda")
    inverse = f32(1.0 / 448.0)
    assert s.flatten().tolist() == [f32(max(a, AMAX_FLOOR) * inverse) for a in amaxes]
    assert as_bytes(q) == ref_cuda_block_fp8(w.tolist())
    grid = torch.linspace(1, 2, 4097)
    assert not torch.equal(grid * inverse, grid / 448.0)


def ref_cuda_block_fp8(matrix: list) -> list:
    """The bytes of ``ref_block_fp8`` with CUDA's scale: fp32(amax * fp32(1/448))."""
    n, k = len(matrix), len(matrix[0])
    q = [[0] * k for _ in range(n)]
    for bi in range(0, n, 128):
        for bj in range(0, k, 128):
            cells = [(i, j) for i in range(bi, min(bi + 128, n)) for j in range(bj, min(bj + 128, k))]
            amax = max(abs(matrix[i][j]) for i, j in cells)
            scale = f32(1.0 / f32(max(amax, AMAX_FLOOR) * f32(1.0 / 448.0)))
            for i, j in cells:
                q[i][j] = e4m3_byte(clamp448(f32(matrix[i][j] * scale)))
    return q


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_quantizer_on_a_gpu_gives_the_oracles_cuda_bytes():
    """A trainer quantizing on its GPU sends what the oracle's CUDA variant (and so a GPU
    vLLM quantizing online) computes: bytes and scales bit for bit, partial tiles and
    experts included."""
    from megatron_reshard.testing.fp8_reference import reference_block_fp8

    for shape, seed in (((256, 384), 35), ((300, 200), 36), ((3, 130, 260), 37)):
        w = weights(shape, torch.bfloat16, seed=seed)
        q, s = quantize_blockwise_fp8(w.cuda())
        rq, rs = reference_block_fp8(w.float(), device_type="cuda")
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)), shape
        assert torch.equal(s.cpu(), rs), shape
