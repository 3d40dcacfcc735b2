"""HF configs of the tiny Megatron models of the tests: one home for how both sides agree.

``hf_config_kwargs`` gives the ``transformers`` config keys of a tiny Megatron model spec
(``TinyGPTSpec`` fields) for an HF architecture; the transformers oracle builds its model
from them, the real-vLLM tests write them as the ``config.json`` vLLM reads.
"""

from __future__ import annotations

# the tiny Megatron model (TinyGPTSpec fields) every family of the tests starts from
TINY_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  ffn_hidden_size=128, vocab_size=500, qk_layernorm=False, add_qkv_bias=False,
                  num_moe_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2,
                  moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                  moe_layer_freq=1, tie_embeddings=False, head_dim=None)

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
               "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss",
               "Glm4MoeForCausalLM": "glm4_moe", "Qwen3NextForCausalLM": "qwen3_next",
               "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}


def deepseek_hf_config(m: dict) -> dict:
    """DeepSeek-V3 config keys matching the tiny Megatron MLA model.

    How the two sides are made to agree:
    - RoPE: Megatron's MLA (``rotary_interleaved=False``) reorders the rope dims to (even,
      odd) before a half rotation (``rope_utils._apply_rotary_pos_emb_bshd`` with
      ``multi_latent_attention``); HF's ``rope_interleave=True`` does the same reordering
      (``apply_rotary_pos_emb_interleave``). Plain RoPE: ``rope_type="rope"`` in Megatron,
      ``rope_scaling=None`` here, softmax scale ``1/sqrt(qk_nope + qk_rope)`` on both. YaRN:
      Megatron's ``rope_type="yarn"`` with ``rotary_scaling_factor``, ``mscale``,
      ``mscale_all_dim``, ``original_max_position_embeddings`` (beta_fast 32, beta_slow 1,
      its defaults) equals HF's ``rope_scaling={"type": "yarn", ...}`` with the same values:
      both scale cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the
      softmax by mscale(factor, mscale_all_dim)².
    - Norm eps: HF builds ``q_a_layernorm`` / ``kv_a_layernorm`` with its default 1e-6
      whatever ``rms_norm_eps`` says; Megatron uses ``layernorm_epsilon`` for every norm, so
      both are 1e-6.
    - Routing: Megatron's sigmoid scores + ``expert_bias`` for the choice, top-k scores
      renormalised (top-k > 1) and scaled equal HF's ``norm_topk_prob=True`` and
      ``routed_scaling_factor``; HF's group-limited choice is made a no-op (one group).
    """
    return dict(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                intermediate_size=m["ffn_hidden_size"], moe_intermediate_size=m["moe_ffn_hidden_size"],
                num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                num_key_value_heads=m["num_attention_heads"],
                n_shared_experts=m["moe_shared_expert_intermediate_size"] // m["moe_ffn_hidden_size"],
                n_routed_experts=m["num_moe_experts"], num_experts_per_tok=m["moe_router_topk"],
                routed_scaling_factor=m["moe_router_topk_scaling_factor"], n_group=1, topk_group=1,
                norm_topk_prob=True, first_k_dense_replace=m["moe_layer_freq"].index(1),
                q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"],
                qk_nope_head_dim=m["qk_head_dim"], qk_rope_head_dim=m["qk_pos_emb_head_dim"],
                v_head_dim=m["v_head_dim"], hidden_act="silu", rms_norm_eps=m["layernorm_epsilon"],
                rope_theta=10000.0, rope_interleave=True,
                rope_scaling=None if m.get("rope_type", "rope") == "rope" else dict(
                    type="yarn", factor=m["rotary_scaling_factor"], mscale=m["mscale"],
                    mscale_all_dim=m["mscale_all_dim"], beta_fast=32, beta_slow=1,
                    original_max_position_embeddings=m["original_max_position_embeddings"]),
                max_position_embeddings=64, tie_word_embeddings=m["tie_embeddings"],
                attention_bias=False, attention_dropout=0.0, attn_implementation="eager")


# ---- gpt-oss
def gpt_oss_hf_config(m: dict) -> dict:
    """gpt-oss config keys matching the tiny Megatron model: every layer MoE with biases,
    sinks, a sliding window of ``window_size[0] + 1`` tokens on the even layers (HF's
    ``layer_types``; Megatron ``window_attn_skip_freq=2``), YaRN RoPE as the checkpoint has
    it (the refit moves weights only; the rotary tables are vLLM's own)."""
    return dict(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                intermediate_size=m["moe_ffn_hidden_size"], num_hidden_layers=m["num_layers"],
                num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_query_groups"],
                head_dim=m["head_dim"] or m["hidden_size"] // m["num_attention_heads"],
                num_local_experts=m["num_moe_experts"], num_experts_per_tok=m["moe_router_topk"],
                sliding_window=m["window_size"][0] + 1, rms_norm_eps=1e-5, swiglu_limit=7.0,
                max_position_embeddings=64, tie_word_embeddings=m["tie_embeddings"],
                attention_bias=True, attention_dropout=0.0,
                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False, original_max_position_embeddings=4096))
