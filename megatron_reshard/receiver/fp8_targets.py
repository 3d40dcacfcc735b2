"""Block-FP8 vLLM storage on the receiving side: scale boxes, FP8 receive recipes, quantize-on-write.

Torch + stdlib only. A vLLM linear (or FusedMoE) weight loaded with block quantization
(``weight_block_size`` [128, 128]) is a ``float8_e4m3fn`` parameter with an fp32 sibling
``<weight>_scale_inv`` holding one scale per 128×128 tile of its last two dims:
``qkv_proj.weight`` / ``qkv_proj.weight_scale_inv``, ``gate_up_proj``, ``o_proj``,
``down_proj`` likewise, FusedMoE ``w13_weight`` / ``w13_weight_scale_inv`` ``[E_local,
2·ceil(I_p/128), ceil(H/128)]`` and ``w2_weight`` / ``w2_weight_scale_inv``. The receiver
recognises such a target by its dtype (``float8_e4m3fn``), never by a model name.

A piece of a weight (``targets.Piece``: a box of the target, a box of the HF tensor) maps
to a piece of the scales when both boxes are made of whole tiles (the HF tensor's last
tile and the target's last tile may be partial). vLLM's fused FP8 layers require every
part (q, k, v; gate, up) to be whole tiles, so the fused scale is the concatenation of the
parts' scales. Anything else is a ``TargetError`` naming the param, the rank, what was
expected and what was found, raised while mapping (before any communication).

Three ways a weight arrives (see ``megatron_reshard.fp8.plan``):

- FP8 bytes (quantized by the sender): received in place; its scales arrive as their own
  entry ``<name>_scale_inv`` and are received in place into the scale box (refused while
  mapping for a layer vLLM quantizes online: ``receiver.online_quant``);
- BF16 (the sender's shard does not own whole tiles): received into a scratch buffer of
  the region's size (one param at a time, bounded by the engine's batch), then quantized
  into the FP8 box and its scale box (``quantize_into``);
- a full HF tensor on the packed path: its slice is quantized the same way.

A region made of whole tiles quantizes on its own to exactly the bytes and scales of the
same tiles of the full tensor (``megatron_reshard.fp8.quant``), so all three give the bytes of
"quantize the full HF tensor, then slice it by the vLLM layout". A target of a layer vLLM
quantizes online (``VllmTargets.quantizers``) is quantized with vLLM's own function instead
(``receiver.online_quant``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron_reshard.layout.geometry import box_shape, rank_box
from megatron_reshard.fp8.plan import MXFP8_TILE, SCALE_SUFFIX, tile_box
from megatron_reshard.fp8.quant import (
    BLOCK_FP8_TILE,
    blockwise_scale_shape,
    quantize_blockwise_fp8,
    quantize_mxfp8,
)
from megatron_reshard.receiver.online_quant import sender_quantized_refusal
from megatron_reshard.receiver.targets import (
    Piece,
    TargetError,
    TargetPlan,
    VllmTargets,
    receive_spec,
)
from megatron_reshard.wire.spec import LocalParamSpec, RefitCtx
from megatron_reshard.vllm_layout.dense import is_qkv_per_group, per_group_as_hf_rows
from megatron_reshard.wire.records import ParamRecord

FP8_DTYPE = torch.float8_e4m3fn


def is_fp8_target(targets: VllmTargets, target: str) -> bool:
    return targets.params[target].dtype == FP8_DTYPE


def _tile_box(box: Sequence[tuple[int, int]], shape: Sequence[int],
              tile: Sequence[int]) -> tuple[Optional[tuple], str]:
    """A box of a tensor of ``shape`` in tile units over the last two dims (leading dims kept;
    ``fp8.plan.tile_box``), or None and why when it cuts a tile. A start must be a multiple
    of the tile, even an empty box's at the end of the dim."""
    tiled = tile_box(box, shape, tile)
    for d, block in ((len(shape) - 2, tile[0]), (len(shape) - 1, tile[1])):
        a, b = box[d]
        if a % block or None in tiled[d]:
            return None, (f"dim {d} [{a}, {b}) of {int(shape[d])} (expected a start at a multiple "
                          f"of {block} and an end at a multiple of {block} or at {int(shape[d])})")
    return tiled, ""


# MXFP8 (vLLM ModelOpt MXFP8): E8M0 scale bytes per 32 elements of a row, in the checkpoint
# layout; after its first load vLLM keeps that copy as ``<weight>_scale_from_checkpoint``
# and a swizzled one as ``<weight>_scale``, so the checkpoint copy is preferred when present.
MX_SCALE_SUFFIXES = ("_scale_from_checkpoint", "_scale")


