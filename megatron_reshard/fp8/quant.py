"""FP8 weight quantizers for generation: block-FP8 (128×128, fp32 ``scale_inv``) and MXFP8.

Torch only, any device. The refit uses them through ``fp8.plan`` (which weights are
quantized where), ``megatron.fp8_source`` (the sender) and ``receiver.fp8_targets`` (the
receiver). What each format is:

- **Block FP8** (vLLM's block-quantized FP8 linear / MoE weights, ``weight_block_size``
  [128, 128]): ``weight`` in ``float8_e4m3fn`` with the shape of the high-precision weight
  and ``weight_scale_inv`` in fp32 with one entry per 128×128 tile of the last two dims
  (``ceil(N/128) × ceil(K/128)``; leading dims, e.g. MoE experts, are kept). Dequantized,
  ``w ≈ weight * weight_scale_inv[i // 128, j // 128]``. Per tile, in fp32, exactly as
  vLLM 0.33 quantizes a BF16 checkpoint online (``--quantization fp8_per_block``: its
  ``per_block_cast_to_fp8`` without UE8M0), so that a refit gives the bytes vLLM would
  hold: ``scale_inv = max(amax, 1e-4) / 448`` and ``weight = e4m3(w * (1 / scale_inv))``
  (the same torch expressions, so the same rounding on each device: a true division on
  CPU, a multiply by the reciprocal where CUDA divides by a scalar). Not used for vLLM's
  online block FP8 any more: there one element in two million came out one step off on an
  H200, so the receiver calls vLLM's own function (``receiver.online_quant``). A zero tile gets
  ``scale_inv = 1e-4 / 448`` and zero bytes. With ``pow2_scales`` (DeepGEMM's
  UE8M0 scales) the scale is the power of two ``2^-ceil(log2(amax / 448))``, its exponent
  clamped to [-127, 127], and 1 when it clamps to -127. A partial edge tile takes its amax
  from its own elements only (vLLM pads with zeros, which leave the amax alone), so a shard
  that owns whole tiles quantizes to exactly the bytes of the same tiles of the full tensor
  (see ``owns_whole_blocks``).
- **MXFP8** (OCP microscaling, as vLLM's torch MXFP8 quantizer): blocks of 32 consecutive
  elements of the last dim, each with one E8M0 scale byte ``s`` (power of two
  ``2^(s - 127)``, ``s = clamp(ceil(log2(amax / 448)) + 127, 0, 254)``, amax at least the
  smallest normal fp32) and ``weight = e4m3(w / 2^(s - 127))``. A last block shorter than
  32 (K not a multiple of 32) is quantized from its own elements. ``ceil(log2)`` is taken
  exactly from the fp32 ratio's bits rather than with a float ``log2``, so the bytes do not
  depend on the device's ``log2`` rounding. Not done here: NeMo-RL's vLLM path then turns
  scale byte 0 into 1 for FlashInfer's TRTLLM kernel; that belongs with the receiver.

All arithmetic is fp32; the cast to e4m3 rounds to nearest, ties to even.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_reshard.errors import BadInputError, BadInputTypeError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK_FP8_TILE = (128, 128)
MXFP8_BLOCK = 32
E8M0_BIAS = 127
AMAX_FLOOR = 1e-4  # vLLM's per_block_cast_to_fp8 clamps every tile's amax up to this


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blockwise_scale_shape(shape: torch.Size | tuple, tile: tuple[int, int] = BLOCK_FP8_TILE) -> tuple:
    """Shape of ``scale_inv`` for a weight of ``shape``: tiles over the last two dims."""
    if len(shape) < 2:
        raise BadInputError(f"block FP8 needs a weight of at least 2 dims, got shape {tuple(shape)}")
    return (*shape[:-2], _ceil_div(shape[-2], tile[0]), _ceil_div(shape[-1], tile[1]))


def mxfp8_scale_shape(shape: torch.Size | tuple) -> tuple:
    """Shape of the E8M0 scales for a weight of ``shape``: one per 32 elements of the last dim."""
    if len(shape) < 1:
        raise BadInputError("MXFP8 needs a weight of at least 1 dim, got a scalar")
    return (*shape[:-1], _ceil_div(shape[-1], MXFP8_BLOCK))


def owns_whole_blocks(offset: int, length: int, global_length: int, block: int) -> bool:
    """Whether a shard ``[offset, offset + length)`` of a dim of ``global_length`` is made of
    whole quantization blocks (the global last block may be partial), so it can be quantized
    on its own and give the bytes and scales of the same blocks of the full tensor."""
    if not (0 <= offset and 0 <= length and offset + length <= global_length):
        raise BadInputError(f"shard [{offset}, {offset + length}) is not inside a dim of {global_length}")
    end = offset + length
    return offset % block == 0 and (end % block == 0 or end == global_length)


def _exact_ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` for positive fp32 ``x`` (subnormals too), exact, as int32; a large
    exponent for inf, so that callers' clamps give the largest scale exponent."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.where(torch.isinf(x), 1 << 16, exponent)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2^exponent`` as fp32, exact (subnormal results included)."""
    return torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32, device=exponent.device), exponent)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_blockwise_fp8(weight: torch.Tensor, *, pow2_scales: bool = False,
                           tile: tuple[int, int] = BLOCK_FP8_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` (``[..., N, K]``, any float dtype) to block FP8.

    Returns ``(weight_fp8, scale_inv)``: ``float8_e4m3fn`` of ``weight``'s shape and fp32
    of ``blockwise_scale_shape(weight.shape, tile)``, on ``weight``'s device.
    """
    if not weight.is_floating_point():
        raise BadInputTypeError(f"quantize_blockwise_fp8: expected a floating-point weight, got {weight.dtype}")
    scale_shape = blockwise_scale_shape(weight.shape, tile)
    *lead, n, k = weight.shape
    tn, tk = tile
    bn, bk = scale_shape[-2:]
    # Zero padding leaves every tile's amax unchanged (|x| >= 0) and is cropped afterwards.
    padded = F.pad(weight.float(), (0, bk * tk - k, 0, bn * tn - n))
    tiles = padded.reshape(*lead, bn, tn, bk, tk)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)  # [..., bn, 1, bk, 1]
    if pow2_scales:
        exponent = _exact_ceil_log2(amax / FP8_MAX)
        exponent = torch.where(amax == 0, -E8M0_BIAS, exponent).clamp(-E8M0_BIAS, E8M0_BIAS)
        # The clamped-out exponent -127 means "tiny or zero tile": no scaling, as NeMo-RL does.
        scale = torch.where(exponent == -E8M0_BIAS, 1.0, _pow2(-exponent))
        q = _to_e4m3(tiles * scale).reshape(padded.shape)[..., :n, :k]
        return q.contiguous(), torch.reciprocal(scale).reshape(scale_shape).contiguous()
    # vLLM's expressions, operand for operand: ``amax / 448`` with a Python float (CUDA runs
    # it as a multiply by the reciprocal, the CPU as a true division) and ``1.0 / sf``
    # (torch's ``reciprocal``); the clamp to ±448 changes no byte (|w| * (1 / sf) rounds
    # to at most 448 in e4m3) and keeps a stray value finite.
    scale_inv = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    q = _to_e4m3(tiles * (1.0 / scale_inv)).reshape(padded.shape)[..., :n, :k]
    return q.contiguous(), scale_inv.reshape(scale_shape).contiguous()


def dequantize_blockwise_fp8(weight_fp8: torch.Tensor, scale_inv: torch.Tensor,
                             dtype: torch.dtype = torch.bfloat16,
                             tile: tuple[int, int] = BLOCK_FP8_TILE) -> torch.Tensor:
    """``weight_fp8 * scale_inv`` per tile, in fp32, returned as ``dtype``."""
    expected = blockwise_scale_shape(weight_fp8.shape, tile)
    if tuple(scale_inv.shape) != expected:
        raise BadInputError(f"dequantize_blockwise_fp8: scale_inv shape {tuple(scale_inv.shape)} does not "
                         f"match weight shape {tuple(weight_fp8.shape)}: expected {expected}")
    n, k = weight_fp8.shape[-2:]
    scales = scale_inv.float().repeat_interleave(tile[0], dim=-2)[..., :n, :]
    scales = scales.repeat_interleave(tile[1], dim=-1)[..., :k]
    return (weight_fp8.float() * scales).to(dtype)


def quantize_mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` (``[..., K]``, any float dtype) to MXFP8.

    Returns ``(weight_fp8, scales)``: ``float8_e4m3fn`` of ``weight``'s shape and ``uint8``
    E8M0 biased exponents of ``mxfp8_scale_shape(weight.shape)``.
    """
    if not weight.is_floating_point():
        raise BadInputTypeError(f"quantize_mxfp8: expected a floating-point weight, got {weight.dtype}")
    scale_shape = mxfp8_scale_shape(weight.shape)
    k = weight.shape[-1]
    nb = scale_shape[-1]
    blocks = F.pad(weight.float(), (0, nb * MXFP8_BLOCK - k)).reshape(*scale_shape, MXFP8_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    biased = (_exact_ceil_log2(amax / FP8_MAX) + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS)
    descale = _pow2(biased - E8M0_BIAS)
    q = _to_e4m3(blocks / descale.unsqueeze(-1)).reshape(*scale_shape[:-1], nb * MXFP8_BLOCK)[..., :k]
    return q.contiguous(), biased.to(torch.uint8)


def dequantize_mxfp8(weight_fp8: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight_fp8 * 2^(scale - 127)`` per 32-element block, in fp32, returned as ``dtype``."""
    expected = mxfp8_scale_shape(weight_fp8.shape)
    if tuple(scales.shape) != expected or scales.dtype != torch.uint8:
        raise BadInputError(f"dequantize_mxfp8: scales {tuple(scales.shape)} {scales.dtype} do not match "
                         f"weight shape {tuple(weight_fp8.shape)}: expected {expected} torch.uint8")
    k = weight_fp8.shape[-1]
    factors = torch.exp2(scales.float() - E8M0_BIAS).repeat_interleave(MXFP8_BLOCK, dim=-1)[..., :k]
    return (weight_fp8.float() * factors).to(dtype)


def fp8_bytes(shape: torch.Size | tuple, fmt: str) -> int:
    """Bytes of a weight of ``shape`` in ``fmt`` ('block_fp8' or 'mxfp8'), scales included."""
    n = math.prod(shape)
    if fmt == "block_fp8":
        return n + 4 * math.prod(blockwise_scale_shape(shape))
    if fmt == "mxfp8":
        return n + math.prod(mxfp8_scale_shape(shape))
    raise BadInputError(f"fp8_bytes: unknown format {fmt!r}; expected 'block_fp8' or 'mxfp8'")
