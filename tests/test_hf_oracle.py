"""An oracle outside the project: Hugging Face ``transformers`` runs the refitted weights.

For each supported family a tiny megatron-core model (float32, training TP2 PP2, EP2 for
MoE; one more Llama layout with generation TP4 over 2 KV heads) is refitted by the real
``RefitSender`` into vLLM-layout storage through the real receiver (the vLLM worker
extension). The generation shards are then reassembled into full
HF tensors by ``hf_reassemble`` (vLLM's layouts, written without the project's code),
loaded with ``load_state_dict(strict=True)`` into the family's ``transformers`` class and
run on the same tokens as Megatron's own forward (``megatron_cpu_forward``). The logits
must agree to rtol 1e-5 / atol 1e-5 (float32; the two differ only in summation order:
measured at most 2.3e-6 absolute on logits of magnitude up to ~3.6).

Unlike the bit-exact checks elsewhere, nothing here derives from ``converters.py`` or
``megatron.reference``: a mistake made consistently in a converter and in the project's
own oracle (gate and up swapped, q/k/v rows interleaved wrongly) changes the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers  # pinned in the test extra (4.57.x keeps per-expert MoE modules)

from hf_configs import TINY_MODEL, hf_config_kwargs
from hf_reassemble import Dims, gpt_oss_state_dict_from_vllm_shards, hf_state_dict_from_vllm_shards
from megatron_reshard.tools.e2e import run_rank
from megatron_reshard.tools.run_config import RefitRunConfig

pytestmark = pytest.mark.slow

RTOL = ATOL = 1e-5
BATCH, SEQ = 2, 12
TOKEN_SEED = 7


@dataclass(frozen=True)
class Case:
    """One family and layout: the tiny Megatron model, the layouts, the HF class and config."""

    model: dict  # TinyGPTSpec fields (family included), see megatron_reshard.testing.megatron_models
    hf_class: str
    hf_config: dict  # family-specific HF config keys beyond the shared ones
    train: dict = field(default_factory=lambda: dict(train_world=4, train_tp=2, train_pp=2, train_ep=1))
    gen: dict = field(default_factory=lambda: dict(gen_world=2, gen_tp=2, gen_ep=1))


_BASE = TINY_MODEL
_MOE_TRAIN = dict(train_world=4, train_tp=2, train_pp=2, train_ep=2)

CASES = {
    # GQA 8/2; untied lm_head
    "llama": Case(dict(_BASE, family="llama"), "LlamaForCausalLM",
                  dict(attention_bias=False, mlp_bias=False)),
    # gen TP4 over 2 KV heads: vLLM replicates each KV head on 2 ranks, which split its q heads
    "llama-gen-tp4": Case(dict(_BASE, family="llama"), "LlamaForCausalLM",
                          dict(attention_bias=False, mlp_bias=False),
                          train=dict(train_world=2, train_tp=2, train_pp=1, train_ep=1),
                          gen=dict(gen_world=4, gen_tp=4, gen_ep=1)),
    # q/k/v biases; tied embeddings as in the small Qwen2 models
    "qwen2": Case(dict(_BASE, family="qwen2", add_qkv_bias=True, tie_embeddings=True),
                  "Qwen2ForCausalLM", {}),
    # q/k norms; head_dim 16 != hidden / heads
    "qwen3": Case(dict(_BASE, family="qwen3", qk_layernorm=True, head_dim=16),
                  "Qwen3ForCausalLM", dict(attention_bias=False)),
    # 8 experts top-2 over train EP2 and gen EP2 (whole experts per gen rank); layer 0 is a
    # dense MLP (HF mlp_only_layers)
    "qwen3_moe": Case(dict(_BASE, family="qwen3_moe", qk_layernorm=True, num_moe_experts=8,
                           moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 1]),
                      "Qwen3MoeForCausalLM", dict(attention_bias=False), train=_MOE_TRAIN,
                      gen=dict(gen_world=2, gen_tp=2, gen_ep=2)),
    # shared expert + its sigmoid gate, q/k/v biases; gen experts TP-sharded (EP1)
    "qwen2_moe": Case(dict(_BASE, family="qwen2_moe", add_qkv_bias=True, num_moe_experts=8,
                           moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
                           moe_shared_expert_gate=True),
                      "Qwen2MoeForCausalLM", dict(qkv_bias=True), train=_MOE_TRAIN),
    # MLA with q LoRA (vLLM fuses q_a/kv_a into fused_qkv_a_proj), sigmoid routing with the
    # score-correction bias and a scaling factor, one shared expert, first layer dense; gen
    # EP2 (whole experts per gen rank). See hf_configs.deepseek_hf_config for how both sides agree.
    "deepseek_v3": Case(dict(_BASE, family="deepseek_v3", num_moe_experts=8, moe_ffn_hidden_size=32,
                             moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1, 1],
                             multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32,
                             qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                             moe_router_topk_scaling_factor=2.5, layernorm_epsilon=1e-6),
                        "DeepseekV3ForCausalLM", {}, train=_MOE_TRAIN,
                        gen=dict(gen_world=2, gen_tp=2, gen_ep=2)),
    # train TP4 over 2 KV heads: each train rank holds half a KV group's q/k/v rows and
    # biases, sent shard to shard; shared expert and its gate too
    "qwen2_moe-train-tp4": Case(dict(_BASE, family="qwen2_moe", add_qkv_bias=True,
                                     num_moe_experts=8, moe_ffn_hidden_size=32,
                                     moe_shared_expert_intermediate_size=48,
                                     moe_shared_expert_gate=True),
                                "Qwen2MoeForCausalLM", dict(qkv_bias=True),
                                train=dict(train_world=4, train_tp=4, train_pp=1, train_ep=2)),
}
# ---- gpt-oss: sinks, biases on every linear and the router, gate/up interleaved in vLLM's
# w13 (gen experts TP-sharded: interleaved chunks, w2_bias only on TP rank 0), the clamped
# GLU, a 4-token sliding window on even layers (12 tokens reach past it); plain RoPE with
# Megatron's base on both sides (the refit moves weights only)
CASES["gpt_oss"] = Case(
    dict(_BASE, family="gpt_oss", head_dim=16, num_query_groups=4, num_moe_experts=8,
         moe_ffn_hidden_size=32, softmax_type="learnable", add_bias_linear=True, window_size=(3, 0),
         window_attn_skip_freq=2, gpt_oss_activation=True),
    "GptOssForCausalLM", dict(rope_scaling=None, rope_theta=10000.0, attn_implementation="eager"),
    train=_MOE_TRAIN)
# ---- end gpt-oss
# GLM-4.5: GQA with q/k/v biases and q/k norms, partial RoPE (half of head_dim 16), sigmoid
# routing with the score-correction bias and a scaling factor, one shared expert, first layer
# dense; gen EP2. See hf_configs.glm4_moe_hf_config for how both sides agree.
CASES["glm4_moe"] = Case(
    dict(_BASE, family="glm4_moe", num_moe_experts=8, moe_ffn_hidden_size=32,
         moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1, 1], add_qkv_bias=True,
         qk_layernorm=True, head_dim=16, rotary_percent=0.5, moe_router_score_function="sigmoid",
         moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5),
    "Glm4MoeForCausalLM", {}, train=_MOE_TRAIN, gen=dict(gen_world=2, gen_tp=2, gen_ep=2))
# without q LoRA (a plain q_proj, kv_a_proj_with_mqa unfused), gen TP4 over 8 heads with the
# experts TP-sharded (gen EP1), train TP2 with EP2; YaRN RoPE as DeepSeek-V3 configures it
# (mscale = mscale_all_dim = 1), factor 4 over 8 original positions so the 12 tokens reach
# past them
CASES["deepseek_v3-no-q-lora-yarn-gen-tp4"] = Case(
    dict(CASES["deepseek_v3"].model, q_lora_rank=None, rope_type="yarn", rotary_scaling_factor=4.0,
         mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=8),
    "DeepseekV3ForCausalLM", {},
    train=dict(train_world=2, train_tp=2, train_pp=1, train_ep=2),
    gen=dict(gen_world=4, gen_tp=4, gen_ep=1))


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(TOKEN_SEED)
    return torch.randint(0, _BASE["vocab_size"], (BATCH, SEQ), generator=g)


# ---------------------------------------------------------------- worker side


def _build_scaled(spec, device, dtype):
    """``build_gpt_model`` with its N(0, 1) values brought to a trained-model scale
    (norm weights 1 + 0.1·N, everything else 0.1·N): with unit-variance matrices attention
    is one-hot and activations grow layer by layer, which would hide small errors. One rule
    for every tensor keeps replicas (and the tied embedding copies of PP stages) equal."""
    from megatron_cpu_forward import cpu_build_shims
    from megatron_reshard.testing.megatron_models import build_gpt_model

    with cpu_build_shims():
        model = build_gpt_model(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.mul_(0.1).add_(1.0)
            else:
                p.mul_(0.1)
    return model.to(device=device, dtype=dtype)


def _after_refit(ctx: dict) -> Any:
    """Train ranks: Megatron's logits (kept on the last stage's TP rank 0). Gen ranks:
    the received vLLM-layout storage, as plain CPU tensors."""
    if ctx["role"] == "gen":
        return {n: p.detach().cpu().clone() for n, p in ctx["model"].named_parameters()}
    from megatron.core import parallel_state as ps
    from megatron_cpu_forward import megatron_logits

    logits = megatron_logits(ctx["model"], tokens(), ctx["source"].vocab_size)
    return logits if logits is not None and ps.get_tensor_model_parallel_rank() == 0 else None


def _oracle_job(job, cfg: RefitRunConfig):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg, model_builder=_build_scaled, after_refits=_after_refit)


# ---------------------------------------------------------------- test side


def _run_refit(pool, case: Case) -> tuple[torch.Tensor, list[dict]]:
    cfg = RefitRunConfig(model="dense", model_overrides=dict(case.model), refits=1, verify=False,
                         dtype="float32", quiet=True, timeout_s=120, **case.train, **case.gen)
    results = pool.run(_oracle_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=300)
    logits = [r["bench"] for r in results if r["role"] == "train" and r["bench"] is not None]
    assert len(logits) == 1, f"expected logits from one train rank, got {len(logits)}"
    shards = [r["bench"] for r in sorted((r for r in results if r["role"] == "gen"),
                                         key=lambda r: r["rank"])]
    return logits[0], shards


def _hf_model(case: Case) -> torch.nn.Module:
    cls = getattr(transformers, case.hf_class)
    config = cls.config_class(**hf_config_kwargs(case.model, case.hf_class, case.hf_config))
    return cls(config).float().eval()


def _dims(case: Case) -> Dims:
    m = case.model
    return Dims(num_heads=m["num_attention_heads"],
                num_kv_heads=m["num_query_groups"],
                head_dim=m["head_dim"] or m["hidden_size"] // m["num_attention_heads"],
                vocab_size=m["vocab_size"], num_experts=m["num_moe_experts"] or 0,
                q_lora_rank=m.get("q_lora_rank") or 0)


def hf_logits(case: Case, shards: list[dict]) -> torch.Tensor:
    """transformers' logits of ``tokens()`` with the weights reassembled from ``shards``."""
    reassemble = (gpt_oss_state_dict_from_vllm_shards if case.model.get("family") == "gpt_oss"
                  else hf_state_dict_from_vllm_shards)
    state = reassemble(shards, _dims(case), ep_size=case.gen["gen_ep"])
    if case.model["tie_embeddings"]:
        # vLLM holds no lm_head when tied; HF's module tree lists the tied tensor under both names
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = _hf_model(case)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(input_ids=tokens()).logits.float()


