"""Metadata layer: dtypes, layer keys, expert grouping, refit info, wire form and restore."""

import copy
import pickle
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.wire.metadata import (
    _INDIVIDUAL_EXPERT_RE,
    _LAYER_RE,
    _MODEL_PREFIX_RE,
    _STR_TO_DTYPE,
    _extract_layer_prefix,
    build_nccl_reshard_refit_info,
    extract_layer_name,
    group_expert_params_in_metadata,
    make_nccl_reshard_refit_info_wire_safe,
    restore_refit_info_placements,
)

BF16 = "torch.bfloat16"
H, I, E = 8, 6, 4  # hidden, intermediate, experts


def dense_layer(layer, prefix="model"):
    p = f"{prefix}.layers.{layer}.mlp"
    return {
        f"{p}.gate_proj.weight": {"shape": [I, H], "dtype": BF16},
        f"{p}.up_proj.weight": {"shape": [I, H], "dtype": BF16},
        f"{p}.down_proj.weight": {"shape": [H, I], "dtype": BF16},
    }


def moe_layer(layer, prefix="model", experts=E):
    md = {}
    for e in range(experts):
        p = f"{prefix}.layers.{layer}.mlp.experts.{e}"
        md[f"{p}.gate_proj.weight"] = {"shape": [I, H], "dtype": BF16}
        md[f"{p}.up_proj.weight"] = {"shape": [I, H], "dtype": BF16}
        md[f"{p}.down_proj.weight"] = {"shape": [H, I], "dtype": BF16}
    return md


def params_by_name(info):
    return {p["name"]: p for params in info["per_layer_params"].values() for p in params}


def build(md, train=None, gen=None, T=4, G=2, stages=None):
    return build_nccl_reshard_refit_info(md, train or {}, gen or {}, T, G, stages)


# ---- dtypes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_str_to_dtype_knows_long_and_short_names(name):
    assert _STR_TO_DTYPE[f"torch.{name}"] is getattr(torch, name)
    assert _STR_TO_DTYPE[name] is getattr(torch, name)


def test_str_to_dtype_long_names_round_trip_through_str():
    for key, dtype in _STR_TO_DTYPE.items():
        if key.startswith("torch."):
            assert _STR_TO_DTYPE[str(dtype)] is dtype


# ---- regexes and layer keys -------------------------------------------------------------


def test_individual_expert_re_captures_prefix_index_and_projection():
    m = _INDIVIDUAL_EXPERT_RE.match("model.layers.3.mlp.experts.12.down_proj.weight")
    assert (m["prefix"], m["index"], m["proj"]) == ("model.layers.3.mlp.experts", "12", "down_proj")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.mlp.experts.1.down_proj.weight_scale_inv",
        "model.layers.3.mlp.shared_experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.3.mlp.experts.1.gate.weight",
    ],
)
def test_individual_expert_re_ignores_scale_inv_shared_experts_pregrouped_and_router(name):
    assert _INDIVIDUAL_EXPERT_RE.match(name) is None


@pytest.mark.parametrize(
    "name, layer",
    [
        ("model.layers.0.mlp.gate_proj.weight", "model.layers.0"),
        ("model.language_model.layers.1.mlp.up_proj.weight", "model.language_model.layers.1"),
        ("backbone.layers.3.mixer.experts.0.down_proj.weight", "backbone.layers.3"),
        ("layers.2.ffn.shared_experts.w2.weight", "layers.2"),
        ("model.embed_tokens.weight", "model.embed_tokens"),
        ("model.norm.weight", "model.norm"),
        ("backbone.embeddings.weight", "backbone.embeddings"),
        ("lm_head.weight", "lm_head"),
        ("mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0"),
        ("model.layers.2.blocks.layers.5.x", "model.layers.2"),
    ],
)
def test_extract_layer_name(name, layer):
    assert extract_layer_name(name) == layer


@pytest.mark.parametrize(
    "name, prefix",
    [
        ("model.layers.0.mlp.gate_proj.weight", "model"),
        ("model.language_model.layers.1.x", "model.language_model"),
        ("backbone.layers.3.mixer.x", "backbone"),
        ("layers.2.ffn.w2.weight", ""),
        ("model.embed_tokens.weight", None),
        ("model.mtp_layers.0.x", None),
    ],
)
def test_extract_layer_prefix(name, prefix):
    assert _extract_layer_prefix(name) == prefix


