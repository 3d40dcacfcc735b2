"""The seed's placement rules by HF parameter name: which params take the bulk path and
how each is split over a mesh's TP / EP axes.

Torch + stdlib only. These are the rules of NeMo-RL's ``nccl_reshard_utils`` (the
seed-compatible module re-exports them under the seed's names): placements are decided
from HF names alone. The placement types themselves are in ``megatron_reshard.layout.placements``.
"""

from __future__ import annotations

from typing import Optional

from torch.distributed.tensor import Replicate, Shard

COLUMN_PARALLEL_SUFFIXES = ("gate_proj.weight", "up_proj.weight")
ROW_PARALLEL_SUFFIXES = ("down_proj.weight",)
FFN_PROJ_WEIGHT_SUFFIXES = COLUMN_PARALLEL_SUFFIXES + ROW_PARALLEL_SUFFIXES
FFN_GROUPED_EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj")


def is_expert_param(param_name: str) -> bool:
    """True for MoE routed-expert weights (sharded by EP)."""
    return ".experts." in param_name


def _get_expert_tp_shard_dim(param_name: str) -> Optional[int]:
    """TP shard dim of an FFN weight by suffix; does not skip expert names."""
    if param_name.endswith(COLUMN_PARALLEL_SUFFIXES):
        return 0
    if param_name.endswith(ROW_PARALLEL_SUFFIXES):
        return 1
    return None


def get_tp_shard_dim(param_name: str) -> Optional[int]:
    """TP shard dim of a dense FFN weight (gate/up → 0, down → 1); None for experts and the rest."""
    if is_expert_param(param_name):
        return None
    return _get_expert_tp_shard_dim(param_name)


def is_nccl_reshard_param(param_name: str) -> bool:
    """True iff the param takes the bulk (exact reshard) path: FFN projection weights."""
    if "shared_expert" in param_name or param_name.startswith("mtp."):
        return False
    return param_name.endswith(FFN_PROJ_WEIGHT_SUFFIXES + FFN_GROUPED_EXPERT_SUFFIXES)


def get_placements(param_name: str, dim_map: dict, ndim: int) -> list:
    """DTensor placements of an HF param on a mesh described by ``dim_map``.

    One placement per mesh axis (at least one), Replicate by default. 1-D params stay
    replicated; experts shard dim 0 on ``ep`` (else their TP dim + 1 on ``tp``); dense
    FFN weights shard their TP dim on ``tp``.
    """
    placements: list = [Replicate() for _ in range(max(1, len(dim_map)))]
    if ndim < 2:
        return placements
    if is_expert_param(param_name):
        if "ep" in dim_map:
            placements[dim_map["ep"]] = Shard(0)
        elif "tp" in dim_map:
            tp_dim = _get_expert_tp_shard_dim(param_name)
            if tp_dim is not None:
                placements[dim_map["tp"]] = Shard(tp_dim + 1)
        return placements
    tp_dim = get_tp_shard_dim(param_name)
    if tp_dim is not None and "tp" in dim_map:
        placements[dim_map["tp"]] = Shard(tp_dim)
    return placements