# ---- end gpt-oss
def glm4_moe_hf_config(m: dict) -> dict:
    """GLM-4.5 (``Glm4MoeConfig``) keys matching the tiny Megatron model.

    How the two sides are made to agree:
    - Partial RoPE: Megatron's ``rotary_percent`` rotates the first fraction of each head's
      dims with a half rotation (``rotary_interleaved=False``); HF's
      ``partial_rotary_factor`` the same fraction with ``rotate_half``.
    - Routing as for DeepSeek-V3 (``deepseek_hf_config``): sigmoid scores, the bias for the
      choice only, top-k renormalised and scaled (``norm_topk_prob``, ``routed_scaling_factor``),
      one group. Shared experts: ``n_shared_experts`` of ``moe_intermediate_size`` each.
    - q/k/v biases (``attention_bias``) and no other linear bias, as Megatron's
      ``add_qkv_bias`` without ``add_bias_linear``.
    """
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    return dict(vocab_size=m["vocab_size"], hidden_size=hidden, intermediate_size=m["ffn_hidden_size"],
                moe_intermediate_size=m["moe_ffn_hidden_size"], num_hidden_layers=m["num_layers"],
                num_attention_heads=heads, num_key_value_heads=m["num_query_groups"],
                head_dim=m["head_dim"] or hidden // heads,
                partial_rotary_factor=m.get("rotary_percent", 1.0),
                n_shared_experts=m["moe_shared_expert_intermediate_size"] // m["moe_ffn_hidden_size"],
                n_routed_experts=m["num_moe_experts"], num_experts_per_tok=m["moe_router_topk"],
                routed_scaling_factor=m.get("moe_router_topk_scaling_factor") or 1.0, n_group=1,
                topk_group=1, norm_topk_prob=True, first_k_dense_replace=m["moe_layer_freq"].index(1),
                use_qk_norm=m["qk_layernorm"], attention_bias=m["add_qkv_bias"], hidden_act="silu",
                rms_norm_eps=m.get("layernorm_epsilon", 1e-5), rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=m["tie_embeddings"],
                attention_dropout=0.0, num_nextn_predict_layers=0, attn_implementation="eager")


def hf_config_kwargs(m: dict, hf_class: str, extra: dict) -> dict:
    """The HF config keys of the tiny Megatron model ``m`` for ``hf_class``, with the
    family-specific ``extra`` keys on top."""
    if hf_class == "DeepseekV3ForCausalLM":
        return {**deepseek_hf_config(m), **extra}
    if hf_class == "GptOssForCausalLM":
        return {**gpt_oss_hf_config(m), **extra}
    if hf_class == "Glm4MoeForCausalLM":
        return {**glm4_moe_hf_config(m), **extra}
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    kwargs = dict(vocab_size=m["vocab_size"], hidden_size=hidden, intermediate_size=m["ffn_hidden_size"],
                  num_hidden_layers=m["num_layers"], num_attention_heads=heads,
                  num_key_value_heads=m["num_query_groups"], head_dim=m["head_dim"] or hidden // heads,
                  hidden_act="silu", rms_norm_eps=1e-5,  # Megatron's layernorm_epsilon default
                  rope_theta=10000.0,  # Megatron's rotary_base default
                  max_position_embeddings=64, tie_word_embeddings=m["tie_embeddings"],
                  attention_dropout=0.0, attn_implementation="eager")
    if m["num_moe_experts"]:
        # Megatron's default router (softmax over the top-k logits) equals HF's softmax,
        # top-k, then renormalise: norm_topk_prob=True
        kwargs.update(num_experts=m["num_moe_experts"], num_experts_per_tok=m["moe_router_topk"],
                      moe_intermediate_size=m["moe_ffn_hidden_size"], norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
        if isinstance(m["moe_layer_freq"], list):
            kwargs["mlp_only_layers"] = [i for i, moe in enumerate(m["moe_layer_freq"]) if not moe]
        if m["moe_shared_expert_intermediate_size"]:
            kwargs["shared_expert_intermediate_size"] = m["moe_shared_expert_intermediate_size"]
    kwargs.update(extra)
    return kwargs