def test_layer_re_needs_layers_as_a_whole_dotted_component():
    assert _LAYER_RE.match("model.sublayers.0.x") is None
    assert _LAYER_RE.match("model.layers.x") is None


def test_model_prefix_re_takes_the_word_after_model_or_backbone():
    assert _MODEL_PREFIX_RE.match("model.norm.weight")["prefix"] == "model.norm"
    assert _MODEL_PREFIX_RE.match("lm_head.weight") is None


# ---- expert grouping --------------------------------------------------------------------


def test_per_expert_entries_become_one_stacked_entry_per_projection():
    md = {**dense_layer(0), **moe_layer(1)}
    out = group_expert_params_in_metadata(md)
    g = "model.layers.1.mlp.experts"
    assert out[f"{g}.gate_proj.weight"] == {"shape": [E, I, H], "dtype": BF16, "grouped_expert_proj": "gate_proj"}
    assert out[f"{g}.up_proj.weight"]["shape"] == [E, I, H]
    assert out[f"{g}.down_proj.weight"] == {"shape": [E, H, I], "dtype": BF16, "grouped_expert_proj": "down_proj"}
    assert not any(".experts.0." in n for n in out)


def test_grouped_entries_follow_the_pass_through_entries():
    md = {**moe_layer(0), **dense_layer(1)}
    out = list(group_expert_params_in_metadata(md))
    assert out[:3] == list(dense_layer(1))
    assert all(".experts." in n for n in out[3:])


def test_pass_through_entries_are_unchanged():
    md = {**dense_layer(0), **moe_layer(1)}
    out = group_expert_params_in_metadata(md)
    for name, meta in dense_layer(0).items():
        assert out[name] == meta and "grouped_expert_proj" not in out[name]


def test_scale_inv_siblings_are_never_grouped():
    md = moe_layer(0, experts=2)
    md["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"] = {"shape": [1, 1], "dtype": "torch.float32"}
    md["model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv"] = {"shape": [1, 1], "dtype": "torch.float32"}
    out = group_expert_params_in_metadata(md)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv" in out
    assert "model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv" in out
    assert out["model.layers.0.mlp.experts.gate_proj.weight"]["shape"] == [2, I, H]


def test_shared_expert_names_pass_through():
    md = {
        "model.layers.0.mlp.shared_expert.gate_proj.weight": {"shape": [I, H], "dtype": BF16},
        "model.layers.0.mlp.shared_experts.0.up_proj.weight": {"shape": [I, H], "dtype": BF16},
        **moe_layer(0, experts=2),
    }
    out = group_expert_params_in_metadata(md)
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in out
    assert "model.layers.0.mlp.shared_experts.0.up_proj.weight" in out


def test_mtp_experts_group_under_their_own_prefix():
    out = group_expert_params_in_metadata(moe_layer(0, prefix="mtp", experts=2))
    assert out["mtp.layers.0.mlp.experts.up_proj.weight"]["shape"] == [2, I, H]


def test_pregrouped_gate_up_proj_splits_into_gate_and_up_halves():
    md = {"model.layers.0.mlp.experts.gate_up_proj": {"shape": [E, 2 * I, H], "dtype": BF16}}
    out = group_expert_params_in_metadata(md)
    assert out == {
        "model.layers.0.mlp.experts.gate_proj.weight": {"shape": [E, I, H], "dtype": BF16, "grouped_expert_proj": "gate_proj"},
        "model.layers.0.mlp.experts.up_proj.weight": {"shape": [E, I, H], "dtype": BF16, "grouped_expert_proj": "up_proj"},
    }


def test_pregrouped_down_proj_becomes_a_tagged_down_proj_weight():
    md = {"model.layers.0.mlp.experts.down_proj": {"shape": [E, H, I], "dtype": BF16}}
    out = group_expert_params_in_metadata(md)
    assert out == {
        "model.layers.0.mlp.experts.down_proj.weight": {"shape": [E, H, I], "dtype": BF16, "grouped_expert_proj": "down_proj"}
    }


