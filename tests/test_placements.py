"""Meshes and placements (``placements``: MeshInfo, build_mesh_info) and the seed's
placement rules by HF name (``wire.placement_rules``: the bulk set, TP dims, get_placements)."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.placements import (
    MeshInfo,
    MeshSizeError,
    build_mesh_info,
    placements_to_plain,
    restore_placement,
)
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

# ---- suffix constants -------------------------------------------------------------------


def test_suffix_constants_have_the_seed_values():
    assert COLUMN_PARALLEL_SUFFIXES == ("gate_proj.weight", "up_proj.weight")
    assert ROW_PARALLEL_SUFFIXES == ("down_proj.weight",)
    assert FFN_PROJ_WEIGHT_SUFFIXES == ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    assert FFN_GROUPED_EXPERT_SUFFIXES == ("experts.gate_up_proj", "experts.down_proj")


# ---- MeshInfo ---------------------------------------------------------------------------


def test_mesh_info_exposes_rank_tensor_as_mesh_and__mesh_and_ndim():
    mesh = MeshInfo(torch.tensor([[0, 1], [2, 3]]))
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert mesh._mesh is mesh.mesh
    assert mesh.ndim == 2


def test_mesh_info_accepts_a_nested_list():
    assert MeshInfo([[4, 5]]).mesh.tolist() == [[4, 5]]


def test_mesh_info_scalar_becomes_one_rank_1d_mesh():
    mesh = MeshInfo(torch.tensor(7))
    assert mesh.ndim == 1 and mesh.ranks() == [7]


def test_mesh_info_rejects_duplicate_ranks():
    with pytest.raises(ValueError, match="unique"):
        MeshInfo(torch.tensor([0, 0]))


def test_mesh_info_rejects_negative_ranks():
    with pytest.raises(ValueError, match=">= 0"):
        MeshInfo(torch.tensor([-1, 0]))


def test_mesh_info_rejects_an_empty_mesh():
    with pytest.raises(ValueError, match="at least one rank"):
        MeshInfo(torch.tensor([], dtype=torch.int64))


def test_mesh_info_coordinate_is_row_major_position():
    mesh = MeshInfo(torch.tensor([[4, 5], [6, 7]]))
    assert mesh.coordinate_of(6) == (1, 0)
    assert mesh.coordinate_of(3) is None


def test_mesh_info_equality_and_hash_follow_shape_and_ranks():
    a, b = MeshInfo([[0, 1], [2, 3]]), MeshInfo(torch.arange(4).reshape(2, 2))
    assert a == b and hash(a) == hash(b)
    assert a != MeshInfo([0, 1, 2, 3])


# ---- name rules -------------------------------------------------------------------------


def test_expert_param_is_any_name_containing_dot_experts_dot():
    assert is_expert_param("model.layers.0.mlp.experts.3.up_proj.weight")
    assert is_expert_param("model.layers.0.mlp.experts.gate_proj.weight")
    assert not is_expert_param("model.layers.0.mlp.shared_experts.up_proj.weight")
    assert not is_expert_param("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize(
    "name, dim",
    [
        ("model.layers.0.mlp.gate_proj.weight", 0),
        ("model.layers.0.mlp.up_proj.weight", 0),
        ("model.layers.0.mlp.down_proj.weight", 1),
        ("model.layers.0.self_attn.q_proj.weight", None),
        ("model.layers.0.mlp.gate_proj.weight_scale_inv", None),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", None),
    ],
)
def test_get_tp_shard_dim_column_0_row_1_else_none_and_none_for_experts(name, dim):
    assert get_tp_shard_dim(name) == dim


def test_expert_tp_shard_dim_does_not_skip_experts():
    assert _get_expert_tp_shard_dim("m.layers.0.mlp.experts.0.gate_proj.weight") == 0
    assert _get_expert_tp_shard_dim("m.layers.0.mlp.experts.down_proj.weight") == 1
    assert _get_expert_tp_shard_dim("m.layers.0.mlp.experts.0.gate_proj.weight_scale_inv") is None


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.experts.5.up_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.3.mlp.experts.gate_proj.weight",
    ],
)
def test_bulk_path_takes_ffn_projection_weights(name):
    assert is_nccl_reshard_param(name)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.gate_proj.weight_scale_inv",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.shared_experts.down_proj.weight",
        "mtp.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
    ],
)
def test_bulk_path_excludes_scale_inv_router_attention_norms_shared_experts_and_mtp(name):
    assert not is_nccl_reshard_param(name)


def test_deepseek_style_mtp_under_model_layers_is_bulk_the_caller_drops_it():
    assert is_nccl_reshard_param("model.layers.61.mlp.experts.0.gate_proj.weight")


# ---- build_mesh_info --------------------------------------------------------------------


def test_tp2_on_4_gpus_puts_tp_innermost_and_dp_outermost():
    mesh, dims = build_mesh_info(4, 0, tp_size=2)
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert dims == {"dp": 0, "tp": 1}


def test_expert_mesh_ep2_on_4_gpus_puts_ep_innermost():
    mesh, dims = build_mesh_info(4, 0, tp_size=1, ep_size=2)
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert dims == {"dp": 0, "ep": 1}


def test_rank_offset_shifts_every_rank():
    mesh, dims = build_mesh_info(2, 4, tp_size=2)
    assert mesh.mesh.tolist() == [4, 5]
    assert dims == {"tp": 0}


def test_one_gpu_gives_a_1d_single_rank_mesh_and_empty_dim_map():
    mesh, dims = build_mesh_info(1, 0)
    assert mesh.mesh.tolist() == [0] and mesh.ndim == 1
    assert dims == {}


def test_all_sizes_one_on_several_gpus_is_pure_dp():
    mesh, dims = build_mesh_info(3, 2)
    assert mesh.mesh.tolist() == [2, 3, 4]
    assert dims == {"dp": 0}


def test_full_tp_without_dp_has_only_a_tp_axis():
    mesh, dims = build_mesh_info(4, 0, tp_size=4)
    assert mesh.mesh.tolist() == [0, 1, 2, 3]
    assert dims == {"tp": 0}


def test_tp_dp_pp_order_is_pp_outermost_then_dp_then_tp():
    mesh, dims = build_mesh_info(8, 0, tp_size=2, pp_size=2)
    assert dims == {"pp": 0, "dp": 1, "tp": 2}
    assert mesh.mesh.shape == (2, 2, 2)
    assert mesh.mesh[0, 1].tolist() == [2, 3]  # consecutive ranks differ in tp


def test_tp_and_ep_together_make_tp_innermost():
    _, dims = build_mesh_info(4, 0, tp_size=2, ep_size=2)
    assert dims == {"ep": 0, "tp": 1}


def test_non_divisible_sizes_raise_naming_the_sizes():
    with pytest.raises(ValueError, match=r"num_gpus=6 .*tp_size\*ep_size\*pp_size=4\*1\*1=4"):
        build_mesh_info(6, 0, tp_size=4)


def test_non_divisible_sizes_are_also_an_assertion_error_as_the_seed_raises():
    # Callers written against the seed catch AssertionError; ValueError callers still work.
    with pytest.raises(AssertionError, match=r"num_gpus=8 .*expected a multiple of 3"):
        build_mesh_info(8, 0, tp_size=3)
    with pytest.raises(MeshSizeError):
        build_mesh_info(8, 4, ep_size=3)


def test_invalid_size_values_are_not_assertion_errors():
    # Only the divisibility check doubles as an assertion; a bad value is a plain ValueError.
    with pytest.raises(ValueError) as err:
        build_mesh_info(4, 0, tp_size=0)
    assert not isinstance(err.value, AssertionError)


def test_zero_size_is_rejected():
    with pytest.raises(ValueError, match="tp_size"):
        build_mesh_info(4, 0, tp_size=0)


def test_zero_gpus_is_rejected():
    with pytest.raises(ValueError, match="num_gpus"):
        build_mesh_info(0, 0)


def test_negative_rank_offset_is_rejected():
    with pytest.raises(ValueError, match="rank_offset"):
        build_mesh_info(2, -1)


def test_non_int_sizes_are_rejected():
    with pytest.raises(ValueError, match="ep_size"):
        build_mesh_info(4, 0, ep_size=2.0)
    with pytest.raises(ValueError, match="num_gpus"):
        build_mesh_info(4.0, 0)


# ---- get_placements ---------------------------------------------------------------------


def test_dense_column_parallel_shards_dim0_on_tp_axis_and_replicates_on_dp():
    assert get_placements("m.layers.0.mlp.gate_proj.weight", {"dp": 0, "tp": 1}, 2) == [Replicate(), Shard(0)]


def test_dense_row_parallel_shards_dim1_on_tp_axis():
    assert get_placements("m.layers.0.mlp.down_proj.weight", {"tp": 0}, 2) == [Shard(1)]


def test_non_ffn_weight_is_replicated_everywhere():
    assert get_placements("m.layers.0.self_attn.o_proj.weight", {"dp": 0, "tp": 1}, 2) == [Replicate(), Replicate()]


def test_one_dimensional_params_are_always_replicated():
    assert get_placements("m.layers.0.mlp.experts.gate_proj.weight", {"ep": 0}, 1) == [Replicate()]
    assert get_placements("m.layers.0.mlp.up_proj.weight", {"tp": 0}, 1) == [Replicate()]


def test_empty_dim_map_still_gives_one_placement():
    assert get_placements("m.layers.0.mlp.up_proj.weight", {}, 2) == [Replicate()]


def test_expert_on_ep_mesh_shards_the_expert_dim():
    assert get_placements("m.layers.0.mlp.experts.down_proj.weight", {"dp": 0, "ep": 1}, 3) == [Replicate(), Shard(0)]


def test_expert_with_tp_only_shifts_its_tp_dim_by_one():
    assert get_placements("m.layers.0.mlp.experts.gate_proj.weight", {"tp": 0}, 3) == [Shard(1)]
    assert get_placements("m.layers.0.mlp.experts.down_proj.weight", {"dp": 0, "tp": 1}, 3) == [Replicate(), Shard(2)]


def test_expert_with_both_axes_prefers_ep():
    assert get_placements("m.layers.0.mlp.experts.up_proj.weight", {"ep": 0, "tp": 1}, 3) == [Shard(0), Replicate()]


# ---- placement wire form ----------------------------------------------------------------


def test_placements_to_plain_gives_dim_dicts_and_empty_dicts():
    assert placements_to_plain([Shard(1), Replicate()]) == [{"dim": 1}, {}]


def test_placements_to_plain_rejects_other_placements():
    from torch.distributed.tensor import Partial

    with pytest.raises(TypeError, match="Partial"):
        placements_to_plain([Partial()])


def testrestore_placement_rebuilds_shard_and_replicate_and_keeps_instances():
    assert restore_placement({"dim": 2}) == Shard(2)
    assert restore_placement({}) == Replicate()
    assert restore_placement(None) == Replicate()
    shard = Shard(0)
    assert restore_placement(shard) is shard


# ---- property: the innermost active axis is recovered by a modulo ------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    inner=st.integers(1, 4),
    dp=st.integers(1, 3),
    pp=st.integers(1, 3),
    offset=st.integers(0, 9),
    expert=st.booleans(),
)
def test_global_rank_modulo_inner_size_recovers_the_tp_or_ep_coordinate(inner, dp, pp, offset, expert):
    num = inner * dp * pp
    kwargs = {"ep_size": inner} if expert else {"tp_size": inner}
    mesh, dims = build_mesh_info(num, offset, pp_size=pp, **kwargs)
    assert sorted(mesh.ranks()) == list(range(offset, offset + num))
    axis = "ep" if expert else "tp"
    for rank in mesh.ranks():
        coord = mesh.coordinate_of(rank)
        want = (rank - offset) % inner
        assert (coord[dims[axis]] if axis in dims else 0) == want
        if "pp" in dims:
            assert coord[dims["pp"]] == (rank - offset) // (inner * dp)
