"""gpt-oss and Nemotron-H below the real-vLLM tests (those are in tests/real_vllm): names,
the interleaved gate/up, the receiver's layout against the stand-in oracle, and the
Nemotron-H names checked against megatron-core 0.16.1's own (Transformer-Engine) Mamba spec
and mixer source, and what ``testing.megatron_mamba``'s construction-only shims stand in for
(the local-spec model itself is built in tests/test_nemotron_h_rules.py)."""

from __future__ import annotations

import ast
import importlib.util
import math
import os

import pytest
import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import rank_box
from megatron_reshard.layout.placements import build_mesh_info
from megatron_reshard.megatron import gpt_oss as gpt_oss_megatron
from megatron_reshard.megatron.converters import ModelDims, NameConverter, full_from_tp_chunks
from megatron_reshard.receiver.full_weights import coverage_gaps, load_full_weights, plan_full_weights
from megatron_reshard.receiver.targets import TargetError, VllmTargets, bulk_receive_plan
from megatron_reshard.testing.vllm_like import build_vllm_like_model, expected_vllm_shard
from megatron_reshard.tools.plan_inputs import RefitParallelism, stage_inputs
from megatron_reshard.tools.presets import PUBLISHED_LAYOUTS, hf_params, model_config, travels_packed
from megatron_reshard.vllm_layout import gpt_oss as vllm_gpt_oss
from megatron_reshard.vllm_layout.gpt_oss import gen_placements

DIMS = ModelDims(tp_size=1, num_attention_heads=8, num_query_groups=2, head_dim=16, vocab_size=500,
                 gated=True, num_local_experts=2)


def test_gpt_oss_names_local_and_te_experts_use_global_expert_index():
    c = NameConverter("gpt_oss", global_layer={0: 5}, expert_offset=2, num_local_experts=2)
    got = {n: c.convert(n).hf_names for n in (
        "decoder.layers.0.self_attention.core_attention.softmax_offset",
        "decoder.layers.0.self_attention.linear_proj.bias",
        "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.0.mlp.router.bias",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias",
        "decoder.layers.0.mlp.experts.linear_fc1.bias0",  # TE grouped
        "decoder.layers.0.mlp.experts.linear_fc2.weight1",
    )}
    p = "model.layers.5"
    assert list(got.values()) == [
        (f"{p}.self_attn.sinks",), (f"{p}.self_attn.o_proj.bias",),
        (f"{p}.self_attn.q_proj.bias", f"{p}.self_attn.k_proj.bias", f"{p}.self_attn.v_proj.bias"),
        (f"{p}.mlp.router.bias",), (f"{p}.mlp.experts.3.gate_up_proj",),
        (f"{p}.mlp.experts.3.down_proj_bias",), (f"{p}.mlp.experts.2.gate_up_proj_bias",),
        (f"{p}.mlp.experts.3.down_proj",)]


def test_gpt_oss_expert_tensors_interleave_gate_and_up_and_transpose():
    c = NameConverter("gpt_oss", global_layer={0: 0}, num_local_experts=2)
    inter, hidden = 3, 4
    fc1 = torch.arange(2 * inter * hidden, dtype=torch.float32).reshape(2 * inter, hidden)
    w = full_from_tp_chunks(c.convert("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"),
                            [fc1], DIMS)["model.layers.0.mlp.experts.0.gate_up_proj"]
    assert w.shape == (hidden, 2 * inter)
    for j in range(inter):  # HF: column 2j is gate row j, column 2j+1 up row j
        assert torch.equal(w[:, 2 * j], fc1[j]) and torch.equal(w[:, 2 * j + 1], fc1[inter + j])
    b = full_from_tp_chunks(c.convert("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.bias"),
                            [torch.tensor([1., 2., 3., 10., 20., 30.])], DIMS)
    assert b["model.layers.0.mlp.experts.0.gate_up_proj_bias"].tolist() == [1, 10, 2, 20, 3, 30]
    fc2 = torch.randn(hidden, inter)
    d = full_from_tp_chunks(c.convert("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"),
                            [fc2], DIMS)["model.layers.0.mlp.experts.0.down_proj"]
    assert torch.equal(d, fc2.t())