def test_pregrouped_gate_up_proj_with_odd_middle_dim_is_an_error():
    md = {"model.layers.0.mlp.experts.gate_up_proj": {"shape": [E, 7, H], "dtype": BF16}}
    with pytest.raises(ValueError, match=r"gate_up_proj.*\[4, 7, 8\]"):
        group_expert_params_in_metadata(md)


def test_pregrouped_bias_passes_through():
    md = {"model.layers.0.mlp.experts.gate_up_proj_bias": {"shape": [E, 2 * I], "dtype": BF16}}
    assert group_expert_params_in_metadata(md) == md


def test_missing_expert_index_is_an_error_naming_it():
    md = moe_layer(0, experts=3)
    del md["model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts \[1\] are missing"):
        group_expert_params_in_metadata(md)


def test_experts_with_different_shapes_are_an_error_naming_the_param():
    md = moe_layer(0, experts=2)
    md["model.layers.0.mlp.experts.1.up_proj.weight"] = {"shape": [I + 1, H], "dtype": BF16}
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.weight"):
        group_expert_params_in_metadata(md)


def test_no_experts_returns_the_input_unchanged():
    md = dense_layer(0)
    assert group_expert_params_in_metadata(md) is md


def test_grouping_does_not_modify_its_input():
    md = {**dense_layer(0), **moe_layer(1)}
    before = copy.deepcopy(md)
    group_expert_params_in_metadata(md)
    assert md == before


# ---- build_nccl_reshard_refit_info: output shape ----------------------------------------


def test_refit_info_has_the_documented_top_level_keys():
    info = build(dense_layer(0), {"tp_size": 2}, {"tp_size": 2}, T=4, G=2)
    assert set(info) == {"layer_names", "per_layer_params", "train_world_size", "gen_world_size", "pp_size", "gen_tp_size"}
    assert (info["train_world_size"], info["gen_world_size"], info["pp_size"], info["gen_tp_size"]) == (4, 2, 1, 2)


def test_each_param_carries_name_shape_tuple_dtype_string_meshes_and_placements():
    info = build(dense_layer(0))
    p = params_by_name(info)["model.layers.0.mlp.down_proj.weight"]
    assert set(p) == {"name", "global_shape", "dtype", "src_mesh_info", "src_placements", "dst_mesh_info", "dst_placements"}
    assert p["global_shape"] == (H, I) and isinstance(p["global_shape"], tuple)
    assert p["dtype"] == "torch.bfloat16"
    assert isinstance(p["src_mesh_info"], MeshInfo) and isinstance(p["dst_mesh_info"], MeshInfo)


def test_short_dtype_names_are_normalised_to_torch_strings():
    md = {"model.layers.0.mlp.up_proj.weight": {"shape": [I, H], "dtype": "float8_e4m3fn"}}
    assert params_by_name(build(md))["model.layers.0.mlp.up_proj.weight"]["dtype"] == "torch.float8_e4m3fn"


def test_unknown_dtype_is_an_error_naming_the_param():
    md = {"model.layers.0.mlp.up_proj.weight": {"shape": [I, H], "dtype": "torch.bogus"}}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*torch\.bogus"):
        build(md)


def test_layer_names_follow_first_appearance_in_the_input_even_for_expert_only_layers():
    md = {**moe_layer(2), **dense_layer(0), "lm_head.weight": {"shape": [16, H], "dtype": BF16}, **dense_layer(1)}
    info = build(md)
    assert info["layer_names"] == ["model.layers.2", "model.layers.0", "lm_head", "model.layers.1"]
    assert list(info["per_layer_params"]) == info["layer_names"]


def test_params_are_filed_under_their_layer_key_in_grouped_order():
    md = {**moe_layer(0), **dense_layer(0)}
    names = [p["name"] for p in build(md)["per_layer_params"]["model.layers.0"]]
    assert names == list(dense_layer(0)) + [
        "model.layers.0.mlp.experts.gate_proj.weight",
        "model.layers.0.mlp.experts.up_proj.weight",
        "model.layers.0.mlp.experts.down_proj.weight",
    ]


def test_only_grouped_params_carry_grouped_expert_proj():
    params = params_by_name(build({**dense_layer(0), **moe_layer(1)}))
    assert params["model.layers.1.mlp.experts.up_proj.weight"]["grouped_expert_proj"] == "up_proj"
    assert "grouped_expert_proj" not in params["model.layers.0.mlp.up_proj.weight"]


