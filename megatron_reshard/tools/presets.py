"""Model shapes as data: full-size presets (from the models' published HF ``config.json``)
and the demo's small models, and the HF parameter list each one implies.

Only the keys that decide parameter shapes are kept, under their HF names. Two attention
kinds: GQA (Qwen3: ``num_key_value_heads``, ``head_dim``, ``qk_norm``) and MLA
(DeepSeek-V3 / Kimi-K2: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``). MoE: ``n_routed_experts`` (or Qwen's
``num_experts``), ``moe_intermediate_size``, ``first_k_dense_replace`` dense layers first,
``n_shared_experts`` shared experts of ``n_shared_experts * moe_intermediate_size``, and
``e_score_correction_bias`` (fp32) where routing is ``noaux_tc`` (always for GLM-4.5,
``model_type="glm4_moe"``, which also has q/k/v biases: ``attention_bias``). DeepSeek's multi-token
prediction layer is left out: the refit skips ``mtp.`` params.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple

FULL_SIZE: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(  # Qwen/Qwen3-8B
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, qk_norm=True, intermediate_size=12288, vocab_size=151936,
        tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(  # Qwen/Qwen3-30B-A3B
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, qk_norm=True, intermediate_size=6144, num_experts=128,
        moe_intermediate_size=768, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(  # Qwen/Qwen3-235B-A22B
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, qk_norm=True, intermediate_size=12288, num_experts=128,
        moe_intermediate_size=1536, vocab_size=151936, tie_word_embeddings=False),
    "deepseek-v3": dict(  # deepseek-ai/DeepSeek-V3 (671B; MTP layer not counted)
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, first_k_dense_replace=3, n_routed_experts=256,
        n_shared_experts=1, moe_intermediate_size=2048, topk_method="noaux_tc",
        vocab_size=129280, tie_word_embeddings=False),
    "kimi-k2": dict(  # moonshotai/Kimi-K2-Instruct (1T)
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, first_k_dense_replace=1, n_routed_experts=384,
        n_shared_experts=1, moe_intermediate_size=2048, topk_method="noaux_tc",
        vocab_size=163840, tie_word_embeddings=False),
    # GLM-4.5 family (model_type glm4_moe; MTP layer not counted: vLLM loads it as a draft
    # model). GQA with q/k/v biases, DeepSeek-V3's MoE names, the score-correction bias.
    "glm-4.5-air": dict(  # zai-org/GLM-4.5-Air (106B)
        model_type="glm4_moe", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, attention_bias=True, qk_norm=False,
        intermediate_size=10944, first_k_dense_replace=1, n_routed_experts=128,
        n_shared_experts=1, moe_intermediate_size=1408, vocab_size=151552,
        tie_word_embeddings=False),
    "glm-4.5": dict(  # zai-org/GLM-4.5 (355B)
        model_type="glm4_moe", hidden_size=5120, num_hidden_layers=92, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, attention_bias=True, qk_norm=True,
        intermediate_size=12288, first_k_dense_replace=3, n_routed_experts=160,
        n_shared_experts=1, moe_intermediate_size=1536, vocab_size=151552,
        tie_word_embeddings=False),
    # Qwen3-Next (model_type qwen3_next; MTP layer not counted: vLLM loads it as a draft
    # model): Gated-DeltaNet in three of four layers, gated full attention in the fourth,
    # 512 experts + a gated shared expert on every layer
    "qwen3-next-80b-a3b": dict(  # Qwen/Qwen3-Next-80B-A3B-Instruct
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, qk_norm=True, intermediate_size=5120,
        num_experts=512, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=151936, tie_word_embeddings=False),
    # gpt-oss (model_type gpt_oss; BF16 weights: the MXFP4 checkpoint dequantized): biases on
    # q/k/v/o and the router, per-head sinks, experts with fused, interleaved gate_up_proj
    "gpt-oss-20b": dict(  # openai/gpt-oss-20b
        model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, attention_bias=True, intermediate_size=2880,
        num_experts=32, moe_intermediate_size=2880, vocab_size=201088, tie_word_embeddings=False),
    "gpt-oss-120b": dict(  # openai/gpt-oss-120b
        model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, attention_bias=True, intermediate_size=2880,
        num_experts=128, moe_intermediate_size=2880, vocab_size=201088, tie_word_embeddings=False),
    # ---- Qwen3.5 (model_type qwen3_5_moe: its text_config, read as qwen3_5_moe_text; MTP layer
    # not counted). Sizes: Qwen/Qwen3.5-35B-A3B's published config.json text_config, as
    # THUDM/slime's scripts/models/qwen3.5-35B-A3B.sh restates them for Megatron: 40 layers,
    # Gated-DeltaNet in three of four, gated full attention in the fourth, 256 experts + a
    # gated shared expert on every layer
    "qwen3.5-35b-a3b": dict(  # Qwen/Qwen3.5-35B-A3B
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, qk_norm=True,
        num_experts=256, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=248320, tie_word_embeddings=False),
    # ---- end Qwen3.5
}


class HFParam(NamedTuple):
    name: str
    shape: tuple
    dtype: str  # "torch.bfloat16" form, as in the refit payload


def demo_config(model: str) -> dict[str, Any]:
    """HF-style config of one of the demo's small models (``megatron_reshard.tools.run_config``)."""
    from megatron_reshard.tools.run_config import MODEL_PRESETS

    p = MODEL_PRESETS[model]
    cfg = dict(hidden_size=p["hidden_size"], num_attention_heads=p["num_attention_heads"],
               num_key_value_heads=p["num_query_groups"],
               head_dim=p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"],
               intermediate_size=p["ffn_hidden_size"], num_hidden_layers=p["num_layers"],
               vocab_size=p["vocab_size"], qk_norm=bool(p.get("qk_layernorm")),
               tie_word_embeddings=False)
    if p.get("num_moe_experts"):
        cfg.update(num_experts=p["num_moe_experts"], moe_intermediate_size=p["moe_ffn_hidden_size"])
    if p.get("multi_latent_attention"):  # the deepseek preset, under HF DeepSeek-V3 names
        freq = p.get("moe_layer_freq", 1)
        cfg.update(q_lora_rank=p.get("q_lora_rank"), kv_lora_rank=p["kv_lora_rank"],
                   qk_nope_head_dim=p["qk_head_dim"], qk_rope_head_dim=p["qk_pos_emb_head_dim"],
                   v_head_dim=p["v_head_dim"],
                   first_k_dense_replace=freq.index(1) if isinstance(freq, list) else 0,
                   n_shared_experts=(p.get("moe_shared_expert_intermediate_size") or 0)
                   // p["moe_ffn_hidden_size"],
                   topk_method="noaux_tc" if p.get("moe_router_enable_expert_bias") else None)
    if p.get("family") == "glm4_moe":  # the glm preset, under HF GLM-4.5 names
        freq = p["moe_layer_freq"]
        cfg.update(model_type="glm4_moe", n_routed_experts=cfg.pop("num_experts"),
                   first_k_dense_replace=freq.index(1), attention_bias=bool(p.get("add_qkv_bias")),
                   n_shared_experts=p["moe_shared_expert_intermediate_size"] // p["moe_ffn_hidden_size"])
    if p.get("family") == "qwen3_next":  # the qwen3-next preset, under HF Qwen3-Next names
        cfg.update(model_type="qwen3_next", full_attention_interval=p["linear_attention_freq"],
                   shared_expert_intermediate_size=p["moe_shared_expert_intermediate_size"],
                   linear_conv_kernel_dim=p.get("linear_conv_kernel_dim", 4),
                   **{k: p[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                        "linear_key_head_dim", "linear_value_head_dim")})
    if p.get("family") == "gpt_oss":  # the gpt-oss preset, under HF gpt-oss names
        cfg.update(model_type="gpt_oss", attention_bias=True)
    return cfg


def model_names() -> list[str]:
    from megatron_reshard.tools.run_config import MODEL_PRESETS

    return sorted(MODEL_PRESETS) + list(FULL_SIZE) + list(LLAMA_FULL_SIZE)


def model_config(model: str, layers: int | None = None) -> dict[str, Any]:
    """The config of a preset by name, optionally with another layer count."""
    full = {**FULL_SIZE, **LLAMA_FULL_SIZE}
    cfg = dict(full[model]) if model in full else demo_config(model)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


# The plan command's parallel sizes when no size option is given, for the demo's small
# models and for a config read from a file: the demo's (train 4 ranks TP2 PP2 EP2 -> gen 2
# ranks TP2 EP1), EP1 without experts. The full-size presets take PUBLISHED_LAYOUTS.
DEMO_PLAN_PARALLELISM: dict[str, int] = dict(train_world=4, train_tp=2, train_cp=1, train_pp=2,
                                             train_ep=2, gen_world=2, gen_tp=2, gen_ep=1)


def default_plan_parallelism(cfg: Mapping[str, Any], model: str = "") -> dict[str, int]:
    """The model's default layout: its entry in PUBLISHED_LAYOUTS, else the demo's sizes
    (EP1 without experts: there is nothing to split). A layer count PP does not divide is
    split the way Megatron splits it (``plan_layout.megatron_pp_split``)."""
    if model in PUBLISHED_LAYOUTS:
        return dict(PUBLISHED_LAYOUTS[model])
    out = dict(DEMO_PLAN_PARALLELISM)
    if not num_experts(cfg):
        out["train_ep"] = 1
    return out


def describe_plan_parallelism(sizes: Mapping[str, int]) -> str:
    """One line of default parallel sizes, in the options' terms (for --help)."""
    cp = f" CP{sizes['train_cp']}" if sizes.get("train_cp", 1) != 1 else ""
    return (f"train {sizes['train_world']} ranks TP{sizes['train_tp']}{cp} "
            f"PP{sizes['train_pp']} EP{sizes['train_ep']} -> gen {sizes['gen_world']} "
            f"ranks TP{sizes['gen_tp']} EP{sizes['gen_ep']}")


def num_experts(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)


def is_mla(cfg: Mapping[str, Any]) -> bool:
    return "kv_lora_rank" in cfg


def attention_heads(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(query heads, KV heads); MLA's up-projections have one KV head per query head."""
    nh = int(cfg["num_attention_heads"])
    return nh, nh if is_mla(cfg) else int(cfg.get("num_key_value_heads") or nh)


# HF model_types with Gated-DeltaNet layers and gated full attention (Qwen3.5: flat in_proj)
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
GATED_DELTA_NET_TYPES = ("qwen3_next", *QWEN3_5_TYPES)


def is_moe_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    return bool(num_experts(cfg)) and layer >= int(cfg.get("first_k_dense_replace") or 0)


def hf_params(cfg: Mapping[str, Any]) -> list[HFParam]:
    """Every HF parameter of the model in checkpoint order (per-expert names for MoE)."""
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    nh, nkv = attention_heads(cfg)
    out = [HFParam("model.embed_tokens.weight", (V, H), bf16)]
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}"

        def add(suffix: str, shape: tuple, dtype: str = bf16) -> None:
            out.append(HFParam(f"{p}.{suffix}", shape, dtype))

        add("input_layernorm.weight", (H,))
        if is_linear_attention_layer(cfg, i):
            for suffix, shape, dtype in gated_delta_net_params(cfg):
                add(suffix, shape, dtype)
        elif is_mla(cfg):
            ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            if ql:
                add("self_attn.q_a_proj.weight", (ql, H))
                add("self_attn.q_a_layernorm.weight", (ql,))
                add("self_attn.q_b_proj.weight", (nh * (nope + rope), ql))
            else:
                add("self_attn.q_proj.weight", (nh * (nope + rope), H))
            add("self_attn.kv_a_proj_with_mqa.weight", (kvl + rope, H))
            add("self_attn.kv_a_layernorm.weight", (kvl,))
            add("self_attn.kv_b_proj.weight", (nh * (nope + vd), kvl))
            add("self_attn.o_proj.weight", (H, nh * vd))
        else:
            hd = int(cfg.get("head_dim") or H // nh)
            gate = 2 if cfg.get("model_type") in GATED_DELTA_NET_TYPES else 1  # q_proj: [q_h; gate_h] per head
            for proj, rows in (("q", gate * nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                add(f"self_attn.{proj}_proj.weight", (rows, H))
                if cfg.get("attention_bias"):
                    add(f"self_attn.{proj}_proj.bias", (rows,))
            add("self_attn.o_proj.weight", (H, nh * hd))
            if cfg.get("model_type") == "gpt_oss":  # o_proj's bias, one sink per head
                add("self_attn.o_proj.bias", (H,))
                add("self_attn.sinks", (nh,))
            if cfg.get("qk_norm"):
                add("self_attn.q_norm.weight", (hd,))
                add("self_attn.k_norm.weight", (hd,))
        add("post_attention_layernorm.weight", (H,))
        if is_moe_layer(cfg, i):
            E, inter = num_experts(cfg), int(cfg["moe_intermediate_size"])
            if cfg.get("model_type") == "gpt_oss":  # its router is mlp.router, with a bias
                add("mlp.router.weight", (E, H))
                add("mlp.router.bias", (E,))
                for e in range(E):
                    add(f"mlp.experts.{e}.gate_up_proj", (H, 2 * inter))
                    add(f"mlp.experts.{e}.gate_up_proj_bias", (2 * inter,))
                    add(f"mlp.experts.{e}.down_proj", (inter, H))
                    add(f"mlp.experts.{e}.down_proj_bias", (H,))
                continue
            add("mlp.gate.weight", (E, H))
            if cfg.get("topk_method") == "noaux_tc" or cfg.get("model_type") == "glm4_moe":
                add("mlp.gate.e_score_correction_bias", (E,), fp32)
            for e in range(E):
                add(f"mlp.experts.{e}.gate_proj.weight", (inter, H))
                add(f"mlp.experts.{e}.up_proj.weight", (inter, H))
                add(f"mlp.experts.{e}.down_proj.weight", (H, inter))
            shared = int(cfg.get("n_shared_experts") or 0) * inter
            if cfg.get("model_type") in GATED_DELTA_NET_TYPES:  # Qwen2-MoE's names, a gated shared expert
                qs = int(cfg["shared_expert_intermediate_size"])
                add("mlp.shared_expert.gate_proj.weight", (qs, H))
                add("mlp.shared_expert.up_proj.weight", (qs, H))
                add("mlp.shared_expert.down_proj.weight", (H, qs))
                add("mlp.shared_expert_gate.weight", (1, H))
            elif shared:
                add("mlp.shared_experts.gate_proj.weight", (shared, H))
                add("mlp.shared_experts.up_proj.weight", (shared, H))
                add("mlp.shared_experts.down_proj.weight", (H, shared))
        else:
            F = int(cfg["intermediate_size"])
            add("mlp.gate_proj.weight", (F, H))
            add("mlp.up_proj.weight", (F, H))
            add("mlp.down_proj.weight", (H, F))
    out.append(HFParam("model.norm.weight", (H,), bf16))
    if not cfg.get("tie_word_embeddings"):
        out.append(HFParam("lm_head.weight", (V, H), bf16))
    return out


def is_linear_attention_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    """Qwen3-Next: every ``full_attention_interval``-th layer is full attention, the others
    Gated-DeltaNet (HF's ``layer_types`` default)."""
    if cfg.get("model_type") not in GATED_DELTA_NET_TYPES:
        return False
    if cfg.get("layer_types"):  # spelled out (Qwen3.5's config.json)
        return cfg["layer_types"][layer] == "linear_attention"
    every = int(cfg.get("full_attention_interval") or 0)
    return bool(every) and (layer + 1) % every != 0


def gated_delta_net_params(cfg: Mapping[str, Any]) -> list[tuple[str, tuple, str]]:
    """(suffix, shape, dtype) of one Gated-DeltaNet layer's params, as the checkpoint has them."""
    H = int(cfg["hidden_size"])
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    kd, vd = nk * int(cfg["linear_key_head_dim"]), nv * int(cfg["linear_value_head_dim"])
    la, bf16 = "linear_attn", "torch.bfloat16"
    if cfg.get("model_type") in QWEN3_5_TYPES:  # the in_proj streams flat and named apart
        in_proj = [(f"{la}.in_proj_qkv.weight", (2 * kd + vd, H), bf16), (f"{la}.in_proj_z.weight", (vd, H), bf16),
                   (f"{la}.in_proj_b.weight", (nv, H), bf16), (f"{la}.in_proj_a.weight", (nv, H), bf16)]
    else:
        in_proj = [(f"{la}.in_proj_qkvz.weight", (2 * kd + 2 * vd, H), bf16),
                   (f"{la}.in_proj_ba.weight", (2 * nv, H), bf16)]
    return [*in_proj,
            (f"{la}.conv1d.weight", (2 * kd + vd, 1, int(cfg["linear_conv_kernel_dim"])), bf16),
            (f"{la}.A_log", (nv,), bf16), (f"{la}.dt_bias", (nv,), bf16),
            (f"{la}.norm.weight", (int(cfg["linear_value_head_dim"]),), bf16),
            (f"{la}.out_proj.weight", (H, vd), bf16)]


# HF model_types (the same names as the library's families) with params that travel packed
# whatever the layout (travels_packed): their exact-path share is below 100% by design
PACKED_BY_DESIGN_TYPES = GATED_DELTA_NET_TYPES

# Gated-DeltaNet params that are no view of Megatron's (``megatron.qwen3_next``): Qwen3-Next's
# per-key-head in_proj, both families' gated norm (x·w in the checkpoint)
_GDN_PACKED = re.compile(r"\.linear_attn\.(?:in_proj_qkvz|in_proj_ba|norm)\.weight$")


def travels_packed(cfg: Mapping[str, Any], name: str, train_tp: int = 1) -> bool:
    """Params the refit sends as full tensors (the packed path) at training TP ``train_tp``:
    of Qwen3-Next / Qwen3.5, the Gated-DeltaNet params that are no view of Megatron's, and
    the gated q/k/v where a training rank cuts a KV group (``megatron.qwen3_next``; Qwen3.5's
    in_proj streams, A_log, dt_bias, out_proj and the gated q/k/v of whole KV groups travel
    shard to shard). gpt-oss's experts travel shard to shard in vLLM's wire form
    (``megatron.gpt_oss``)."""
    if cfg.get("model_type") in GATED_DELTA_NET_TYPES:
        cut = train_tp > attention_heads(cfg)[1]
        return (_GDN_PACKED.search(name) is not None
                or (cut and re.search(r"\.self_attn\.[qkv]_proj\.", name) is not None))
    return False


# ---- Llama presets, published default layouts, configs read from files (plan) ----------

LLAMA_FULL_SIZE: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.1-70b": dict(  # meta-llama/Llama-3.1-70B
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.1-405b": dict(  # meta-llama/Llama-3.1-405B
        hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, head_dim=128, intermediate_size=53248, vocab_size=128256,
        tie_word_embeddings=False),
}


def _layout(train_world: int, train_tp: int, train_pp: int, train_ep: int, gen_world: int,
            gen_tp: int, gen_ep: int, train_cp: int = 1) -> dict[str, int]:
    return dict(train_world=train_world, train_tp=train_tp, train_cp=train_cp, train_pp=train_pp,
                train_ep=train_ep, gen_world=gen_world, gen_tp=gen_tp, gen_ep=gen_ep)


# Each full-size preset's default layout: the layout its RL users run (training on Megatron,
# generation on vLLM, both sides on the same number of GPUs as a colocated job has them).
# DeepSeek-V3 as NeMo-RL runs it on 32 nodes of 8 GPUs (Megatron TP1 PP16 EP16, vLLM TP32 with
# expert parallelism, 8 replicas); Kimi-K2 the same shape. The others: the smallest layout
# the model fits on 80 GB GPUs in bf16 for training (TP inside a node, PP across nodes)
# and for vLLM (one replica per TP group). PP that does not divide the layers (61, 94, 126)
# is split as Megatron splits it.
PUBLISHED_LAYOUTS: dict[str, dict[str, int]] = {
    "qwen3-8b": _layout(8, 2, 1, 1, 8, 1, 1),
    "qwen3-30b-a3b": _layout(16, 2, 1, 8, 16, 4, 4),
    "qwen3-235b-a22b": _layout(128, 4, 8, 16, 128, 8, 8),
    "deepseek-v3": _layout(256, 1, 16, 16, 256, 32, 32),
    "kimi-k2": _layout(256, 1, 16, 16, 256, 32, 32),
    "llama-3.1-8b": _layout(8, 2, 1, 1, 8, 1, 1),
    "llama-3.1-70b": _layout(32, 8, 2, 1, 32, 4, 1),
    "llama-3.1-405b": _layout(128, 8, 8, 1, 128, 16, 1),
    # vLLM's own recipes serve Qwen3-Next-80B with TP4 and gpt-oss-120b (BF16) on 4 GPUs,
    # gpt-oss-20b on one; training by the rule above (Megatron EP over the experts)
    "qwen3-next-80b-a3b": _layout(32, 2, 2, 8, 32, 4, 4),
    "gpt-oss-20b": _layout(8, 1, 1, 8, 8, 1, 1),
    "gpt-oss-120b": _layout(32, 2, 2, 8, 32, 4, 4),
    # GLM-4.5 as slime (the RL framework GLM-4.5 was post-trained with) runs it in its
    # 64xH100 example (THUDM/slime, docs/en/examples/glm4.5-355B-A32B.md): Megatron TP8
    # PP4 CP2 EP16; rollout engines of 32 GPUs (SGLang there; here vLLM TP32 with expert
    # parallelism, as for DeepSeek-V3), 2 replicas
    "glm-4.5": _layout(64, 8, 4, 16, 64, 32, 32, train_cp=2),
    # GLM-4.5-Air: training as Megatron Bridge's parallelism guide (the Megatron backend of
    # NeMo-RL; NVIDIA/skills nemo-mbridge-perf-parallelism-strategies) sizes it, TP1 PP4
    # EP8 (46 layers: split as Megatron splits them); generation as zai-org's GLM-4.5
    # README serves the BF16 Air model, vLLM on 4 H100s (TP4), 8 replicas
    "glm-4.5-air": _layout(32, 1, 4, 8, 32, 4, 1),
    # Qwen3.5-35B-A3B: Qwen3-30B-A3B's layout (the same size class)
    "qwen3.5-35b-a3b": _layout(16, 2, 1, 8, 16, 4, 4),
}

# The HF config.json keys that decide parameter shapes (the rest of a config is ignored)
HF_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                 "tie_word_embeddings", "qk_norm", "num_experts", "n_routed_experts",
                 "moe_intermediate_size", "first_k_dense_replace", "n_shared_experts",
                 "topk_method", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim")
HF_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size")
# Gated-DeltaNet models (their model_type, kept): the linear-attention keys; multimodal
# Qwen3.5 configs are read as their text model
GATED_DELTA_NET_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
                        "layer_types", "shared_expert_intermediate_size")
_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # Qwen3 configs imply q/k norms, no key says so


def config_from_hf_json(text: str, source: str) -> tuple[dict[str, Any], list[str]]:
    """(shape config, problems) of an HF ``config.json``'s text; ``source`` names it in
    messages. A multimodal config's ``text_config`` is read when the top level has none."""
    import json

    try:
        raw = json.loads(text)
    except ValueError as err:
        return {}, [f"{source}: not JSON ({err})"]
    if not isinstance(raw, dict):
        return {}, [f"{source}: expected a JSON object"]
    if "hidden_size" not in raw and isinstance(raw.get("text_config"), dict):
        raw = {**raw["text_config"], "model_type": raw.get("model_type")}
    model_type = _TEXT_MODEL_TYPES.get(raw.get("model_type"), raw.get("model_type"))
    all_moe = model_type == "qwen3_5_moe_text"  # no dense MLP: no intermediate_size
    missing = [k for k in HF_REQUIRED_KEYS if not isinstance(raw.get(k), int)
               and not (all_moe and k == "intermediate_size")]
    if missing:
        return {}, [f"{source}: expected integer keys {', '.join(missing)} (HF config.json names)"]
    cfg = {k: raw[k] for k in HF_SHAPE_KEYS if raw.get(k) is not None}
    cfg.setdefault("tie_word_embeddings", False)
    if model_type in GATED_DELTA_NET_TYPES:
        cfg.update(model_type=model_type, **{k: raw[k] for k in GATED_DELTA_NET_KEYS if raw.get(k) is not None})
        cfg.setdefault("qk_norm", True)  # Qwen3-Next / Qwen3.5: q/k norms, no key says so
    if "qk_norm" not in cfg and raw.get("model_type") in _QK_NORM_MODEL_TYPES:
        cfg["qk_norm"] = True
    if num_experts(cfg) and "moe_intermediate_size" not in cfg:
        return {}, [f"{source}: a model with experts needs moe_intermediate_size"]
    return cfg, []
