"""Training side of a block-FP8 refit: quantize the local shard right before it is sent.

For every entry ``fp8.plan.plan_block_fp8`` marked ``"gen_quant": "sender"`` (every
training rank's shard is made of whole 128x128 tiles), the BF16 recipe of the weight (a
view, or a rank's experts as a list of tensors) is wrapped: its ``pre`` hook quantizes the shard into a
``float8_e4m3fn`` buffer, and keeps the scales for the ``<name>_scale_inv`` entry that
follows it in payload order. The buffers live for one batch, as any ``pre`` buffer. Entries
quantized by the receiver keep their BF16 recipe.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_reshard.fp8.plan import scale_name
from megatron_reshard.megatron.converters import local_views
from megatron_reshard.megatron.fp8_storage import blockwise_fp8_storage
from megatron_reshard.megatron.qkv import megatron_qkv_blocks
from megatron_reshard.fp8.quant import BLOCK_FP8_TILE, quantize_blockwise_fp8
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx
from megatron_reshard.vllm_layout.dense import AttentionHeads
from megatron_reshard.wire.expert_names import PER_EXPERT_RE, grouped_name
from megatron_reshard.wire.records import ParamRecord, RefitPayload


class _ShardQuantizer:
    """Quantizes one param's local shard once per refit; the scale entry takes the scales."""

    def __init__(self, spec: LocalParamSpec):
        self.spec = spec
        self.scales: Optional[torch.Tensor] = None

    def _quantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.spec.begin()
        try:
            if isinstance(ctx.buf, (list, tuple)):
                # a rank's experts as separate tensors (no stacking buffer): tiles never
                # cross experts, so each is quantized alone and only the FP8 result stacked
                parts = [quantize_blockwise_fp8(t) for t in ctx.buf]
                return (torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))
            return quantize_blockwise_fp8(ctx.buf)
        finally:
            self.spec.finish(ctx)

    def weight(self, _base: Any) -> RefitCtx:
        q, self.scales = self._quantize()
        return RefitCtx(buf=q)

    def scale(self, _base: Any) -> RefitCtx:
        scales, self.scales = self.scales, None
        if scales is None:  # the weight was not opened first on this rank: quantize again
            scales = self._quantize()[1]
        return RefitCtx(buf=scales)


def fp8_sender_specs(specs: HFToLocalParamMap, fp8_info: RefitPayload, stage: int,
                     fp8_views: Optional[dict] = None) -> HFToLocalParamMap:
    """``specs`` (the BF16 recipes of this rank's stage) with the sender-quantized weights
    wrapped, the weights held in FP8 for training replaced by their bytes, and the scale
    entries added."""
    out = dict(specs.specs)
    for p in fp8_info.params():
        if p.stage != stage:
            continue
        if p.gen_quant == "train_fp8":
            pair = train_fp8_specs(p, fp8_views or {})
            if pair is not None:
                out[p.name], out[scale_name(p.name)] = pair
            continue
        if p.gen_quant != "sender":
            continue
        spec = specs.get(p.name)
        if spec is None:  # this rank holds no shard of it
            continue
        quantizer = _ShardQuantizer(spec)
        out[p.name] = LocalParamSpec(base=spec.base, pre=quantizer.weight)
        out[scale_name(p.name)] = LocalParamSpec(base=spec.base, pre=quantizer.scale)
    return HFToLocalParamMap(out)


__all__ = ["fp8_sender_specs"]


# ------------------------------------------------------------- blockwise-FP8 training weights