def test_build_describes_non_bulk_params_it_is_given_replicated():
    md = {"model.embed_tokens.weight": {"shape": [16, H], "dtype": BF16}}
    p = params_by_name(build(md, {"tp_size": 2}, {"tp_size": 2}))["model.embed_tokens.weight"]
    assert p["src_placements"] == [Replicate(), Replicate()]
    assert p["dst_placements"] == [Replicate()]


def test_build_does_not_modify_its_input():
    md = {**dense_layer(0), **moe_layer(1)}
    before = copy.deepcopy(md)
    build(md, {"ep_size": 2}, {"ep_size": 2})
    assert md == before


# ---- build: meshes and placements -------------------------------------------------------


def test_train_dense_mesh_uses_tp_and_gen_ranks_are_offset_by_train_ranks():
    p = params_by_name(build(dense_layer(0), {"tp_size": 2}, {"tp_size": 2}, T=4, G=2))["model.layers.0.mlp.gate_proj.weight"]
    assert p["src_mesh_info"].mesh.tolist() == [[0, 1], [2, 3]]
    assert p["src_placements"] == [Replicate(), Shard(0)]
    assert p["dst_mesh_info"].mesh.tolist() == [4, 5]
    assert p["dst_placements"] == [Shard(0)]


def test_train_expert_mesh_uses_ep_without_tp():
    info = build(moe_layer(0), {"tp_size": 2, "ep_size": 2}, {"tp_size": 2}, T=4, G=2)
    p = params_by_name(info)["model.layers.0.mlp.experts.down_proj.weight"]
    assert p["src_mesh_info"].mesh.tolist() == [[0, 1], [2, 3]]
    assert p["src_placements"] == [Replicate(), Shard(0)]


def test_gen_without_ep_puts_experts_on_the_tp_mesh_sharding_tp_dim_plus_one():
    info = build(moe_layer(0), {"ep_size": 4}, {"tp_size": 2}, T=4, G=2)
    params = params_by_name(info)
    assert params["model.layers.0.mlp.experts.gate_proj.weight"]["dst_placements"] == [Shard(1)]
    assert params["model.layers.0.mlp.experts.down_proj.weight"]["dst_placements"] == [Shard(2)]
    assert params["model.layers.0.mlp.experts.down_proj.weight"]["dst_mesh_info"].mesh.tolist() == [4, 5]


def test_gen_with_ep_puts_experts_on_an_ep_mesh_and_dense_on_the_tp_mesh():
    md = {**dense_layer(0), **moe_layer(0)}
    params = params_by_name(build(md, {"ep_size": 2}, {"tp_size": 2, "ep_size": 4}, T=2, G=4))
    expert = params["model.layers.0.mlp.experts.up_proj.weight"]
    assert expert["dst_mesh_info"].mesh.tolist() == [2, 3, 4, 5]
    assert expert["dst_placements"] == [Shard(0)]
    dense = params["model.layers.0.mlp.up_proj.weight"]
    assert dense["dst_mesh_info"].mesh.tolist() == [[2, 3], [4, 5]]
    assert dense["dst_placements"] == [Replicate(), Shard(0)]


def test_one_gpu_each_side_is_all_replicated_on_single_rank_meshes():
    p = params_by_name(build(dense_layer(0), T=1, G=1))["model.layers.0.mlp.gate_proj.weight"]
    assert p["src_mesh_info"].mesh.tolist() == [0] and p["dst_mesh_info"].mesh.tolist() == [1]
    assert p["src_placements"] == [Replicate()] and p["dst_placements"] == [Replicate()]


def test_all_sizes_one_gives_pure_dp_meshes_replicated():
    p = params_by_name(build(dense_layer(0), T=3, G=2))["model.layers.0.mlp.down_proj.weight"]
    assert p["src_mesh_info"].mesh.tolist() == [0, 1, 2] and p["dst_mesh_info"].mesh.tolist() == [3, 4]
    assert p["src_placements"] == [Replicate()] and p["dst_placements"] == [Replicate()]


def test_train_sizes_not_dividing_the_world_are_a_clear_error():
    with pytest.raises(ValueError, match=r"train non-expert mesh: .*num_gpus=6"):
        build(dense_layer(0), {"tp_size": 4}, {}, T=6, G=2)


