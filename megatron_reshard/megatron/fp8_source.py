"""Training side of a block-FP8 refit: quantize the local shard right before it is sent.

For every entry ``fp8_plan.plan_block_fp8`` marked ``"gen_quant": "sender"`` (every
training rank's shard is made of whole 128x128 tiles), the BF16 recipe of the weight (a
view, or the expert stacking hook) is wrapped: its ``pre`` hook quantizes the shard into a
``float8_e4m3fn`` buffer, and keeps the scales for the ``<name>_scale_inv`` entry that
follows it in payload order. The buffers live for one batch, as any ``pre`` buffer. Entries
quantized by the receiver keep their BF16 recipe.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_reshard.fp8_plan import scale_name
from megatron_reshard.quant import quantize_blockwise_fp8
from megatron_reshard.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx


class _ShardQuantizer:
    """Quantizes one param's local shard once per refit; the scale entry takes the scales."""

    def __init__(self, spec: LocalParamSpec):
        self.spec = spec
        self.scales: Optional[torch.Tensor] = None

    def _quantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.spec.begin()
        try:
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


def fp8_sender_specs(specs: HFToLocalParamMap, fp8_info: dict, stage: int) -> HFToLocalParamMap:
    """``specs`` (the BF16 recipes of this rank's stage) with the sender-quantized weights
    wrapped and their scale entries added."""
    out = dict(specs.specs)
    for layer in fp8_info["layer_names"]:
        for p in fp8_info["per_layer_params"].get(layer, []):
            if p.get("gen_quant") != "sender" or int(p.get("pp_stage", 0)) != stage:
                continue
            spec = specs.get(p["name"])
            if spec is None:  # this rank holds no shard of it
                continue
            quantizer = _ShardQuantizer(spec)
            out[p["name"]] = LocalParamSpec(base=spec.base, pre=quantizer.weight)
            out[scale_name(p["name"])] = LocalParamSpec(base=spec.base, pre=quantizer.scale)
    return HFToLocalParamMap(out)


__all__ = ["fp8_sender_specs"]