def scale_format(targets: VllmTargets, hf_name: str, target: str) -> tuple[str, tuple[int, int], torch.dtype]:
    """(scale param, tile, scale dtype) of an FP8 target: block FP8 or MXFP8, by its sibling."""
    if target + SCALE_SUFFIX in targets.params:
        return target + SCALE_SUFFIX, BLOCK_FP8_TILE, torch.float32
    for suffix in MX_SCALE_SUFFIXES:
        if target + suffix in targets.params:
            return target + suffix, MXFP8_TILE, torch.uint8
    raise TargetError(f"{hf_name}: vLLM param {target!r} on {targets.where()} is float8_e4m3fn "
                      f"but has no scale param: expected {target + SCALE_SUFFIX!r} (block FP8) or "
                      f"{target + MX_SCALE_SUFFIXES[0]!r} / {target + MX_SCALE_SUFFIXES[1]!r} (MXFP8)")


def scale_piece(targets: VllmTargets, hf_name: str, piece: Piece, hf_shape: Sequence[int]) -> Piece:
    """The box of the scale target (and of the HF scale tensor) that goes with ``piece``."""
    scale, tile, sdtype = scale_format(targets, hf_name, piece.target)
    weight = targets.params[piece.target]
    expected = blockwise_scale_shape(weight.shape, tuple(tile))
    found = targets.params[scale]
    if tuple(found.shape) != expected or found.dtype != sdtype:
        raise TargetError(f"{hf_name}: block scale {scale!r} on {targets.where()} is "
                          f"{list(found.shape)} {found.dtype}, expected {list(expected)} "
                          f"{sdtype} for a {list(weight.shape)} weight in "
                          f"{tile[0]}x{tile[1]} blocks")
    t_box, why = _tile_box(piece.target_region, weight.shape, tile)
    if t_box is None:
        raise TargetError(f"{hf_name}: on {targets.where()} its box {list(piece.target_region)} of "
                          f"{piece.target!r} cuts a {tile[0]}x{tile[1]} FP8 block: {why}")
    # a piece may drop a leading size-1 dim (one expert of w13): tile the HF box on its own
    h_box, why = _tile_box(piece.hf_region, hf_shape, tile)
    if h_box is None:
        raise TargetError(f"{hf_name}: on {targets.where()} its HF region {list(piece.hf_region)} "
                          f"of {list(hf_shape)} cuts a {tile[0]}x{tile[1]} FP8 block: {why}")
    return Piece(scale, t_box, h_box)


def fp8_scale_pieces(targets: VllmTargets, plan: TargetPlan) -> dict[int, Piece]:
    """piece index -> scale piece, for the plan's pieces whose targets are FP8."""
    return {i: scale_piece(targets, plan.hf_name, piece, plan.hf_shape)
            for i, piece in enumerate(plan.pieces) if is_fp8_target(targets, piece.target)}


def quantize_into(targets: VllmTargets, piece: Piece, scale: Piece, values: torch.Tensor) -> int:
    """Quantize ``values`` (the HF region of ``piece``) into the FP8 box and its scale box.
    Returns the bytes written."""
    dst = targets.view(piece)
    if piece.target in targets.quantizers:  # vLLM's online block FP8: vLLM's own function,
        targets.quantizers.write(targets, piece, scale, values)  # per matrix (online_quant)
        return dst.numel() + targets.view(scale).numel() * 4
    if targets.params[scale.target].dtype == torch.uint8:  # MXFP8: E8M0 bytes
        q, s = quantize_mxfp8(values.reshape(dst.shape))
    else:
        q, s = quantize_blockwise_fp8(values.reshape(dst.shape))
    dst.copy_(q)
    sdst = targets.view(scale)
    sdst.copy_(s.reshape(sdst.shape))
    return dst.numel() + sdst.numel() * 4


def _single_piece(targets: VllmTargets, name: str, hf_shape: tuple, hf_region: tuple) -> TargetPlan:
    plan = targets.resolve(name, hf_shape)
    if plan.zero or len(plan.pieces) != 1 or plan.pieces[0].hf_region != tuple(hf_region):
        want = [list(p.hf_region) for p in plan.pieces]
        raise TargetError(f"{name}: the payload delivers region {list(hf_region)} to "
                          f"{targets.where()}, but vLLM's layout on this rank expects "
                          f"{want or 'nothing'}")
    return plan