def test_gen_sizes_not_dividing_the_world_are_a_clear_error():
    with pytest.raises(ValueError, match=r"gen expert mesh: .*num_gpus=3"):
        build(moe_layer(0), {}, {"ep_size": 2}, T=2, G=3)


def test_train_world_not_divisible_by_pp_is_a_clear_error():
    with pytest.raises(ValueError, match=r"train_world_size=5 .*pp_size=2"):
        build(dense_layer(0), {"pp_size": 2}, {}, T=5, G=1, stages={"model.layers.0": 0})


def test_non_positive_parallel_size_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match=r"gen_parallelism\['tp_size'\]"):
        build(dense_layer(0), {}, {"tp_size": 0})


def test_generation_pipeline_parallelism_is_rejected():
    with pytest.raises(ValueError, match="pp_size"):
        build(dense_layer(0), {}, {"pp_size": 2}, T=2, G=2)


# ---- build: pipeline parallel -----------------------------------------------------------


def test_pp_uses_stage_local_train_ranks_with_gen_ranks_right_after():
    md = {**dense_layer(0), **dense_layer(1)}
    info = build(md, {"tp_size": 2, "pp_size": 2}, {"tp_size": 2}, T=8, G=2, stages={"model.layers.0": 0, "model.layers.1": 1})
    assert info["pp_size"] == 2
    for p in params_by_name(info).values():
        assert p["src_mesh_info"].mesh.tolist() == [[0, 1], [2, 3]]
        assert p["dst_mesh_info"].mesh.tolist() == [4, 5]


def test_pp_every_param_carries_its_stage():
    md = {**dense_layer(0), **moe_layer(1)}
    info = build(md, {"pp_size": 2}, {}, T=2, G=1, stages={"model.layers.0": 0, "model.layers.1": 1})
    stages = {p["name"]: p["pp_stage"] for p in params_by_name(info).values()}
    assert stages["model.layers.0.mlp.up_proj.weight"] == 0
    assert stages["model.layers.1.mlp.experts.up_proj.weight"] == 1
    assert len(stages) == 6


def test_pp_with_a_missing_layer_is_a_key_error_naming_it():
    md = {**dense_layer(0), **dense_layer(1)}
    with pytest.raises(KeyError, match=r"model\.layers\.1"):
        build(md, {"pp_size": 2}, {}, T=2, G=1, stages={"model.layers.0": 0})


def test_pp_non_layer_params_need_their_own_map_entry():
    md = {"lm_head.weight": {"shape": [16, H], "dtype": BF16}}
    with pytest.raises(KeyError, match="lm_head"):
        build(md, {"pp_size": 2}, {}, T=2, G=1, stages={"model.layers.0": 0})
    info = build(md, {"pp_size": 2}, {}, T=2, G=1, stages={"lm_head": 1})
    assert params_by_name(info)["lm_head.weight"]["pp_stage"] == 1


def test_pp_without_a_stage_map_is_an_error():
    with pytest.raises(ValueError, match="layer_to_pp_stage"):
        build(dense_layer(0), {"pp_size": 2}, {}, T=2, G=1)


def test_pp_stage_out_of_range_is_an_error_naming_the_layer():
    with pytest.raises(ValueError, match=r"model\.layers\.0.*0\.\.1"):
        build(dense_layer(0), {"pp_size": 2}, {}, T=2, G=1, stages={"model.layers.0": 2})


def test_without_pp_params_carry_no_stage():
    info = build(dense_layer(0), stages={"model.layers.0": 0})
    assert all("pp_stage" not in p for p in params_by_name(info).values())


# ---- wire form --------------------------------------------------------------------------

PLAIN = (dict, list, str, int, float, bool, type(None))