def _gpt_oss_hf(cfg):
    g = torch.Generator().manual_seed(3)
    H, nh, nkv, hd, E, I, V = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "num_experts", "moe_intermediate_size", "vocab_size"))
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                       f"{p}.self_attn.sinks": (nh,), f"{p}.self_attn.o_proj.weight": (H, nh * hd),
                       f"{p}.self_attn.o_proj.bias": (H,), f"{p}.mlp.router.weight": (E, H),
                       f"{p}.mlp.router.bias": (E,)})
        for w in "qkv":
            rows = (nh if w == "q" else nkv) * hd
            shapes.update({f"{p}.self_attn.{w}_proj.weight": (rows, H), f"{p}.self_attn.{w}_proj.bias": (rows,)})
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            shapes.update({f"{q}.gate_up_proj": (H, 2 * I), f"{q}.gate_up_proj_bias": (2 * I,),
                           f"{q}.down_proj": (I, H), f"{q}.down_proj_bias": (H,)})
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_gpt_oss_full_weights_land_where_the_stand_in_says(tp, ep):
    cfg = dict(family="gpt_oss", hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
               num_experts=4, moe_intermediate_size=8, num_hidden_layers=2, vocab_size=100,
               intermediate_size=8, tie_word_embeddings=False)
    hf = _gpt_oss_hf(cfg)
    for r in range(tp):
        model = build_vllm_like_model(cfg, r, tp, ep)
        targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, r, tp, ep_size=ep)
        load_full_weights(targets, hf)
        plans = plan_full_weights(targets, ((n, t.shape, t.dtype) for n, t in hf.items()))
        assert coverage_gaps(targets, plans) == {}
        for name, param in model.named_parameters():
            want = expected_vllm_shard(cfg, name, hf, r, tp, ep)
            assert torch.equal(param, want), (tp, ep, r, name)
    # a transposed expert weight cannot be a shard-to-shard destination (rank 0 holds expert 0)
    targets = VllmTargets.from_named_parameters(build_vllm_like_model(cfg, 0, tp, ep).named_parameters(),
                                                cfg, 0, tp, ep_size=ep)
    with pytest.raises(TargetError, match="only arrive as a full tensor"):
        bulk_receive_plan(targets, "model.layers.0.mlp.experts.0.down_proj", (8, 32),
                          ((0, 8), (0, 32)), torch.bfloat16)


# ---- gpt-oss's experts on the exact path: vLLM's wire form (vllm_layout.gpt_oss)
_OSS_CFG = dict(family="gpt_oss", hidden_size=32, num_attention_heads=8, num_key_value_heads=2,
                head_dim=8, num_experts=5, moe_intermediate_size=8, num_hidden_layers=1,
                vocab_size=100, intermediate_size=8, tie_word_embeddings=False)
_LEAVES = {"w13_weight": "gate_up_proj", "w13_bias": "gate_up_proj_bias", "w2_weight": "down_proj",
           "w2_bias": "down_proj_bias"}


