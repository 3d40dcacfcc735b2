"""Refits into vLLM's own model classes, checked against vLLM's own loading.

For every family the README lists, a tiny real megatron-core model (bf16, gloo, spawned
processes) is refitted by the real ``RefitSender`` into generation ranks that run vLLM 0.33's
own parallel state and model class, dummy-loaded and post-processed by vLLM as a worker
started with ``load_format="dummy"`` is, through the real worker extension. After each of
two refits (the training weights change in between) every generation rank builds a second
instance of the same vLLM model, loads the full HF tensors with vLLM's ``load_weights``,
post-processes it with vLLM's ``process_weights_after_loading``, and compares every
parameter and buffer bit for bit, the MLA weights vLLM derives after loading included
(``tools.vllm_refit``). Each family runs on three train → gen layouts (vLLM's expert
parallelism included where it builds on CPU). CPU deviations from a GPU worker:
``testing.vllm_models``.

Runs in the vLLM test venv (``make test`` builds it: vLLM needs transformers 5.x, the
transformers oracle 4.57); skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from hf_configs import MODEL_TYPES, TINY_MODEL, hf_config_kwargs  # noqa: E402
from megatron_reshard.tools.vllm_refit import vllm_refit_job  # noqa: E402
from megatron_reshard.tools.run_config import RefitRunConfig  # noqa: E402

pytestmark = pytest.mark.slow
VLLM_VERSION = tuple(int(p) for p in importlib.metadata.version("vllm").split(".")[:2])


def layout(train: str, gen: str) -> dict:
    """``"tp2 pp2 ep2"`` / ``"tp2 ep1 x2"`` (x: replicas) as RefitRunConfig fields."""
    t = dict(tp=1, pp=1, ep=1)
    t.update({k[:2]: int(k[2:]) for k in train.split()})
    g = dict(tp=1, ep=1, x=1)
    g.update({k[:2] if k[0] != "x" else "x": int(k[2:] if k[0] != "x" else k[1:]) for k in gen.split()})
    return dict(train_world=t["tp"] * t["pp"] * max(1, t["ep"] // t["tp"]), train_tp=t["tp"],
                train_pp=t["pp"], train_ep=t["ep"], gen_world=g["tp"] * g["x"], gen_tp=g["tp"],
                gen_ep=g["ep"])


@dataclass(frozen=True)
class Family:
    model: dict        # TinyGPTSpec fields
    hf_class: str
    hf_extra: dict     # family keys beyond hf_configs' shared ones
    layouts: tuple     # (train, gen) strings, see layout()


_MOE = dict(num_moe_experts=8, moe_ffn_hidden_size=32)
_DEEPSEEK = dict(TINY_MODEL, family="deepseek_v3", **_MOE, moe_shared_expert_intermediate_size=32,
                 moe_layer_freq=[0, 1, 1, 1], multi_latent_attention=True, q_lora_rank=32,
                 kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_topk_scaling_factor=2.5, layernorm_epsilon=1e-6)
_GLM = dict(TINY_MODEL, family="glm4_moe", **_MOE, moe_shared_expert_intermediate_size=32,
            moe_layer_freq=[0, 1, 1, 1], add_qkv_bias=True, head_dim=16, rotary_percent=0.5,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5)
# vLLM's DeepSeek-V3 needs the real checkpoint's router keys to hold e_score_correction_bias
_DEEPSEEK_ROUTER = dict(topk_method="noaux_tc", scoring_func="sigmoid")
# ---- gpt-oss
_GPT_OSS = dict(TINY_MODEL, family="gpt_oss", head_dim=16, num_query_groups=4, num_moe_experts=8,
                moe_ffn_hidden_size=128,
                softmax_type="learnable", add_bias_linear=True, window_size=(15, 0),
                window_attn_skip_freq=2, gpt_oss_activation=True)
# ---- end gpt-oss
# ---- Qwen3-Next: megatron-core's own GatedDeltaNet in three of four layers (vLLM's
# layer_types from full_attention_interval), the attention output gate on the fourth, MoE
# with a gated shared expert (Qwen2-MoE's names). 4 key / 8 value heads: vLLM TP 4 keeps whole
# key-head groups per rank
_QWEN3_NEXT_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                          linear_num_value_heads=8, linear_conv_kernel_dim=4)
_QWEN3_NEXT = dict(TINY_MODEL, family="qwen3_next", qk_layernorm=True, head_dim=16, **_MOE,
                   moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                   experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                   attention_output_gate=True, **_QWEN3_NEXT_LINEAR)
_QWEN3_NEXT_HF = dict(_QWEN3_NEXT_LINEAR, full_attention_interval=4, partial_rotary_factor=1.0)
# ---- end Qwen3-Next
# ---- Qwen3.5 text: Qwen3-Next's layers, the checkpoint's in_proj streams flat and named apart
# (in_proj_qkv / _z / _b / _a, which vLLM stacks into its in_proj_qkvz / in_proj_ba shards);
# the MoE model has MoE in every layer and the gated shared expert, the dense one a gated MLP
_QWEN3_5_MOE = dict(_QWEN3_NEXT, family="qwen3_5_moe_text")
_QWEN3_5 = dict(_QWEN3_5_MOE, family="qwen3_5_text", **{k: TINY_MODEL[k] for k in (
    "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")})
# ---- end Qwen3.5

FAMILIES = {
    "llama": Family(dict(TINY_MODEL, family="llama"), "LlamaForCausalLM",
                    dict(attention_bias=False, mlp_bias=False),
                    (("tp2 pp2", "tp2"), ("tp1 pp2", "tp4"), ("tp2", "tp1 x2"))),
    "qwen2": Family(dict(TINY_MODEL, family="qwen2", add_qkv_bias=True, tie_embeddings=True),
                    "Qwen2ForCausalLM", {},
                    (("tp2 pp2", "tp2"), ("tp2", "tp4"), ("tp4", "tp1"))),
    "qwen3": Family(dict(TINY_MODEL, family="qwen3", qk_layernorm=True, head_dim=16),
                    "Qwen3ForCausalLM", dict(attention_bias=False),
                    (("tp2 pp2", "tp2"), ("tp1 pp2", "tp4"), ("tp4", "tp2"))),
    "qwen3_moe": Family(dict(TINY_MODEL, family="qwen3_moe", qk_layernorm=True, **_MOE,
                             moe_layer_freq=[0, 1, 1, 1]),
                        "Qwen3MoeForCausalLM", dict(attention_bias=False),
                        (("tp2 pp2 ep2", "tp2"), ("tp2 ep2", "tp2 ep2"), ("tp1 ep2", "tp4"))),
    "qwen2_moe": Family(dict(TINY_MODEL, family="qwen2_moe", add_qkv_bias=True, **_MOE,
                             moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True),
                        "Qwen2MoeForCausalLM", dict(qkv_bias=True),
                        (("tp2 pp2 ep2", "tp2"), ("tp4 ep2", "tp2 ep2"), ("tp1 ep2", "tp4"))),
    "deepseek_v3": Family(_DEEPSEEK, "DeepseekV3ForCausalLM", _DEEPSEEK_ROUTER,
                          (("tp2 pp2 ep2", "tp2 ep2"), ("tp2 ep2", "tp4"), ("tp1 pp2 ep2", "tp1"))),
    "deepseek_v3-no-q-lora": Family(dict(_DEEPSEEK, q_lora_rank=None), "DeepseekV3ForCausalLM",
                                    _DEEPSEEK_ROUTER,
                                    (("tp2 ep2", "tp4"), ("tp2 pp2 ep2", "tp2"), ("tp1 ep2", "tp2 ep2"))),
    # Kimi-K2's shape at tiny scale: many small experts, top-8 routing with its scaling factor,
    # one shared expert, the first layer dense, q LoRA
    "kimi_k2": Family(dict(_DEEPSEEK, num_moe_experts=16, moe_ffn_hidden_size=16,
                           moe_shared_expert_intermediate_size=16, moe_router_topk=8,
                           moe_router_topk_scaling_factor=2.827),
                      "DeepseekV3ForCausalLM", _DEEPSEEK_ROUTER,
                      (("tp2 pp2 ep2", "tp2 ep2"), ("tp2 ep2", "tp4"), ("tp1 ep2", "tp1 x2"))),
    # ---- gpt-oss: sinks, biases everywhere, interleaved gate/up experts, alternating windows.
    # vLLM's CPU experts take swigluoai only with I/TP a multiple of 32 (no padding for it)
    "gpt_oss": Family(_GPT_OSS,
                      "GptOssForCausalLM", {},
                      (("tp2 pp2 ep2", "tp2"), ("tp2 ep2", "tp4"), ("tp4 ep2", "tp2 ep2"))),
    # uneven PP: one layer on the first stage, three on the last
    "gpt_oss-uneven-pp": Family(dict(_GPT_OSS, num_layers_in_first_pipeline_stage=1,
                                     num_layers_in_last_pipeline_stage=3),
                                "GptOssForCausalLM", {}, (("tp1 pp2", "tp2"),)),
    # ---- end gpt-oss
    # GLM-4.5's shape at tiny scale: GQA with q/k/v biases, partial RoPE (half the head),
    # sigmoid routing with the score-correction bias and a scaling factor, one shared expert,
    # the first layer dense; vLLM holds the router in float32 (widened on write)
    "glm4_moe": Family(_GLM, "Glm4MoeForCausalLM", {},
                       (("tp2 pp2 ep2", "tp2 ep2"), ("tp2 ep2", "tp4"), ("tp4 ep2", "tp1 x2"))),
    # with q/k norms (GLM-4.5's use_qk_norm) and uneven train stages (3 + 1 layers)
    "glm4_moe-qk-norm-uneven-pp": Family(dict(_GLM, qk_layernorm=True,
                                              num_layers_in_first_pipeline_stage=3),
                                         "Glm4MoeForCausalLM", {}, (("tp2 pp2 ep2", "tp2"),)),
    # ---- Qwen3-Next
    "qwen3_next": Family(_QWEN3_NEXT, "Qwen3NextForCausalLM", _QWEN3_NEXT_HF,
                         (("tp2 pp2 ep2", "tp2 ep2"), ("tp1 ep2", "tp4"), ("tp4 ep2", "tp1 x2"))),
    # uneven train stages: one layer on the first, three (two linear, the gated full) on the last
    "qwen3_next-uneven-pp": Family(dict(_QWEN3_NEXT, num_layers_in_first_pipeline_stage=1),
                                   "Qwen3NextForCausalLM", _QWEN3_NEXT_HF, (("tp1 pp2", "tp2"),)),
    # ---- end Qwen3-Next
    # ---- Qwen3.5 text
    "qwen3_5_moe_text": Family(_QWEN3_5_MOE, "Qwen3_5MoeForCausalLM", _QWEN3_NEXT_HF,
                               (("tp2 pp2 ep2", "tp2 ep2"), ("tp1 ep2", "tp4"), ("tp4 ep2", "tp1 x2"))),
    "qwen3_5_text": Family(_QWEN3_5, "Qwen3_5ForCausalLM", _QWEN3_NEXT_HF,
                           (("tp2 pp2", "tp2"), ("tp1 pp2", "tp4"), ("tp4", "tp1 x2"))),
    # uneven train stages: one layer on the first, three on the last
    "qwen3_5_text-uneven-pp": Family(dict(_QWEN3_5, num_layers_in_first_pipeline_stage=1),
                                     "Qwen3_5ForCausalLM", _QWEN3_NEXT_HF, (("tp2 pp2", "tp2"),)),
    # ---- end Qwen3.5
}
CASES = [(f, i) for f in FAMILIES for i in range(len(FAMILIES[f].layouts))]
# the cases that also run against the oldest supported vLLM (make test-vllm-oldest): a dense
# model, an MoE model (its first layout plants a fault, below), MLA with its derived weights
# in storage of their own (testing.vllm_oldest_shims builds 0.25's MLA on the CPU), gpt-oss,
# GLM-4.5 and Qwen3-Next: one layout each (a few seconds each once the pool is warm)
RANGE_CASES = (("qwen3", 0), ("qwen3_moe", 0), ("deepseek_v3", 1), ("gpt_oss", 0), ("glm4_moe", 0),
               ("qwen3_next", 0))
# checks that ride on a case's job (one pool job each saved): gen rank 0 of the first
# Qwen3-MoE layout plants a bit flip after its last refit; the second DeepSeek-V3 layout
# gives MLA's absorbed weights storage of their own (as vLLM does for an FP8 kv_b_proj)
EXTRA_CHECKS = {("qwen3_moe", 0): dict(plant_fault=True), ("deepseek_v3", 1): dict(copy_derived=True)}
REFITS = 2


def vllm_config_json(family: Family) -> dict:
    return dict(hf_config_kwargs(family.model, family.hf_class, family.hf_extra),
                architectures=[family.hf_class], model_type=MODEL_TYPES[family.hf_class],
                torch_dtype="bfloat16")


def _build(spec, device, dtype):
    """``build_gpt_model`` on the CPU: with PP and tied embeddings Megatron moves the
    shared embedding with ``.cuda()`` (the test-support shim keeps it on the CPU)."""
    from megatron_cpu_forward import cpu_build_shims
    from megatron_reshard.testing.megatron_models import build_gpt_model

    with cpu_build_shims():
        model = build_gpt_model(spec)
    return model.to(device=device, dtype=dtype)


def run_case(pool, family_id: str, index: int, **options) -> list[dict]:
    return run_family(pool, FAMILIES[family_id], index, **options)


def run_family(pool, family: Family, index: int, return_failures: bool = False,
               **options) -> list:
    train, gen = family.layouts[index]
    cfg = RefitRunConfig(model="dense", model_overrides=dict(family.model), refits=REFITS,
                         verify=True, dtype="bfloat16", quiet=True, timeout_s=120,
                         **layout(train, gen))
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), model_builder=_build, **options,
                       num_ports=cfg.train_pp + 2, timeout_s=420,
                       return_failures=return_failures)
    if return_failures:
        return results
    return [r for r in results if r["role"] == "gen"]


@pytest.fixture(scope="module")
def refitted(pool):
    cache: dict = {}

    def get(family_id: str, index: int) -> list[dict]:
        if (family_id, index) not in cache:
            cache[(family_id, index)] = run_case(pool, family_id, index,
                                                 **EXTRA_CHECKS.get((family_id, index), {}))
        return cache[(family_id, index)]

    return get


def check_equal_to_vllm(g: dict, who: str, refits: int = REFITS) -> None:
    """A generation rank's report after ``refits`` refits: every one bit-equal to vLLM's own
    ``load_weights``, written in place, committed consistent, no target left unwritten."""
    assert len(g["differences"]) == refits, who
    for step, bad in enumerate(g["differences"]):
        assert bad == [], f"{who}, refit {step + 1}: differs from vLLM's load_weights: {bad}"
    assert g["moved"] == [[]] * refits, f"{who}: params moved to new storage: {g['moved']}"
    assert g["weights"]["state"] == "consistent" and g["weights"]["version"] == refits, who
    assert g["summary"]["uncovered_targets"] == {}, who


@pytest.mark.parametrize("family_id,index", [
    pytest.param(f, i, id=f"{f}-{' to '.join(FAMILIES[f].layouts[i])}",
                 marks=[pytest.mark.vllm_range] if (f, i) in RANGE_CASES else [])
    for f, i in CASES])
def test_refit_is_bit_equal_to_vllms_own_loading(refitted, family_id, index):
    gens = refitted(family_id, index)
    for g in gens:
        who = f"{family_id} {FAMILIES[family_id].layouts[index]} gen rank {g['rank']}"
        check_equal_to_vllm(g, who)
        # the stand-in's expected shards agree with vLLM's storage, name for name
        assert g["stand_in_differences"] == [[]] * REFITS, f"{who}: {g['stand_in_differences']}"


def test_mla_layers_are_refreshed_after_every_refit(refitted):
    for family_id in ("deepseek_v3", "deepseek_v3-no-q-lora", "kimi_k2"):
        g = refitted(family_id, 0)[0]
        layers = FAMILIES[family_id].model["num_layers"]
        for stats in g["refits"]:
            assert len(stats["derived_refreshed"]) == layers, (family_id, stats["derived_refreshed"])
            assert all(n.endswith("self_attn.mla_attn.mla_attn") for n in stats["derived_refreshed"])


@pytest.mark.vllm_range
def test_a_planted_bit_flip_is_seen(refitted):
    """The comparison is able to fail: one bit flipped in one refitted param is reported,
    by name and alone."""
    gen0 = next(g for g in refitted("qwen3_moe", 0) if g["rank"] == 0)
    planted = gen0["planted"]
    assert planted is not None and planted[-1].startswith("planted:")
    assert planted[:-1] == [planted[-1].removeprefix("planted:")]


@pytest.mark.vllm_range
def test_mla_weights_held_as_copies_are_recomputed_in_their_storage(refitted):
    """With an FP8 kv_b_proj vLLM's absorbed W_UK_T / W_UV are copies, not views: given
    storage of their own, they must still equal vLLM's own loading after each refit, at the
    addresses they had (vLLM's layer method rebinds them; the refresh copies back)."""
    for g in refitted("deepseek_v3", 1):
        assert g["copied_derived"] == 8  # 4 layers x (W_UK_T, W_UV), apart from kv_b_proj
        assert g["differences"] == [[]] * REFITS, g["differences"]
        assert g["moved"] == [[]] * REFITS, g["moved"]
        assert all(len(s["derived_refreshed"]) == 4 for s in g["refits"])


# vLLM's Llama with attention_bias holds qkv_proj and o_proj biases that a training model
# without biases never sends: params the payload does not cover
BIASED_LLAMA = Family(dict(TINY_MODEL, family="llama"), "LlamaForCausalLM",
                      dict(attention_bias=True, mlp_bias=False), (("tp1 pp2", "tp2"),))
BIASES = sorted(f"model.layers.{i}.self_attn.{p}.bias" for i in range(4) for p in ("qkv_proj", "o_proj"))


def test_vllm_params_the_payload_does_not_cover_are_refused_at_prepare(pool):
    from megatron_reshard.tools.worlds import RankFailure

    results = run_family(pool, BIASED_LLAMA, 0, return_failures=True)
    train, gens = results[:2], results[2:]
    for g in gens:
        assert g["prepare_error"].startswith("UncoveredParamsError"), g
        assert "8 param(s)" in g["prepare_error"] and "keep_as_loaded" in g["prepare_error"], g
        for name in BIASES[:8]:
            assert name in g["prepare_error"], (name, g["prepare_error"])
    for t in train:  # through the fault board, at the training side's first refit
        assert isinstance(t, RankFailure) and "PeerFailure" in t.text, t
        assert "qkv_proj.bias" in t.text, t.text


def test_vllm_params_kept_as_loaded_are_reported_and_keep_their_bytes(pool):
    gens = run_family(pool, BIASED_LLAMA, 0, keep_as_loaded=["*.self_attn.qkv_proj.bias",
                                                             "*.self_attn.o_proj.bias"])
    for g in gens:
        who = f"gen rank {g['rank']}"
        assert g["summary"]["kept_as_loaded"] == BIASES, who
        assert g["differences"] == [[]] * REFITS, f"{who}: {g['differences']}"
        assert g["kept_changed"] == [[]] * REFITS, f"{who}: {g['kept_changed']}"
        assert g["weights"]["state"] == "consistent" and g["weights"]["version"] == REFITS, who
        assert g["weights"]["not_refitted"] == BIASES, (who, g["weights"])
        assert g["report"]["kept_as_loaded"] == BIASES, who


# ---- gpt-oss
def test_gpt_oss_sends_every_param_shard_to_shard(refitted):
    """gpt-oss's experts too take the exact path, in vLLM's wire form (interleaved gate/up,
    transposed storage, biases): no gen rank receives a full (packed) tensor, and the
    w2_bias of MoE TP ranks > 0 is vLLM's zero (part of the bit-equal check above)."""
    for family, index in [("gpt_oss", i) for i in range(len(FAMILIES["gpt_oss"].layouts))] + [
            ("gpt_oss-uneven-pp", 0)]:
        for g in refitted(family, index):
            assert g["summary"]["misc_params"] == 0, (family, index, g["rank"], g["summary"])
            assert all(s["misc_bytes"] == 0 and s["bulk_bytes"] > 0 for s in g["refits"]), g["refits"]


def test_gpt_oss_a_planted_interleave_error_is_seen(pool):
    """The comparison sees a wrong interleave: training ranks that send Megatron's
    ``[gate ; up]`` rows as if interleaved leave exactly the w13 weights and biases of every
    MoE layer different from vLLM's own loading (gen TP 4: each rank's share cut mid-gate)."""
    gens = run_case(pool, "gpt_oss", 1, plant_interleave_error=True)
    layers = FAMILIES["gpt_oss"].model["num_layers"]
    for g in gens:
        for bad in g["differences"]:
            flat = sorted(n.replace(".routed_experts.", ".") for n in bad)  # nested or not
            assert flat == sorted(f"model.layers.{i}.mlp.experts.{leaf}" for i in range(layers)
                                  for leaf in ("w13_bias", "w13_weight")), (g["rank"], bad)
# ---- end gpt-oss


def _gated_qkv_packed(family: str, index: int) -> int:
    """The gated q/k/v travel per KV group where each train rank holds whole KV groups
    (train TP <= 2 here), else packed (3 params of the one full-attention layer)."""
    train_tp = layout(*FAMILIES[family].layouts[index])["train_tp"]
    return 0 if train_tp <= FAMILIES[family].model["num_query_groups"] else 3


def test_qwen3_next_sends_only_its_gated_delta_net_params_packed(refitted):
    """Qwen3-Next's packed (full-tensor) params on every gen rank are exactly the 3 params of
    each of the 3 Gated-DeltaNet layers that are no view of Megatron's (in_proj_qkvz,
    in_proj_ba, the gated norm), and the gated q/k/v where a train rank cuts a KV group;
    everything else (conv1d by segment, A_log, dt_bias, out_proj, gated q/k/v per KV group, experts,
    shared expert, norms, o_proj, vocab) takes the exact path."""
    for index in range(len(FAMILIES["qwen3_next"].layouts)):
        for g in refitted("qwen3_next", index):
            assert g["summary"]["misc_params"] == 3 * 3 + _gated_qkv_packed("qwen3_next", index), (
                index, g["rank"], g["summary"])


def test_qwen3_5_sends_its_in_proj_streams_and_gated_qkv_shard_to_shard(refitted):
    """Qwen3.5's packed (full-tensor) params: the gated norm of each of the 3 Gated-DeltaNet
    layers (and the gated q/k/v where a train rank cuts a KV group); its in_proj streams
    (in_proj_qkv as q, k, v apart, in_proj_z, _b, _a), conv1d by segment, A_log, dt_bias,
    out_proj and the gated q/k/v per KV group take the exact path, at equal and different
    TP sizes (gen TP 4 > 2 KV heads: a group's heads split, k/v replicated)."""
    for family, index in (("qwen3_5_moe_text", 0), ("qwen3_5_moe_text", 1), ("qwen3_5_moe_text", 2),
                          ("qwen3_5_text", 1), ("qwen3_5_text-uneven-pp", 0)):
        for g in refitted(family, index):
            assert g["summary"]["misc_params"] == 3 * 1 + _gated_qkv_packed(family, index), (
                family, index, g["rank"], g["summary"])


def test_vllms_qwen3_5_module_imports_only_under_the_torchvision_stand_ins():
    """Pins the shim ``testing.vllm_models`` documents: vLLM 0.33's Qwen3.5 module imports
    its vision tower, which needs torchvision (not installed here); under the stand-ins it
    imports, and afterwards torchvision is absent again."""
    import sys

    from megatron_reshard.testing import vllm_models as vm

    importlib.import_module("vllm.model_executor.models.qwen3_next")
    if "vllm.model_executor.models.qwen3_5" not in sys.modules:
        with pytest.raises(ModuleNotFoundError, match="torchvision"):
            importlib.import_module("vllm.model_executor.models.qwen3_5")
    with vm._vision_imports_without_torchvision():
        module = importlib.import_module("vllm.model_executor.models.qwen3_5")
    assert module.Qwen3_5ForCausalLM and module.Qwen3_5MoeForCausalLM
    assert not any(name.startswith("torchvision") for name in sys.modules)


@pytest.mark.vllm_range
def test_vllms_cpu_platform_configures_without_triton_only_under_the_shim():
    """Pins the shim ``testing.vllm_models`` documents: from vLLM 0.34 the x86 CPU platform
    refuses a config without triton-cpu (absent here; 0.33 and older only warn); under the
    shim it configures, and Triton is still absent for every other reader of the flag."""
    import vllm.triton_utils as triton_utils
    from vllm.config import VllmConfig

    from megatron_reshard.testing import vllm_models as vm

    assert triton_utils.HAS_TRITON is False  # no triton-cpu on this machine
    vm.cpu_platform_without_triton()
    config = VllmConfig()  # the platform's check runs under the shim
    assert triton_utils.HAS_TRITON is False
    if VLLM_VERSION >= (0, 34):
        with pytest.raises(RuntimeError, match="requires Triton"):
            vm.CPU_PLATFORM_CHECK(config)
    else:
        assert vm.CPU_PLATFORM_CHECK is None or vm.CPU_PLATFORM_CHECK(config) is None