def assert_plain(value, path="info"):
    assert isinstance(value, PLAIN), f"{path} is {type(value).__name__}"
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), f"{path} has key {k!r}"
            assert_plain(v, f"{path}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            assert_plain(v, f"{path}[{i}]")


@pytest.fixture
def moe_pp_info():
    md = {**dense_layer(0), **moe_layer(1), "model.embed_tokens.weight": {"shape": [16, H], "dtype": BF16}}
    stages = {"model.layers.0": 0, "model.layers.1": 1, "model.embed_tokens": 0}
    return build(md, {"tp_size": 2, "ep_size": 2, "pp_size": 2}, {"tp_size": 2, "ep_size": 2}, T=8, G=2, stages=stages)


def test_wire_safe_copy_is_plain_data_only(moe_pp_info):
    assert_plain(make_nccl_reshard_refit_info_wire_safe(moe_pp_info))


def test_wire_safe_meshes_are_nested_lists_and_placements_dim_dicts(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    p = next(q for q in wire["per_layer_params"]["model.layers.0"] if q["name"].endswith("gate_proj.weight"))
    assert p["src_mesh_info"] == {"mesh": [[0, 1], [2, 3]]}
    assert p["src_placements"] == [{}, {"dim": 0}]
    assert p["global_shape"] == [I, H]


def test_wire_safe_copy_leaves_its_input_untouched(moe_pp_info):
    reference = copy.deepcopy(moe_pp_info)
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    wire["per_layer_params"]["model.layers.0"][0]["name"] = "changed"
    assert moe_pp_info == reference
    p = moe_pp_info["per_layer_params"]["model.layers.0"][0]
    assert isinstance(p["src_mesh_info"], MeshInfo) and isinstance(p["global_shape"], tuple)
    assert p["name"] == reference["per_layer_params"]["model.layers.0"][0]["name"]


def test_wire_safe_is_idempotent(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    assert make_nccl_reshard_refit_info_wire_safe(wire) == wire


def test_wire_safe_rejects_a_tensor_naming_where_it_is():
    with pytest.raises(TypeError, match=r"\['extra'\]"):
        make_nccl_reshard_refit_info_wire_safe({"extra": torch.zeros(1)})


def test_msgspec_round_trip_then_restore_gives_back_the_original(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(wire))
    assert restore_refit_info_placements(decoded) == moe_pp_info


def test_restore_works_on_msgspec_output_of_dict_flattened_placements(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    restored = restore_refit_info_placements(msgspec.msgpack.decode(msgspec.msgpack.encode(wire)))
    p = params_by_name(restored)["model.layers.1.mlp.experts.down_proj.weight"]
    assert isinstance(p["src_mesh_info"], MeshInfo)
    assert all(type(x) in (Shard, Replicate) for x in p["src_placements"] + p["dst_placements"])
    assert type(p["global_shape"]) is tuple


def test_restore_is_in_place_and_returns_its_argument(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    assert restore_refit_info_placements(wire) is wire
    assert wire == moe_pp_info


def test_restore_is_idempotent(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    once = copy.deepcopy(restore_refit_info_placements(wire))
    assert restore_refit_info_placements(wire) == once
    assert restore_refit_info_placements(copy.deepcopy(moe_pp_info)) == moe_pp_info


def test_restore_rejects_a_mesh_it_cannot_read():
    with pytest.raises(TypeError, match="mesh"):
        restore_refit_info_placements({"per_layer_params": {"l": [{"src_mesh_info": [0, 1]}]}})


_UNPICKLE_WITHOUT_TORCH_OR_MEGATRON = textwrap.dedent(
    """
    import importlib.abc, pickle, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("megatron", "torch", "transformer_engine", "msgspec"):
                raise ImportError("blocked: " + name)
    sys.meta_path.insert(0, Block())
    info = pickle.loads(sys.stdin.buffer.read())
    assert not any(m.split(".")[0] in ("megatron", "torch") for m in sys.modules), "a blocked module got imported"
    sys.stdout.buffer.write(pickle.dumps(info))
    """
)


def test_wire_form_unpickles_in_a_fresh_process_without_torch_or_megatron(moe_pp_info):
    wire = make_nccl_reshard_refit_info_wire_safe(moe_pp_info)
    proc = subprocess.run(
        [sys.executable, "-c", _UNPICKLE_WITHOUT_TORCH_OR_MEGATRON],
        input=pickle.dumps(wire),
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    back = pickle.loads(proc.stdout)
    assert back == wire
    assert restore_refit_info_placements(back) == moe_pp_info


def test_refit_info_itself_is_not_wire_safe_which_is_why_the_copy_exists(moe_pp_info):
    with pytest.raises(TypeError):
        msgspec.msgpack.encode(moe_pp_info)
