"""What the source reads off the bare Megatron model: the model under its training wrappers,
its family, the tensors that travel, and the plain ``hf_config`` the payload carries.

No Megatron import (it reads attributes of the live model and its ``TransformerConfig``).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Optional

import torch

from megatron_reshard.megatron import mamba, mla, qwen3_next

HF_CONFIG_KEYS = (
    "family", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_hidden_layers",
    "vocab_size", "tie_word_embeddings", "gated", "qk_norm",
    "num_experts_per_tok", "shared_expert_intermediate_size", "moe_layers", "attention_bias",
    "rms_norm_eps", "torch_dtype",
    # MLA (DeepSeek-V3 family; absent for GQA models) and the router's score-correction bias
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "router_expert_bias",
    # Qwen3-Next (absent without Gated-DeltaNet layers / the attention output gate)
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "attn_output_gate", "layer_types",
    # Nemotron-H's Mamba-2 layers (absent without them)
    "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
)

HF_LAYER = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.")  # backbone: Nemotron-H


def unwrap_model(model: Any) -> tuple[Optional[torch.nn.Module], list[str]]:
    """The bare ``GPTModel`` under training wrappers (``module.`` chains); problems if none."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            return None, [f"got {len(model)} model chunks: virtual pipeline parallelism is not supported yet"]
        model = model[0]
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    if not hasattr(model, "decoder") or not hasattr(model, "config"):
        return None, [f"{type(model).__name__} is not a Megatron GPT-style model (no .decoder / .config)"]
    return model, []


def why_no_family(config: Any) -> str:
    """Why the config alone cannot name the family ('' when it can)."""
    if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
        # the same megatron-core layers, named per checkpoint: in_proj_qkvz / in_proj_ba
        # (Qwen3-Next) or the flat in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5)
        return ("a Gated-DeltaNet model (Qwen3-Next and Qwen3.5 checkpoints name its "
                "projections differently)")
    if getattr(config, "num_moe_experts", None) and \
            getattr(config, "moe_shared_expert_intermediate_size", None) and \
            not getattr(config, "multi_latent_attention", False):
        return "a MoE model with shared experts"
    return ""


def infer_family(config: Any) -> Optional[str]:
    """A family from the TransformerConfig alone, when unambiguous; None when not (see
    ``why_no_family``)."""
    if why_no_family(config):
        return None
    if getattr(config, "multi_latent_attention", False):
        return "deepseek_v3"  # MLA: the DeepSeek-V3 names (Kimi-K2 uses them too)
    if getattr(config, "num_moe_experts", None):
        return "qwen3_moe"
    if getattr(config, "qk_layernorm", False):
        return "qwen3"
    if getattr(config, "add_qkv_bias", False):
        return "qwen2"
    return "llama"


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters plus the persistent router ``expert_bias`` buffers (DeepSeek-V3 routing bias)."""
    out = list(model.named_parameters())
    out += [(n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    return out


def hf_config(model: torch.nn.Module, family: str, vocab_size: int, hf_names: Iterable[str]) -> dict:
    """The payload's ``hf_config`` (keys ``HF_CONFIG_KEYS``) of the bare ``model``, whose HF
    params are ``hf_names`` (MoE layers are the ones with a router, ``mlp.gate.weight``)."""
    c = model.config
    moe_layers = sorted({int(m.group(1)) for n in hf_names
                         if n.endswith(".mlp.gate.weight") and (m := HF_LAYER.match(n))})
    return {
        "family": family,
        "hidden_size": int(c.hidden_size),
        "num_attention_heads": int(c.num_attention_heads),
        "num_key_value_heads": int(c.num_query_groups or c.num_attention_heads),
        "head_dim": int(c.kv_channels),
        "intermediate_size": int(c.ffn_hidden_size),
        "moe_intermediate_size": int(c.moe_ffn_hidden_size or 0) if c.num_moe_experts else 0,
        "num_experts": int(c.num_moe_experts or 0),
        "num_hidden_layers": int(c.num_layers),
        "vocab_size": vocab_size,
        "tie_word_embeddings": bool(getattr(model, "share_embeddings_and_output_weights", False)),
        "gated": bool(c.gated_linear_unit),
        "qk_norm": bool(c.qk_layernorm),
        "num_experts_per_tok": int(c.moe_router_topk) if c.num_moe_experts else 0,
        "shared_expert_intermediate_size": int(c.moe_shared_expert_intermediate_size or 0),
        "moe_layers": moe_layers,
        "attention_bias": bool(c.add_qkv_bias),  # q/k/v biases (Qwen2); other linear biases are refused
        "rms_norm_eps": float(c.layernorm_epsilon),
        "torch_dtype": str(c.params_dtype),
        "router_expert_bias": bool(getattr(c, "moe_router_enable_expert_bias", False)),
        **mla.hf_config_keys(c),
        **qwen3_next.hf_config_keys(c),
        **(d.hf_config_keys() if (d := mamba.MambaDims.from_config(c)) is not None else {}),
    }
