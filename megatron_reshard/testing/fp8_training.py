"""Blockwise-FP8 training weights built from plain tensors (CPU stand-in for TE ``fp8_param``).

``attach_blockwise_fp8_(model)`` quantizes every linear weight of a Megatron model (the
layers Transformer Engine would keep in FP8: ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``, experts included) tile by tile over the rank's local shard, with
power-of-two scales as TE's blockwise recipe uses by default, attaches the result as
``param.blockwise_fp8`` (``megatron.fp8_storage.BlockwiseFp8Weight``) and sets the
parameter's BF16 values to the dequantized weight (exact: e4m3 times a power of two).
Call it again after changing the weights.
"""

from __future__ import annotations

import torch

from megatron_reshard.megatron.fp8_storage import BlockwiseFp8Weight

TE_FP8_LINEAR_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                          "linear_fc2.weight")
_TILE, _MAX = 128, 448.0


def _quantize_pow2(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.detach().float()
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((-(-n // _TILE), -(-k // _TILE)), dtype=torch.float32)
    for bi, i in enumerate(range(0, n, _TILE)):
        for bj, j in enumerate(range(0, k, _TILE)):
            tile = w[i:i + _TILE, j:j + _TILE]
            amax = float(tile.abs().max())
            # largest power of two with amax * scale <= 448 (1 for an all-zero tile)
            scale = 1.0 if amax == 0 else 2.0 ** int(torch.floor(torch.log2(torch.tensor(_MAX / amax))))
            block = (tile * scale).clamp(-_MAX, _MAX).to(torch.float8_e4m3fn)
            # one encoding per value: the tile's largest byte above 224 (else double the scale),
            # so the block is also what the same rule gives from the dequantized values
            while amax and float(block.float().abs().max()) <= _MAX / 2:
                scale *= 2
                block = (tile * scale).clamp(-_MAX, _MAX).to(torch.float8_e4m3fn)
            q[i:i + _TILE, j:j + _TILE] = block
            scale_inv[bi, bj] = 1.0 / scale
    return q, scale_inv


@torch.no_grad()
def attach_blockwise_fp8_(model: torch.nn.Module) -> int:
    """Quantize the model's linear weights in place (see module doc); returns how many."""
    count = 0
    for name, param in model.named_parameters():
        if not name.endswith(TE_FP8_LINEAR_SUFFIXES) or param.dim() != 2:
            continue
        q, scale_inv = _quantize_pow2(param.cpu())
        dequant = q.float() * scale_inv.repeat_interleave(_TILE, 0)[: q.shape[0]].repeat_interleave(
            _TILE, 1)[:, : q.shape[1]]
        param.copy_(dequant.to(param.dtype))
        held = getattr(param, "blockwise_fp8", None)
        if isinstance(held, BlockwiseFp8Weight):  # in place: the refit holds views of it
            held.data.copy_(q)
            held.scale_inv.copy_(scale_inv)
        else:
            param.blockwise_fp8 = BlockwiseFp8Weight(q.to(param.device), scale_inv.to(param.device))
        count += 1
    return count


__all__ = ["TE_FP8_LINEAR_SUFFIXES", "attach_blockwise_fp8_"]
