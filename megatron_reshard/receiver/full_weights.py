"""Full HF tensors into vLLM-layout storage: the misc (packed) path and ``load_full_weights``.

Torch + stdlib only. Each full tensor is planned with ``VllmTargets.resolve`` and every
check (known name, target present, shapes, dtypes, FP8 scale boxes) runs for all of them
before anything is written; then each plan's pieces are copied (or quantized into block-FP8
targets) from the full tensor, and padding rows are zeroed. ``coverage_gaps`` lists the
target params that the plans leave partly unwritten.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from megatron_reshard.layout.geometry import box_index, box_numel
from megatron_reshard.receiver.fp8_targets import fp8_scale_pieces, quantize_into
from megatron_reshard.receiver.targets import TargetPlan, VllmTargets, check_wire_dtype


def plan_full_weights(targets: VllmTargets, items: Iterable[tuple[str, Sequence[int], torch.dtype]]
                      ) -> list[TargetPlan]:
    """Plans for full HF tensors given as ``(name, shape, dtype)``; every check, no writes."""
    plans = []
    for name, shape, dtype in items:
        plan = targets.resolve(name, shape)
        check_wire_dtype(targets, plan, dtype)
        plan.scales = fp8_scale_pieces(targets, plan)
        plans.append(plan)
    return plans


def apply_full_weights(targets: VllmTargets, plans: Sequence[TargetPlan],
                       tensors: Mapping[str, torch.Tensor]) -> int:
    """Write each plan's pieces from its full HF tensor; zero-fill padding. Returns bytes written."""
    written = 0
    for plan in plans:
        full = tensors[plan.hf_name]
        for i, piece in enumerate(plan.pieces):
            if i in plan.scales:  # block-FP8 target: quantize the slice (whole 128x128 blocks)
                written += quantize_into(targets, piece, plan.scales[i],
                                         full[box_index(piece.hf_region)])
                continue
            src = full[box_index(piece.hf_region)]
            if piece.transposed:
                src = src.transpose(-1, -2)
            targets.write(piece, src)  # through a kernel's order where vLLM keeps one
            written += src.numel() * src.element_size()
        for target, box in plan.zero:
            targets.params[target][box_index(box)].zero_()
    return written


def load_full_weights(targets: VllmTargets, full: Mapping[str, torch.Tensor]) -> int:
    """Slice full HF tensors ``{hf_name: tensor}`` into vLLM-layout storage; bytes written.

    Every name is checked (known, target present, shapes, dtypes) before anything is
    written; a name that maps to no target is an error naming it.
    """
    plans = plan_full_weights(targets, ((n, tuple(t.shape), t.dtype) for n, t in full.items()))
    return apply_full_weights(targets, plans, full)


def coverage_gaps(targets: VllmTargets, plans: Iterable[TargetPlan]) -> dict[str, int]:
    """Target params not fully written by ``plans``: ``{name: elements not covered}``."""
    covered: dict[str, int] = {}
    for plan in plans:
        for piece in plan.pieces:
            covered[piece.target] = covered.get(piece.target, 0) + box_numel(piece.target_region)
        for target, box in plan.zero:
            covered[target] = covered.get(target, 0) + box_numel(box)
        for piece in plan.scales.values():
            covered[piece.target] = covered.get(piece.target, 0) + box_numel(piece.target_region)
        for target, box in plan.kept:  # a kernel's padding, held by vLLM
            covered[target] = covered.get(target, 0) + box_numel(box)
    return {name: t.numel() - covered.get(name, 0) for name, t in targets.params.items()
            if t.numel() - covered.get(name, 0) > 0}
