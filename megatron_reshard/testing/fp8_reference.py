"""The oracle for a block-FP8 generation model: what each vLLM FP8 parameter must hold.

Torch only, and independent of the code under test (``megatron_reshard.fp8.quant``,
``fp8.plan``, ``receiver.fp8_targets``): the quantizer here walks the 128×128 tiles of a
full HF tensor one by one, and the vLLM layout is the BF16 oracle's slicing
(``vllm_like.expected_vllm_shard``) applied to the full quantized tensors, and to the full
scale tensors with every dim counted in tiles. Numerics, per tile (vLLM 0.33's online
block quantization, ``per_block_cast_to_fp8``, as it runs on the CPU), each step rounded
once to fp32 from exact float64 arithmetic: ``scale_inv = max(amax, fp32(1e-4)) / 448``,
``weight = e4m3(clamp(w * (1 / scale_inv), ±448))``; a partial edge tile takes its amax
from its own elements.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

import torch

from megatron_reshard.testing.vllm_like import (FORMATS, MX_BLOCK, TILE, _cfg, expected_vllm_shard,
                                                vllm_fp8_param_specs)

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # vLLM's floor on a tile's amax
CUDA_INV_448 = float(torch.tensor(1 / E4M3_MAX, dtype=torch.float32))  # CUDA's scalar divisor, inverted
HF_LINEAR_RE = re.compile(r"_proj(?:_with_mqa)?\.weight$")  # MLA: kv_a_proj_with_mqa too


def _pow2_scale(amax: float) -> float:
    """The largest power of two ``s`` with ``amax * s <= 448`` (1 for 0), from amax's exponent."""
    if amax == 0:
        return 1.0
    mantissa, exponent = math.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    return 2.0 ** ((9 if mantissa <= 0.875 else 8) - exponent)  # 448 = 0.875 * 2^9