def _wire_from_hf(hf: dict, leaf: str, num_experts: int) -> torch.Tensor:
    """The wire tensor from the checkpoint's per-expert tensors, by an explicit loop:
    w13 row 2i (2i+1) is gate_up_proj's column 2i (2i+1), seen as [I, 2, H]."""
    out = []
    for e in range(num_experts):
        t = hf[f"model.layers.0.mlp.experts.{e}.{_LEAVES[leaf]}"]
        if leaf == "w13_weight":
            t = torch.stack([t[:, c] for c in range(t.shape[1])]).reshape(t.shape[1] // 2, 2, t.shape[0])
        elif leaf == "w13_bias":
            t = t.reshape(-1, 2)
        elif leaf == "w2_weight":
            t = t.t()
        out.append(t)
    return torch.stack(out)


def test_gpt_oss_megatron_experts_are_views_of_the_wire_form():
    """Each Megatron expert tensor, seen through ``wire_view``, is its expert's slice of the
    wire tensor built from the checkpoint tensors (a view of the live tensor: no copy)."""
    c = NameConverter("gpt_oss", global_layer={0: 0}, num_local_experts=2)
    inter, hidden = 3, 4
    for rule, kind, shape in (("linear_fc1.weight", "oss_fc1", (2 * inter, hidden)),
                              ("linear_fc1.bias", "oss_fc1_bias", (2 * inter,)),
                              ("linear_fc2.weight", "oss_fc2", (hidden, inter)),
                              ("linear_fc2.bias", "oss_fc2_bias", (hidden,))):
        meg = torch.randn(shape)
        conv = c.convert(f"decoder.layers.0.mlp.experts.local_experts.0.{rule}")
        hf = full_from_tp_chunks(conv, [meg], DIMS)
        leaf = {"oss_fc1": "w13_weight", "oss_fc1_bias": "w13_bias", "oss_fc2": "w2_weight",
                "oss_fc2_bias": "w2_bias"}[kind]
        view = gpt_oss_megatron.wire_view(kind, meg)
        assert view.data_ptr() == meg.data_ptr()
        assert torch.equal(view, _wire_from_hf(hf, leaf, 1)[0]), kind


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (4, 1), (2, 2), (3, 3), (4, 2)])
def test_gpt_oss_wire_form_lands_where_the_stand_in_says(tp, ep):
    """Every rank's box of each wire tensor (the payload's placements), written into the
    view the receiver names, gives what the stand-in says vLLM holds: TP-split intermediate
    (interleaved gate/up kept), uneven EP blocks (5 experts over 2 or 3), w2_bias zero past
    MoE TP rank 0 (the stand-in's NaN elsewhere would show)."""
    cfg = _OSS_CFG
    hf = _gpt_oss_hf(cfg)
    E = cfg["num_experts"]
    wire = {f"model.layers.0.mlp.experts.{leaf}": _wire_from_hf(hf, leaf, E) for leaf in _LEAVES}
    mesh, dims = build_mesh_info(tp, 0, ep_size=ep) if ep > 1 else build_mesh_info(tp, 0, tp_size=tp)
    for r in range(tp):
        model = build_vllm_like_model(cfg, r, tp, ep)
        targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, r, tp, ep_size=ep)
        plans = []
        for name, full in wire.items():
            leaf = name.rsplit(".", 1)[1]
            region = rank_box(full.shape, mesh, gen_placements(leaf, full.shape, mesh.shape, dims), r)
            plan = bulk_receive_plan(targets, name, full.shape, region, full.dtype)
            for target, box in plan.zero:
                targets.params[target][tuple(slice(a, b) for a, b in box)].zero_()
            targets.view(plan.pieces[0]).copy_(full[tuple(slice(a, b) for a, b in region)])
            plans.append(plan)
        for name, param in model.named_parameters():
            if ".experts." in name:
                want = expected_vllm_shard(cfg, name, hf, r, tp, ep)
                assert torch.equal(param, want), (tp, ep, r, name)
        gaps = coverage_gaps(targets, plans)
        assert not [n for n in gaps if ".experts." in n], gaps