@pytest.fixture(scope="module")
def refitted(pool):
    """``case id -> (Megatron logits, gen shards)``, one pool job per case at most."""
    cache: dict[str, tuple[torch.Tensor, list[dict]]] = {}

    def get(case_id: str) -> tuple[torch.Tensor, list[dict]]:
        if case_id not in cache:
            cache[case_id] = _run_refit(pool, CASES[case_id])
        return cache[case_id]

    return get


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_transformers_logits_equal_megatron_logits_after_refit(refitted, case_id):
    case = CASES[case_id]
    megatron, shards = refitted(case_id)
    assert megatron.shape == (BATCH, SEQ, case.model["vocab_size"])
    ours = hf_logits(case, shards)
    torch.testing.assert_close(ours, megatron, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{case_id}: transformers vs Megatron logits: {m}")


def test_the_comparison_sees_a_swapped_gate_and_up(refitted):
    """The tolerance is not loose enough to hide a layout mistake: swapping one layer's
    dense gate/up halves in the received shards moves the logits far past it."""
    case = CASES["llama"]
    megatron, received = refitted("llama")
    name = "model.layers.1.mlp.gate_up_proj.weight"
    shards = []
    for s in received:
        gate, up = s[name].chunk(2, dim=0)
        shards.append({**s, name: torch.cat([up, gate])})
    ours = hf_logits(case, shards)
    assert not torch.allclose(ours, megatron, rtol=RTOL, atol=ATOL)


def test_the_comparison_sees_a_lost_score_correction_bias_and_swapped_mla_heads(refitted):
    """DeepSeek-V3: the router's score-correction bias decides the routing (zeroing it moves
    the logits), and kv_b_proj's rows are per head (swapping two heads of one gen rank
    moves them too)."""
    case = CASES["deepseek_v3"]
    megatron, received = refitted("deepseek_v3")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    no_bias = [{**s, bias: torch.zeros_like(s[bias])} for s in received]
    assert not torch.allclose(hf_logits(case, no_bias), megatron, rtol=RTOL, atol=ATOL)
    kv_b = "model.layers.2.self_attn.kv_b_proj.weight"
    heads = received[0][kv_b].unflatten(0, (-1, 32))  # 32 rows per head: nope 16 + v 16
    swapped = [{**received[0], kv_b: heads[[1, 0, *range(2, heads.shape[0])]].flatten(0, 1)},
               *received[1:]]
    assert not torch.allclose(hf_logits(case, swapped), megatron, rtol=RTOL, atol=ATOL)


# ---- gpt-oss
def test_the_comparison_sees_gpt_oss_gate_up_order_sinks_and_expert_bias(refitted):
    """gpt-oss: vLLM's w13 rows alternate gate and up (un-interleaving one expert on one gen
    rank moves the logits), the sinks count (zeroing one layer's) and so does an expert's
    down bias."""
    case = CASES["gpt_oss"]
    megatron, received = refitted("gpt_oss")
    w13 = next(n for n in received[0] if n.endswith("layers.1.mlp.experts.w13_weight"))
    rows = received[0][w13][0]
    halves = torch.cat([rows[0::2], rows[1::2]])  # [gate ; up] instead of interleaved
    w13_swapped = received[0][w13].clone()
    w13_swapped[0] = halves
    sinks = "model.layers.2.attn.sinks"
    w2_bias = next(n for n in received[0] if n.endswith("layers.3.mlp.experts.w2_bias"))
    for change in ({w13: w13_swapped}, {sinks: torch.zeros_like(received[0][sinks])},
                   {w2_bias: torch.zeros_like(received[0][w2_bias])}):
        shards = [{**received[0], **change}, *received[1:]]
        if sinks in change:  # every rank holds its own heads' sinks
            shards = [{**s, sinks: torch.zeros_like(s[sinks])} for s in received]
        assert not torch.allclose(hf_logits(case, shards), megatron, rtol=RTOL, atol=ATOL), list(change)
# ---- end gpt-oss
def test_the_comparison_sees_full_rotary_where_glm_rotates_half(refitted):
    """GLM-4.5: the same weights under full RoPE (HF ``partial_rotary_factor=1``) give other
    logits, so the partial rotary of Megatron's ``rotary_percent`` is what the case checks."""
    case = CASES["glm4_moe"]
    megatron, received = refitted("glm4_moe")
    full_rope = Case(dict(case.model, rotary_percent=1.0), case.hf_class, case.hf_config,
                     case.train, case.gen)
    assert not torch.allclose(hf_logits(full_rope, received), megatron, rtol=RTOL, atol=ATOL)
