"""Megatron → HF name tables and the tensor rules, at name level (no processes, no Megatron).

Transformer-Engine specs and legacy grouped GEMM cannot be built on CPU, so their names and
memory layouts are checked here against Megatron's own forward formulas.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_reshard.megatron.converters import (
    ModelDims,
    NameConverter,
    full_from_tp_chunks,
    hf_global_shapes,
    local_views,
)
from megatron_reshard.testing.megatron_reference import split_qkv
from megatron_reshard.megatron.source import stacked_spec


def conv(family="qwen3", **kw):
    kw.setdefault("global_layer", {0: 7, 1: 8})
    return NameConverter(family=family, **kw)


def test_te_spec_names_map_fused_norms_and_skip_extra_state():
    c = conv()
    names = [
        "module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv._extra_state",
        "decoder.layers.0.self_attention.core_attention._extra_state",
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
    ]
    got, unknown = c.convert_all(names)
    assert unknown == []
    assert [x.hf_names for x in got] == [
        ("model.layers.7.input_layernorm.weight",),
        ("model.layers.7.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
         "model.layers.7.self_attn.v_proj.weight"),
        ("model.layers.8.post_attention_layernorm.weight",),
        ("model.layers.8.mlp.gate_proj.weight", "model.layers.8.mlp.up_proj.weight"),
        ("model.layers.8.mlp.down_proj.weight",),
        ("model.norm.weight",),
    ]


def test_expert_names_use_global_expert_index_in_every_expert_layout():
    c = conv("qwen3_moe", expert_offset=4, num_local_experts=2)
    assert c.convert("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight").hf_names == (
        "model.layers.8.mlp.experts.5.down_proj.weight",)
    assert c.convert("decoder.layers.1.mlp.experts.linear_fc1.weight0").hf_names == (  # TE grouped
        "model.layers.8.mlp.experts.4.gate_proj.weight", "model.layers.8.mlp.experts.4.up_proj.weight")
    assert c.convert("decoder.layers.0.mlp.experts.weight2").hf_names == (  # legacy grouped GEMM
        "model.layers.7.mlp.experts.4.down_proj.weight", "model.layers.7.mlp.experts.5.down_proj.weight")
    assert c.convert("decoder.layers.0.mlp.router.weight").hf_names == ("model.layers.7.mlp.gate.weight",)


def test_shared_expert_names_depend_on_the_family():
    name = "decoder.layers.0.mlp.shared_experts.linear_fc2.weight"
    assert conv("qwen2_moe").convert(name).hf_names == ("model.layers.7.mlp.shared_expert.down_proj.weight",)
    assert conv("deepseek_v3").convert(name).hf_names == ("model.layers.7.mlp.shared_experts.down_proj.weight",)
    assert conv("qwen2_moe").convert("decoder.layers.0.mlp.shared_experts.gate_weight").hf_names == (
        "model.layers.7.mlp.shared_expert_gate.weight",)
    assert conv("deepseek_v3").convert("decoder.layers.0.mlp.router.expert_bias").hf_names == (
        "model.layers.7.mlp.gate.e_score_correction_bias",)
    with pytest.raises(KeyError):
        conv("qwen3_moe").convert(name)


def test_glm4_moe_local_and_te_spec_names_map_to_glm_names():
    """GLM-4.5 (glm4_moe): megatron-core 0.16.1 cannot even build its TE layer specs without
    Transformer Engine (``get_gpt_decoder_block_spec(use_transformer_engine=True)`` raises
    NameError on ``TENorm``), so the TE names are listed here from its TE classes: the
    input norm fused into ``linear_qkv`` (``TELayerNormColumnParallelLinear``), the q/k/v
    bias on it, grouped experts ``TEGroupedMLP`` (``weight<i>``), ``_extra_state``."""
    c = conv("glm4_moe", expert_offset=4, num_local_experts=2)
    L7, L8 = "model.layers.7", "model.layers.8"
    names = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": (f"{L7}.input_layernorm.weight",),
        "decoder.layers.0.input_layernorm.weight": (f"{L7}.input_layernorm.weight",),  # local spec
        "decoder.layers.0.self_attention.linear_qkv.bias": tuple(
            f"{L7}.self_attn.{x}_proj.bias" for x in "qkv"),
        "decoder.layers.0.self_attention.linear_qkv._extra_state": None,
        "decoder.layers.0.self_attention.q_layernorm.weight": (f"{L7}.self_attn.q_norm.weight",),
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": (f"{L7}.post_attention_layernorm.weight",),
        "decoder.layers.0.mlp.linear_fc1.weight": (f"{L7}.mlp.gate_proj.weight", f"{L7}.mlp.up_proj.weight"),
        "decoder.layers.1.pre_mlp_layernorm.weight": (f"{L8}.post_attention_layernorm.weight",),
        "decoder.layers.1.mlp.router.weight": (f"{L8}.mlp.gate.weight",),
        "decoder.layers.1.mlp.router.expert_bias": (f"{L8}.mlp.gate.e_score_correction_bias",),
        "decoder.layers.1.mlp.experts.linear_fc1.weight1": (
            f"{L8}.mlp.experts.5.gate_proj.weight", f"{L8}.mlp.experts.5.up_proj.weight"),
        "decoder.layers.1.mlp.experts.linear_fc2.weight0": (f"{L8}.mlp.experts.4.down_proj.weight",),
        "decoder.layers.1.mlp.experts.linear_fc2._extra_state": None,
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (
            f"{L8}.mlp.shared_experts.gate_proj.weight", f"{L8}.mlp.shared_experts.up_proj.weight"),
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (f"{L8}.mlp.shared_experts.down_proj.weight",),
    }
    for name, hf in names.items():
        got = c.convert(name)
        assert (None if got is None else got.hf_names) == hf, name
    with pytest.raises(KeyError):  # Qwen2-MoE's shared-expert gate is no GLM name
        c.convert("decoder.layers.1.mlp.shared_experts.gate_weight")


def test_unknown_names_are_all_collected():
    _, unknown = conv().convert_all([
        "decoder.layers.0.self_attention.linear_q_down_proj.weight",  # MLA: not in the tables
        "decoder.layers.0.input_layernorm.weight",
        "mtp.layers.0.enorm.weight",
        "decoder.layers.5.input_layernorm.weight",  # no global layer number known
    ])
    assert unknown == ["decoder.layers.0.self_attention.linear_q_down_proj.weight", "mtp.layers.0.enorm.weight",
                       "decoder.layers.5.input_layernorm.weight"]


def test_unknown_family_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model family 'gpt2'.*llama"):
        conv("gpt2")


def test_non_gated_fc1_is_up_proj_alone_and_tied_output_layer_is_skipped():
    c = conv("llama", gated=False, tied_embeddings=True)
    x = c.convert("decoder.layers.0.mlp.linear_fc1.weight")
    assert x.hf_names == ("model.layers.7.mlp.up_proj.weight",)
    dims = ModelDims(tp_size=2, num_attention_heads=4, num_query_groups=2, head_dim=8, vocab_size=100, gated=False)
    assert hf_global_shapes(x, [24, 16], dims) == {"model.layers.7.mlp.up_proj.weight": [48, 16]}
    assert c.convert("output_layer.weight") is None
    assert conv("llama").convert("output_layer.weight").hf_names == ("lm_head.weight",)


def test_qkv_full_tensor_deinterleaves_per_kv_group():
    nh, nkv, hd, h = 8, 2, 3, 5
    dims = ModelDims(tp_size=2, num_attention_heads=nh, num_query_groups=nkv, head_dim=hd, vocab_size=1, gated=True)
    c = conv().convert("decoder.layers.0.self_attention.linear_qkv.weight")
    full = torch.randn((nh + 2 * nkv) * hd, h)
    got = full_from_tp_chunks(c, list(full.chunk(2)), dims)
    q, k, v = split_qkv(full, nh, nkv, hd)
    assert torch.equal(got["model.layers.7.self_attn.q_proj.weight"], q)
    assert torch.equal(got["model.layers.7.self_attn.k_proj.weight"], k)
    assert torch.equal(got["model.layers.7.self_attn.v_proj.weight"], v)
    # the first K rows follow the first group's nh/nkv query heads
    assert torch.equal(k[:hd], full[nh // nkv * hd: nh // nkv * hd + hd])


def test_legacy_grouped_gemm_views_compute_what_grouped_mlp_computes():
    e_l, h, i = 3, 4, 5
    dims = ModelDims(tp_size=1, num_attention_heads=1, num_query_groups=1, head_dim=4, vocab_size=1,
                     gated=True, num_local_experts=e_l)
    c = conv("qwen3_moe", num_local_experts=e_l, expert_offset=3)
    weight1 = torch.randn(h, e_l * 2 * i)
    weight2 = torch.randn(e_l * i, h)
    v1 = local_views(c.convert("decoder.layers.0.mlp.experts.weight1"), weight1, dims)
    v2 = local_views(c.convert("decoder.layers.0.mlp.experts.weight2"), weight2, dims)
    x = torch.randn(6, h)
    w1 = weight1.view(e_l, h, -1)  # GroupedMLP.forward
    w2 = weight2.view(e_l, -1, h)
    for e in range(e_l):
        gate_out, up_out = torch.chunk(x @ w1[e], 2, dim=-1)
        p = f"model.layers.7.mlp.experts.{3 + e}"
        assert torch.allclose(F.linear(x, v1[f"{p}.gate_proj.weight"]), gate_out)
        assert torch.allclose(F.linear(x, v1[f"{p}.up_proj.weight"]), up_out)
        y = torch.randn(6, i)
        assert torch.allclose(F.linear(y, v2[f"{p}.down_proj.weight"]), y @ w2[e])
        assert v1[f"{p}.gate_proj.weight"].data_ptr() >= weight1.data_ptr()  # a view, no copy
    # the grouped [E_l, I, H] entry is one strided view of weight1, no pre hook
    gates = [v1[f"model.layers.7.mlp.experts.{3 + e}.gate_proj.weight"] for e in range(e_l)]
    spec = stacked_spec(gates)
    assert spec.pre is None and spec.base.untyped_storage().data_ptr() == weight1.untyped_storage().data_ptr()
    assert torch.equal(spec.begin().buf, torch.stack(gates))


def test_separate_expert_tensors_are_given_as_a_list_without_a_stacking_copy():
    experts = [torch.randn(4, 3) for _ in range(2)]
    spec = stacked_spec(experts)
    assert spec.pre is None
    assert all(a is b for a, b in zip(spec.begin().buf, experts))
