"""Drop-in for the seed module ``nemo_rl.weight_sync.nccl_reshard_utils``.

Exposes exactly the seed's names (classes, functions, data), so code written against the
seed works by changing one import. Torch + stdlib only. The transfer kernel
(``xferdtensor``, ``DTensorRef``) lives in ``megatron_reshard.engine``, as in the seed.
"""

from megatron_reshard.layout.placements import MeshInfo, build_mesh_info
from megatron_reshard.layout.placements import restore_placement as _restore_placement  # the seed name
from megatron_reshard.wire.placement_rules import (
    COLUMN_PARALLEL_SUFFIXES,
    FFN_GROUPED_EXPERT_SUFFIXES,
    FFN_PROJ_WEIGHT_SUFFIXES,
    ROW_PARALLEL_SUFFIXES,
    _get_expert_tp_shard_dim,
    get_placements,
    get_tp_shard_dim,
    is_expert_param,
    is_nccl_reshard_param,
)
from megatron_reshard.wire.metadata import (
    _INDIVIDUAL_EXPERT_RE,
    _LAYER_RE,
    _MODEL_PREFIX_RE,
    _STR_TO_DTYPE,
    _extract_layer_prefix,
    build_nccl_reshard_refit_info,
    extract_layer_name as _extract_layer_name,  # the seed's name
    group_expert_params_in_metadata,
    make_nccl_reshard_refit_info_wire_safe,
    restore_refit_info_placements,
)
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitBuilderInterface, RefitCtx
from megatron_reshard.support import check_nccl_reshard_refit_support

__all__ = [
    # classes
    "MeshInfo",
    "RefitCtx",
    "LocalParamSpec",
    "HFToLocalParamMap",
    "RefitBuilderInterface",
    # functions
    "get_tp_shard_dim",
    "is_expert_param",
    "is_nccl_reshard_param",
    "_get_expert_tp_shard_dim",
    "_restore_placement",
    "make_nccl_reshard_refit_info_wire_safe",
    "restore_refit_info_placements",
    "build_mesh_info",
    "get_placements",
    "group_expert_params_in_metadata",
    "_extract_layer_prefix",
    "_extract_layer_name",
    "check_nccl_reshard_refit_support",
    "build_nccl_reshard_refit_info",
    # data
    "COLUMN_PARALLEL_SUFFIXES",
    "ROW_PARALLEL_SUFFIXES",
    "FFN_PROJ_WEIGHT_SUFFIXES",
    "FFN_GROUPED_EXPERT_SUFFIXES",
    "_STR_TO_DTYPE",
    "_INDIVIDUAL_EXPERT_RE",
    "_LAYER_RE",
    "_MODEL_PREFIX_RE",
]