def reference_block_fp8(weight: torch.Tensor, pow2: bool = False,
                        device_type: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale_inv) of a ``[..., N, K]`` tensor, tile by tile.

    ``pow2``: power-of-two scales (the largest with ``amax * scale <= 448``), as Transformer
    Engine's blockwise recipe keeps training weights (2-D tiles only). ``device_type``: where
    the quantizer under test ran: ``amax / 448`` is a true division on the CPU but
    ``amax * fp32(1 / 448)`` on CUDA (torch divides by a Python scalar that way there, in
    vLLM as in the trainer)."""
    if pow2:
        w = weight.detach().to("cpu", torch.float32)
        n, k = w.shape
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        scale_inv = torch.empty((math.ceil(n / TILE), math.ceil(k / TILE)), dtype=torch.float32)
        for bi, i in enumerate(range(0, n, TILE)):
            for bj, j in enumerate(range(0, k, TILE)):
                tile = w[i:i + TILE, j:j + TILE]
                scale = _pow2_scale(float(tile.abs().max()))
                q[i:i + TILE, j:j + TILE] = (tile * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
                scale_inv[bi, bj] = 1.0 / scale
        return q, scale_inv
    w = weight.detach().to("cpu", torch.float32)
    *lead, n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((*lead, math.ceil(n / TILE), math.ceil(k / TILE)), dtype=torch.float32)
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32).double()
    for bi, i in enumerate(range(0, n, TILE)):
        for bj, j in enumerate(range(0, k, TILE)):
            tile = w[..., i:i + TILE, j:j + TILE].double()
            amax = torch.maximum(tile.abs().flatten(-2).max(dim=-1).values, floor)
            if device_type == "cuda":
                sf = (amax * CUDA_INV_448).float()  # the product is exact in float64
            else:
                sf = (amax / E4M3_MAX).float()  # one rounding: float64 holds the exact quotient's bits
            inverse = (1.0 / sf.double()).float().double()
            scaled = (tile * inverse[..., None, None]).float()
            q[..., i:i + TILE, j:j + TILE] = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            scale_inv[..., bi, bj] = sf
    return q, scale_inv


def reference_mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, uint8 E8M0 scales) per 32 elements of a row: the scale is the
    smallest power of two ``2^j`` with ``amax <= 448 * 2^j`` (amax at least the smallest
    normal fp32), stored as ``j + 127`` clamped to [0, 254]."""
    w = weight.detach().to("cpu", torch.float32)
    k = w.shape[-1]
    nb = math.ceil(k / MX_BLOCK)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((*w.shape[:-1], nb), dtype=torch.uint8)
    for b in range(nb):
        block = w[..., b * MX_BLOCK:(b + 1) * MX_BLOCK]
        amax = block.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
        mantissa, exponent = torch.frexp(amax)  # amax = m * 2^e; 448 = 0.875 * 2^9
        j = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
        biased = (j + 127).clamp(0, 254)
        factor = torch.pow(torch.tensor(2.0, dtype=torch.float64), (biased - 127).double()).float()
        q[..., b * MX_BLOCK:(b + 1) * MX_BLOCK] = (block / factor[..., None]).clamp(
            -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scales[..., b] = biased.to(torch.uint8)
    return q, scales


def quantize_full_hf(full_hf_tensors: Mapping[str, torch.Tensor], fmt: str = "block_fp8",
                     pow2: bool = False, device_type: str = "cpu") -> tuple[dict, dict, dict]:
    """(FP8 bytes as uint8, scales, the unquantized rest) of full HF tensors; ``device_type``:
    where the quantizer under test runs (``reference_block_fp8``)."""
    bytes_, scales, plain = {}, {}, {}
    for name, t in full_hf_tensors.items():
        if HF_LINEAR_RE.search(name) and t.dim() >= 2:
            q, s = reference_mxfp8(t) if fmt == "mxfp8" else reference_block_fp8(t, pow2=pow2, device_type=device_type)
            bytes_[name], scales[name] = q.view(torch.uint8), s
        else:
            plain[name] = t
    return bytes_, scales, plain


def expected_vllm_fp8_params(hf_config: Mapping[str, Any], full_hf_tensors: Mapping[str, torch.Tensor],
                             tp_rank: int, tp_size: int, ep_size: int = 1,
                             ep_rank: Optional[int] = None, pow2: bool = False,
                             fmt: str = "block_fp8", quantized: Optional[tuple] = None
                             ) -> dict[str, torch.Tensor]:
    """Every param of the FP8 vLLM model on one rank, from full HF tensors.

    ``pow2``: the weights were trained in blockwise FP8 (``testing.fp8_training``): the full
    tensors are their dequantized values, whose power-of-two quantization gives back the
    training bytes and scales (one encoding per value, see there). ``quantized``: the
    result of ``quantize_full_hf`` for these tensors, to share it between ranks."""
    c = _cfg(hf_config)
    bytes_, scales, plain = quantized or quantize_full_hf(full_hf_tensors, fmt, pow2)
    # the scale tensors are the weights counted in tiles: the same layout with dims in tiles
    suffix, _, (tile_rows, _) = FORMATS[fmt]
    tiled_cfg = dict(c, head_dim=math.ceil(c["head_dim"] / tile_rows))
    out = {}
    specs = vllm_fp8_param_specs(hf_config, tp_rank, tp_size, ep_size, ep_rank, fmt=fmt)
    for name, (_, dtype) in specs.items():
        if name.endswith(suffix):
            out[name] = expected_vllm_shard(tiled_cfg, name[: -len(suffix)], scales, tp_rank,
                                            tp_size, ep_size, ep_rank)
        elif dtype == torch.float8_e4m3fn:
            out[name] = expected_vllm_shard(c, name, bytes_, tp_rank, tp_size, ep_size,
                                            ep_rank).view(torch.float8_e4m3fn)
        else:
            out[name] = expected_vllm_shard(c, name, plain, tp_rank, tp_size, ep_size, ep_rank)
    return out


__all__ = [
    "quantize_full_hf", "reference_mxfp8", "expected_vllm_fp8_params", "reference_block_fp8",
]