def test_gpt_oss_wire_form_with_vllms_padded_intermediate():
    """Where a backend pads the per-rank intermediate size (ROCm's AITER), whole experts per
    rank receive the first rows and the padding is kept (counted as vLLM's); TP-split experts
    are refused (vLLM's loader then cuts the checkpoint in padded chunks)."""
    E, I, H, alloc = 4, 8, 32, 16
    got = vllm_gpt_oss.wire_piece("w13_weight", (E, I, 2, H), (2, 2 * alloc, H), (2, 4), 1, 0)
    assert got.view_shape == (2, alloc, 2, H) and got.target_box == ((0, 2), (0, I), (0, 2), (0, H))
    assert got.wire_box == ((2, 4), (0, I), (0, 2), (0, H))
    assert got.kept == ((0, 2), (I, alloc), (0, 2), (0, H))
    w2 = vllm_gpt_oss.wire_piece("w2_weight", (E, H, I), (4, H, alloc), (0, 4), 1, 0)
    assert w2.target_box == ((0, 4), (0, H), (0, I)) and w2.kept == ((0, 4), (0, H), (I, alloc))
    refused = vllm_gpt_oss.wire_piece("w13_weight", (E, I, 2, H), (E, 2 * 8, H), (0, E), 2, 1)
    assert isinstance(refused, str) and "pads the per-rank intermediate size 4 to 8" in refused
    assert isinstance(vllm_gpt_oss.wire_piece("w2_bias", (E, H), (E, H + 1), (0, E), 2, 0), str)


def test_gpt_oss_wire_metadata_groups_each_projection_and_keeps_forced_ones_per_expert():
    meta = {f"model.layers.0.mlp.experts.{e}.{leaf}": {"shape": list(s), "dtype": "torch.bfloat16"}
            for e in range(3) for leaf, s in (("gate_up_proj", (32, 16)), ("gate_up_proj_bias", (16,)),
                                              ("down_proj", (8, 32)), ("down_proj_bias", (32,)))}
    meta = {"model.layers.0.mlp.router.weight": {"shape": [3, 32], "dtype": "torch.bfloat16"}, **meta}
    out = gpt_oss_megatron.wire_metadata(meta, lambda n: n.endswith("down_proj_bias"))
    p = "model.layers.0.mlp.experts"
    assert {n: m["shape"] for n, m in out.items() if "_proj" not in n and "router" not in n} == {
        f"{p}.w13_weight": [3, 8, 2, 32], f"{p}.w13_bias": [3, 8, 2], f"{p}.w2_weight": [3, 32, 8]}
    assert [n for n in out if n.endswith("down_proj_bias")] == [f"{p}.{e}.down_proj_bias" for e in range(3)]
    del meta[f"{p}.1.down_proj"]
    with pytest.raises(BadInputError, match="experts 0..1 of one shape"):
        gpt_oss_megatron.wire_metadata(meta, lambda n: False)


# ---- Nemotron-H: names against megatron-core's own Mamba spec and mixer source


def _megatron_source(rel: str) -> str:
    root = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    with open(os.path.join(root, rel)) as f:
        return f.read()