def _qkv_fp8_views(conv: Any, data: torch.Tensor, scale: torch.Tensor, dims: Any, tp_rank: int,
                   tile: int) -> tuple[dict, Optional[str]]:
    """q, k, v views (data, scales) of a blockwise-FP8 ``linear_qkv`` shard in the per-KV-group
    form the refit sends (``qkv.qkv_views``): ``[groups, rows, H]`` of whole groups when
    TP <= nkv, else ``[1, rows, H]`` of the slice of one group this rank holds
    (``megatron_qkv_blocks``); and the problem, if a cut is not on a tile boundary."""
    nkv, nh, hd = dims.num_query_groups, dims.num_attention_heads, dims.head_dim
    tp, q_rows = dims.tp_size, nh // nkv * hd
    if q_rows % tile or hd % tile:
        return {}, (f"{conv.megatron_name}: blockwise FP8 q/k/v rows per KV group "
                    f"({q_rows} q, {hd} k/v) are not whole {tile}-row blocks")
    q_name, k_name, v_name = conv.hf_names
    if tp <= nkv:
        groups = data.shape[0] // (q_rows + 2 * hd)
        d = data.view(groups, q_rows + 2 * hd, data.shape[-1])
        s = scale.view(groups, (q_rows + 2 * hd) // tile, scale.shape[-1])
        qt, ht = q_rows // tile, hd // tile
        return {q_name: (d[:, :q_rows], s[:, :qt]), k_name: (d[:, q_rows:q_rows + hd], s[:, qt:qt + ht]),
                v_name: (d[:, q_rows + hd:], s[:, qt + ht:])}, None
    # TP > nkv: this rank holds a contiguous slice of one group's rows; TE's tiles start at
    # its first row, so they are the group's tiles only when every slice is whole tiles
    part = tp_rank % (tp // nkv)
    heads = AttentionHeads(nh, nkv, hd)
    rows = [megatron_qkv_blocks(heads, tp, which)[part] for which in ("q", "k", "v")]
    if data.shape[0] % tile or data.shape[0] != sum(rows):
        return {}, (f"{conv.megatron_name}: blockwise FP8 q/k/v rows of TP rank {tp_rank} "
                    f"({data.shape[0]} rows of a KV group of {q_rows + 2 * hd}: q/k/v {rows}) are "
                    f"not whole {tile}-row blocks")
    out, offset = {}, 0
    for name, n in zip(conv.hf_names, rows):
        out[name] = (data[offset:offset + n].unsqueeze(0),
                     scale[offset // tile:(offset + n) // tile].unsqueeze(0))
        offset += n
    return out, None


def train_fp8_views(converted: list, dims: Any, tile: int = BLOCK_FP8_TILE[0], tp_rank: int = 0
                    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """``hf_name -> (fp8 data view, scale_inv view)`` of this rank's weights held in
    blockwise FP8 (``fp8_storage``), and the problems found (one line each).

    The views cut the local FP8 shard the way ``converters.local_views`` cuts the BF16 one
    (fc1 halves, q/k/v per KV group, or the slice of one group that TP rank ``tp_rank``
    holds when TP exceeds the KV heads), and its scales the same way in tiles; a cut that is
    not on a tile boundary is a problem (the scales of a tile cannot be split).
    """
    views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    problems: list[str] = []
    for conv, tensor in converted:
        storage = blockwise_fp8_storage(tensor)
        if storage is None:
            continue
        data, scale = storage.data.detach(), storage.scale_inv.detach()
        if conv.kind == "qkv":
            got, problem = _qkv_fp8_views(conv, data, scale, dims, tp_rank, tile)
            views.update(got)
            problems += [problem] if problem else []
            continue
        if conv.kind in ("fc1", "expert_fc1") and dims.gated and (data.shape[0] // 2) % tile:
            problems.append(f"{conv.megatron_name}: blockwise FP8 fc1 halves of "
                            f"{data.shape[0] // 2} rows are not whole {tile}-row blocks")
            continue
        try:
            data_views = local_views(conv, data, dims)
            scale_views = local_views(conv, scale, dims)
        except ValueError as err:
            problems.append(f"{conv.megatron_name}: held in blockwise FP8, but {err}")
            continue
        for name, view in data_views.items():
            views[name] = (view, scale_views[name])
    return views, problems


def _stack_bytes(tensors: list) -> RefitCtx:
    """Stack FP8 tensors through their bytes (stacking is not defined for every FP8 dtype)."""
    stacked = torch.stack([t.view(torch.uint8) for t in tensors])
    return RefitCtx(buf=stacked.view(tensors[0].dtype))


def train_fp8_specs(p: ParamRecord, fp8_views: dict) -> Optional[tuple[LocalParamSpec, LocalParamSpec]]:
    """(weight spec, scale spec) of a ``train_fp8`` entry from this rank's FP8 views; None
    when this rank holds none of it."""
    if p.grouped_expert_proj is None:
        got = fp8_views.get(p.name)
        return None if got is None else (LocalParamSpec(base=got[0]), LocalParamSpec(base=got[1]))
    members = sorted((int(m["index"]), pair) for name, pair in fp8_views.items()
                     if (m := PER_EXPERT_RE.match(name)) and grouped_name(name) == p.name)
    if not members:
        return None
    data = [pair[0] for _, pair in members]
    scales = [pair[1] for _, pair in members]
    return (LocalParamSpec(base=data, pre=_stack_bytes),
            LocalParamSpec(base=scales, pre=lambda base: RefitCtx(buf=torch.stack(base))))
