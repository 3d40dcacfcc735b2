"""Which bulk params go as deltas: payload-derived, so every rank decides alike (a plan
with no local copy, ``eligible``; not a weight the generation side quantizes from BF16,
``record_eligible``). Others travel full, inside the same refit, through the engine.

Torch + stdlib only (the receiver imports the package).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_reshard.engine.param_plan import ParamPlan


def eligible(plan: ParamPlan) -> bool:
    """No local copy: every op a send between two ranks, from a source (phase 0) or, for
    replica completion, from the destination member that received the stripe (phase 1,
    forwarded as a delta of its own). A local copy (a rank on both sides, which refit
    groups do not have) goes full through the engine."""
    return bool(plan.ops) and all(op.src != op.dst for op in plan.ops)


# Where the generation side quantizes a weight (block FP8 or MXFP8 from BF16 on the wire:
# ``fp8.plan``, ``"gen_quant": "receiver"``) it holds FP8 bytes and scales, never the BF16
# a delta would be cut from: applying a BF16 delta would need a BF16 copy of the region on
# the generation rank (2 bytes per element beside the 1-byte FP8 storage) and a tile's
# scale follows the amax of all its elements, so every touched tile is quantized again.
# Such a weight goes full (BF16 through the engine, quantized on write) inside a delta
# refit; the sender-quantized ones (FP8 bytes + scales on the wire) are diffed as bytes.
RECEIVER_QUANTIZED = "receiver"


def record_eligible(record: Any) -> bool:
    """Whether a payload record may go as a delta at all (payload-derived: alike on every
    rank): not a weight the generation side quantizes from BF16."""
    return getattr(record, "gen_quant", None) != RECEIVER_QUANTIZED


def delta_plans(records: Sequence[Any], plans: Sequence[ParamPlan]) -> list[Optional[ParamPlan]]:
    """Per bulk param of a stage: its plan when it goes as a delta, else None (full)."""
    return [plan if eligible(plan) and record_eligible(rec) else None
            for rec, plan in zip(records, plans)]


def dst_hooked(mine_by_stage: Mapping[int, Sequence[Any]],
               records_by_stage: Optional[Mapping[int, Sequence[Any]]] = None) -> bool:
    """Whether this generation rank holds a bulk param other than as a plain tensor of its
    storage (a pre hook, or a list of tensors): a delta needs the old bits in place. All
    held params count (not only the eligible ones: no plan is built for the vote, so a
    refit whose sender does not ask for deltas costs nothing more), except those whose
    record already sends them full (``record_eligible``: a weight this rank quantizes)."""
    for stage, mine in mine_by_stage.items():
        records = None if records_by_stage is None else records_by_stage.get(stage)
        for i, held in enumerate(mine):
            if held is None:
                continue
            if records is not None and not record_eligible(records[i]):
                continue
            if held.spec.pre is not None or not isinstance(held.spec.base, torch.Tensor):
                return True
    return False


__all__ = ["RECEIVER_QUANTIZED", "delta_plans", "dst_hooked", "eligible", "record_eligible"]
