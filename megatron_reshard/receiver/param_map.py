"""A generation rank's ``hf_name -> LocalParamSpec`` map of the bulk params it receives.

Torch + stdlib only. Each bulk record this rank holds a region of is checked against
what vLLM holds there (``targets.bulk_receive_plan``) and given a receive recipe: FP8
storage (``fp8_targets``), q/k/v sent per KV group, a padded vocab shard, or the live
target box itself.
"""

from __future__ import annotations

import torch

from megatron_reshard.layout.geometry import box_index, rank_box
from megatron_reshard.layout.placements import PaddedShard
from megatron_reshard.receiver.fp8_targets import fp8_receive_spec
from megatron_reshard.receiver.targets import (
    TargetError,
    TargetPlan,
    VllmTargets,
    bulk_receive_plan,
    receive_spec,
)
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec
from megatron_reshard.vllm_layout.dense import is_qkv_per_group, per_group_as_hf_rows
from megatron_reshard.wire.records import RefitPayload


def build_receiver_param_map(payload: RefitPayload, targets: VllmTargets, rank_in_group: int,
                             strided_in_place: bool = True
                             ) -> tuple[HFToLocalParamMap, list[TargetPlan]]:
    """``hf_name -> LocalParamSpec`` for every bulk param this rank receives, and their plans.

    ``rank_in_group`` is this rank's rank in the refit groups (the same in every stage's
    group). Each spec's base is the live target box (``receive_spec``), except for a padded
    vocab shard (the whole local tensor, padding zeroed here once) and q/k/v sent per KV
    group (the target's row block viewed as ``[groups, rows, H]``).
    """
    specs = HFToLocalParamMap()
    plans = []
    fp8_storage = any(t.dtype == torch.float8_e4m3fn for t in targets.params.values())
    stages = RefitPayload.of(payload).stage_params()
    for p in (p for ps in stages.values() for p in ps):
        region = rank_box(p.global_shape, p.dst_mesh_info, p.dst_placements, rank_in_group)
        if region is None:
            continue
        fp8 = (fp8_receive_spec(targets, p, rank_in_group, strided_in_place)
               if fp8_storage or p.gen_quant else None)
        if fp8 is not None:  # block-FP8 storage: FP8 bytes, their scales, or quantize on write
            specs.specs[p.name], plan = fp8
            plans.append(plan)
            continue
        padded = any(isinstance(pl, PaddedShard) for pl in p.dst_placements)
        per_group = is_qkv_per_group(p.name, p.global_shape)
        shape, rows = p.global_shape, region
        if per_group:
            try:
                shape, rows = per_group_as_hf_rows(shape, region)
            except ValueError as err:
                raise TargetError(f"{p.name}: {err}") from None
        plan = bulk_receive_plan(targets, p.name, shape, rows, p.torch_dtype, padded=padded)
        if per_group:  # q/k/v per KV group: the target row block seen as [groups, rows, H]
            block = targets.view(plan.pieces[0])
            specs.specs[p.name] = LocalParamSpec(base=block.view([b - a for a, b in region]))
        elif padded:
            # the engine fills the owned rows at the top of the whole local tensor; the
            # padding rows after them never travel: zero them once, here
            for target, box in plan.zero:
                targets.params[target][box_index(box)].zero_()
            specs.specs[p.name] = LocalParamSpec(base=targets.params[plan.pieces[0].target])
        else:
            for target, box in plan.zero:  # an empty region: the target holds zero (gpt-oss's
                targets.params[target][box_index(box)].zero_()  # w2_bias past MoE TP rank 0)
            specs.specs[p.name] = receive_spec(targets, plan.pieces[0], strided_in_place,
                                               wire_dtype=p.torch_dtype)
        plans.append(plan)
    return specs, plans


__all__ = ["build_receiver_param_map"]