def fp8_receive_spec(targets: VllmTargets, p: ParamRecord, rank_in_group: int,
                     strided_in_place: bool = True) -> Optional[tuple[LocalParamSpec, TargetPlan]]:
    """The receive recipe and plan of one bulk entry when it involves FP8 storage, else None.

    ``p`` is a payload record this rank receives a region of.
    """
    name, wire = p.name, p.torch_dtype
    region = rank_box(p.global_shape, p.dst_mesh_info, p.dst_placements, rank_in_group)
    if p.gen_quant == "scale":
        return _scale_spec(targets, p, region, rank_in_group, strided_in_place)
    shape = p.global_shape
    per_group = is_qkv_per_group(name, shape)  # weights [nkv, rows, H] and biases [nkv, rows]
    hf_shape, hf_region = per_group_as_hf_rows(shape, region) if per_group else (shape, tuple(region))
    plan = targets.resolve(name, hf_shape)
    if not any(is_fp8_target(targets, piece.target) for piece in plan.pieces):
        if wire == FP8_DTYPE:
            raise TargetError(f"{name}: dtype mismatch on {targets.where()}: the payload sends "
                              f"FP8 bytes but the vLLM params {[pc.target for pc in plan.pieces]} "
                              f"are not float8_e4m3fn (is the model loaded with block FP8?)")
        return None
    plan = _single_piece(targets, name, hf_shape, hf_region)
    piece = plan.pieces[0]
    scale = scale_piece(targets, name, piece, hf_shape)  # checks whole tiles on this rank
    wire_shape = box_shape(region)
    if wire == FP8_DTYPE and targets.params[scale.target].dtype != torch.float32:
        raise TargetError(f"{name}: the payload sends block-FP8 bytes but {piece.target!r} on "
                          f"{targets.where()} is an MXFP8 param (scales {scale.target!r}): MXFP8 "
                          f"is quantized on the receiver from BF16")
    if wire == FP8_DTYPE and piece.target in targets.quantizers:
        raise TargetError(sender_quantized_refusal(
            name, piece.target, targets.where(), f"FP8 bytes quantized by the sender (gen_quant "
            f"{p.gen_quant!r}, wire dtype {p.dtype})"))
    if wire == FP8_DTYPE:
        if per_group:
            return LocalParamSpec(base=targets.view(piece).view(wire_shape)), plan
        return receive_spec(targets, piece, strided_in_place), plan
    if not wire.is_floating_point:
        raise TargetError(f"{name}: dtype mismatch on {targets.where()}: wire dtype {wire} cannot "
                          f"be quantized into the FP8 param {piece.target!r}")
    device = targets.params[piece.target].device
    hf_box = box_shape(piece.hf_region)

    def pre(_base: Any) -> RefitCtx:  # BF16 scratch of this rank's region only
        return RefitCtx(buf=torch.empty(wire_shape, dtype=wire, device=device))

    def post(ctx: RefitCtx) -> None:
        quantize_into(targets, piece, scale, ctx.buf.reshape(hf_box))

    plan.pieces.append(scale)  # both boxes are written by this param
    return LocalParamSpec(base=targets.view(piece), pre=pre, post=post), plan


def _scale_spec(targets: VllmTargets, p: ParamRecord, region, rank_in_group: int,
                strided_in_place: bool) -> tuple[LocalParamSpec, TargetPlan]:
    """The scales of a weight quantized by the sender: received in place into the scale box."""
    name, weight = p.name, p.scale_of
    w_shape = p.weight_shape or ()
    if not isinstance(weight, str) or len(w_shape) < 2:
        raise TargetError(f"{name}: scale entry without 'scale_of' / 'weight_shape' on "
                          f"{targets.where()}")
    if p.torch_dtype != torch.float32:
        raise TargetError(f"{name}: scale wire dtype {p.dtype} on {targets.where()}, expected "
                          f"torch.float32")
    w_region = rank_box(w_shape, p.dst_mesh_info, p.dst_placements, rank_in_group)
    shape = p.global_shape
    per_group = len(w_shape) == 3 and is_qkv_per_group(weight, w_shape)
    if per_group:
        w_shape, w_region = per_group_as_hf_rows(w_shape, w_region)
        s_shape, s_region = per_group_as_hf_rows(shape, region)
    else:
        s_shape, s_region = shape, tuple(region)
    plan = _single_piece(targets, weight, w_shape, w_region)
    if not is_fp8_target(targets, plan.pieces[0].target):
        raise TargetError(f"{name}: the payload sends block scales but vLLM param "
                          f"{plan.pieces[0].target!r} on {targets.where()} is "
                          f"{targets.params[plan.pieces[0].target].dtype}, not float8_e4m3fn")
    if plan.pieces[0].target in targets.quantizers:
        raise TargetError(sender_quantized_refusal(
            name, plan.pieces[0].target, targets.where(), f"block scales computed by the sender "
            f"(gen_quant {p.gen_quant!r}) for {weight}"))
    scale = scale_piece(targets, weight, plan.pieces[0], w_shape)
    if targets.params[scale.target].dtype != torch.float32:
        raise TargetError(f"{name}: the payload sends block scales but {scale.target!r} on "
                          f"{targets.where()} holds MXFP8 scales")
    if scale.hf_region != tuple(s_region) or blockwise_scale_shape(w_shape) != s_shape:
        raise TargetError(f"{name}: the payload delivers scale region {list(s_region)} of "
                          f"{list(s_shape)} to {targets.where()}, but its weight's region there "
                          f"has scales {list(scale.hf_region)} of {list(blockwise_scale_shape(w_shape))}")
    out = TargetPlan(name, s_shape, pieces=[scale])
    if per_group:
        return LocalParamSpec(base=targets.view(scale).view(box_shape(region))), out
    return receive_spec(targets, scale, strided_in_place), out


__all__ = ["FP8_DTYPE", "fp8_receive_spec", "fp8_scale_pieces", "is_fp8_target", "quantize_into",
           "scale_piece"]