def _assigned_attrs(source: str, cls: str) -> set[str]:
    """``self.<attr> = ...`` targets inside class ``cls``'s methods."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_nemotron_h_names_match_megatron_cores_mamba_spec_and_mixer():
    spec = _megatron_source("models/mamba/mamba_layer_specs.py")
    mixer = _megatron_source("ssm/mamba_mixer.py")
    # the spec megatron-core ships: TE linears with fused norms in front of in_proj / qkv / fc1
    assert "in_proj=TELayerNormColumnParallelLinear, out_proj=TERowParallelLinear" in spec
    assert "linear_qkv=TELayerNormColumnParallelLinear" in spec
    assert "linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear" in spec
    attrs = _assigned_attrs(mixer, "MambaMixer")
    assert {"in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"} <= attrs
    c = NameConverter("nemotron_h", global_layer={0: 0, 1: 1, 2: 2, 3: 3}, expert_offset=0,
                      num_local_experts=2, gated=False)
    m, a, f, e = "decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2.", "decoder.layers.3."
    names = [m + "mixer.in_proj.layer_norm_weight", m + "mixer.in_proj.weight", m + "mixer.conv1d.weight",
             m + "mixer.conv1d.bias", m + "mixer.A_log", m + "mixer.D", m + "mixer.dt_bias",
             m + "mixer.norm.weight", m + "mixer.out_proj.weight", m + "mixer.in_proj._extra_state",
             a + "self_attention.linear_qkv.layer_norm_weight", a + "self_attention.linear_qkv.weight",
             a + "self_attention.linear_proj.weight", f + "mlp.linear_fc1.layer_norm_weight",
             f + "mlp.linear_fc1.weight", f + "mlp.linear_fc2.weight", e + "pre_mlp_layernorm.weight",
             e + "mlp.router.weight", e + "mlp.router.expert_bias",
             e + "mlp.experts.linear_fc1.weight1", e + "mlp.experts.linear_fc2.weight0",
             e + "mlp.shared_experts.linear_fc1.weight", "embedding.word_embeddings.weight",
             "decoder.final_norm.weight", "output_layer.weight"]
    got, unknown = c.convert_all(names)
    assert unknown == []
    b = "backbone.layers"
    assert [x.hf_names for x in got] == [
        (f"{b}.0.norm.weight",), (f"{b}.0.mixer.in_proj.weight",), (f"{b}.0.mixer.conv1d.weight",),
        (f"{b}.0.mixer.conv1d.bias",), (f"{b}.0.mixer.A_log",), (f"{b}.0.mixer.D",),
        (f"{b}.0.mixer.dt_bias",), (f"{b}.0.mixer.norm.weight",), (f"{b}.0.mixer.out_proj.weight",),
        (f"{b}.1.norm.weight",),
        (f"{b}.1.mixer.q_proj.weight", f"{b}.1.mixer.k_proj.weight", f"{b}.1.mixer.v_proj.weight"),
        (f"{b}.1.mixer.o_proj.weight",), (f"{b}.2.norm.weight",), (f"{b}.2.mixer.up_proj.weight",),
        (f"{b}.2.mixer.down_proj.weight",), (f"{b}.3.norm.weight",), (f"{b}.3.mixer.gate.weight",),
        (f"{b}.3.mixer.gate.e_score_correction_bias",), (f"{b}.3.mixer.experts.1.up_proj.weight",),
        (f"{b}.3.mixer.experts.0.down_proj.weight",), (f"{b}.3.mixer.shared_experts.up_proj.weight",),
        ("backbone.embeddings.weight",), ("backbone.norm_f.weight",), ("lm_head.weight",)]
    # what testing.megatron_mamba's shims stand in for is what megatron-core's source says
    assert "attention_context.triton.tensor_ops import" in mixer.split("class MambaMixer")[0]
    assert "RMSNormGated = MagicMock()" in mixer
    assert "device=torch.cuda.current_device()" in mixer and "get_cuda_rng_tracker().fork()" in mixer
    assert "self.final_norm = TENorm(" in _megatron_source("ssm/mamba_block.py")


@pytest.mark.parametrize("model", ["gpt-oss-20b", "gpt-oss-120b"])
def test_plan_sends_every_gpt_oss_byte_shard_to_shard(model):
    """At the published layouts, the plan's inputs hold no packed param: every expert in
    vLLM's wire form (4 tensors per layer), each with the layouts the refit sends it in, and
    every byte of the checkpoint accounted for."""
    cfg = model_config(model)
    lay = RefitParallelism(**PUBLISHED_LAYOUTS[model])
    stages = stage_inputs(lay, cfg)
    sims = [p for st in stages.values() for p in st.params]
    assert all(p.key is not None for p in sims)
    assert not any(travels_packed(cfg, p.name) for p in hf_params(cfg))
    wire = [p for p in sims if vllm_gpt_oss.WIRE_RE.match(p.name)]
    assert len(wire) == 4 * cfg["num_hidden_layers"] and all(p.bulk for p in wire)
    assert sum(p.numel for p in sims) == sum(math.prod(p.shape) for p in hf_params(cfg))
