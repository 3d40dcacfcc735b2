"""DeepSeek-V3-style models (MLA attention, sigmoid routing with score-correction bias,
shared experts, first layers dense): names, vLLM layout, train-side views, refits.

Multi-process tests use real megatron-core models on CPU (gloo) and compare against the
oracles that do not read the converter tables: ``megatron.reference`` (full HF tensors
gathered on the train side) and ``testing.vllm_like`` (what each vLLM-layout param must
hold), bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.run_config import MODEL_PRESETS, RefitRunConfig
from megatron_reshard.megatron.converters import NameConverter
from megatron_reshard.receiver.full_weights import load_full_weights
from megatron_reshard.receiver.targets import TargetError, VllmTargets
from megatron_reshard.testing.vllm_like import (build_vllm_like_model, expected_vllm_shard,
                                                random_hf_state_dict)

pytestmark = pytest.mark.filterwarnings("ignore")

A = "model.layers.2.self_attn."


# ----------------------------------------------------------------- names (no processes)


def _conv(**kw) -> NameConverter:
    return NameConverter(family="deepseek_v3", global_layer={0: 2}, **kw)


@pytest.mark.parametrize("megatron, hf, kind", [
    ("linear_q_down_proj.weight", "q_a_proj.weight", "column"),
    ("linear_q_up_proj.weight", "q_b_proj.weight", "column"),
    ("linear_q_proj.weight", "q_proj.weight", "column"),  # no q LoRA
    ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight", "column"),
    ("linear_kv_up_proj.weight", "kv_b_proj.weight", "column"),
    ("q_layernorm.weight", "q_a_layernorm.weight", "replicated"),
    ("kv_layernorm.weight", "kv_a_layernorm.weight", "replicated"),
    ("linear_q_up_proj.layer_norm_weight", "q_a_layernorm.weight", "replicated"),  # TE spec
    ("linear_kv_up_proj.layer_norm_weight", "kv_a_layernorm.weight", "replicated"),
    ("linear_proj.weight", "o_proj.weight", "row"),
])
def test_megatron_mla_names_map_to_deepseek_v3_names(megatron, hf, kind):
    got = _conv().convert(f"decoder.layers.0.self_attention.{megatron}")
    assert (got.hf_names, got.kind) == ((A + hf,), kind)


def test_te_duplicated_down_projections_are_replicated():
    got = _conv(mla_down_replicated=True).convert("decoder.layers.0.self_attention.linear_kv_down_proj.weight")
    assert got.kind == "replicated" and got.tp_dim is None


# ----------------------------------------------------------------- receiver (no processes)


def _hf_config(q_lora=32) -> dict:
    return dict(family="deepseek_v3", hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                num_hidden_layers=2, vocab_size=500, moe_layers=[1], router_expert_bias=True,
                shared_expert_intermediate_size=32, q_lora_rank=q_lora, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize("q_lora", [32, None])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_full_hf_tensors_land_where_vllm_holds_them(q_lora, tp):
    cfg = _hf_config(q_lora)
    full = random_hf_state_dict(cfg, dtype=torch.float32, seed=3)
    for r in range(tp):
        model = build_vllm_like_model(cfg, r, tp, dtype=torch.float32)
        load_full_weights(VllmTargets.from_named_parameters(model.named_parameters(), cfg, r, tp), full)
        for name, p in model.named_parameters():
            assert torch.equal(p, expected_vllm_shard(cfg, name, full, r, tp)), (name, r)
    names = dict(build_vllm_like_model(cfg, 0, 2).named_parameters())
    assert ("model.layers.0.self_attn.fused_qkv_a_proj.weight" in names) == bool(q_lora)
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_fused_a_projection_with_the_wrong_rows_is_refused_naming_it():
    cfg = _hf_config()
    model = build_vllm_like_model(cfg, 0, 2, dtype=torch.float32)
    targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, 0, 2, label="gen rank 0")
    with pytest.raises(TargetError, match=r"kv_a_proj_with_mqa.*rows 32\.\.72 of .*fused_qkv_a_proj"):
        targets.resolve("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (41, 64))


# ----------------------------------------------------------------- MTP refused


def test_multi_token_prediction_is_refused_with_a_message_naming_it():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_reshard.megatron.mla import unsupported_features

    config = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                                  q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
                                  qk_pos_emb_head_dim=8, v_head_dim=16, mtp_num_layers=1,
                                  qk_layernorm=True, use_cpu_initialization=True)
    (problem,) = unsupported_features(config)
    assert "multi-token prediction" in problem and "mtp_num_layers=1" in problem
    config.mtp_num_layers = None
    assert unsupported_features(config) == []
    config.qk_layernorm = False  # MLA without its q/kv norms: no DeepSeek-V3 counterpart
    (problem,) = unsupported_features(config)
    assert "qk_layernorm=False" in problem


# ----------------------------------------------------------------- train side views


def _spec(**overrides) -> dict:
    spec = {k: v for k, v in MODEL_PRESETS["deepseek"].items() if k != "family"}
    spec.update(dtype="float32", **overrides)
    return spec


@pytest.mark.parametrize("q_lora", [32, None])
def test_train_views_match_the_reference_tp2_ep2(pool, q_lora):
    from test_megatron_source import _run

    results = _run(pool, 4, _spec(q_lora_rank=q_lora), "deepseek_v3",
                   {"tp_size": 2, "ep_size": 1, "pp_size": 1}, 2, dict(tp=2, ep=2))
    assert results[0]["n_other"] == 0  # everything on the exact path


# ----------------------------------------------------------------- refits end to end


def _refit_job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


LAYOUTS = {  # at most 6 processes (the shared pool); train TP 1, 2, 4 x gen TP 1, 2, 4
    "train-tp4-to-gen-tp2": dict(train_world=4, train_tp=4, train_pp=1, train_ep=1, gen_world=2, gen_tp=2),
    "train-tp1-dp2-to-gen-tp4": dict(train_world=2, train_tp=1, train_pp=1, train_ep=1, gen_world=4, gen_tp=4),
    "train-tp2-ep2-to-gen-tp4-ep4": dict(train_world=2, train_tp=2, train_pp=1, train_ep=2, gen_world=4,
                                        gen_tp=4, gen_ep=4),
    "train-pp2-no-q-lora-to-gen-tp1": dict(train_world=2, train_tp=1, train_pp=2, train_ep=1, gen_world=1,
                                           gen_tp=1, model_overrides={"q_lora_rank": None}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_deepseek_refit_is_bit_exact_and_all_on_the_exact_path(pool, layout):
    cfg = RefitRunConfig(model="deepseek", refits=2, quiet=True, timeout_s=60, **LAYOUTS[layout])
    summary = summarize(cfg, pool.run(_refit_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=240))
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0, summary["per_gen_rank"]


def test_mla_heads_that_do_not_split_over_gen_tp_are_refused():
    cfg = _hf_config()  # 8 heads: vLLM asserts num_heads % tp_size == 0
    model = build_vllm_like_model(cfg, 0, 16, dtype=torch.float32)  # rows split, heads would not
    targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, 0, 16)
    with pytest.raises(TargetError, match=r"q_b_proj.*8 MLA heads do not split over tp_size=16"):
        targets.resolve(A.replace(".2.", ".0.") + "q_b_proj.weight", (192, 32))
