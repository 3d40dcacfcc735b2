"""What the train side needs to know about MLA (DeepSeek-V3 family) models in Megatron-Core.

Small functions over a live model / ``TransformerConfig``: whether the MLA down projections
are TP-sharded, the HF config keys of MLA, the (train, gen) TP dims of each MLA param for
the exact path, and the features the refit refuses. vLLM's side of the facts lives in
``vllm_layout.mla``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_reshard.vllm_layout import mla as vllm_mla

_DOWN_PROJECTIONS = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")


def is_mla(config: Any) -> bool:
    return bool(getattr(config, "multi_latent_attention", False))


def down_projections_replicated(model: torch.nn.Module) -> bool:
    """MLA down projections duplicated over TP (TE spec ``TELinear``) rather than
    column-parallel (local spec ``ColumnParallelLinear``): Megatron's own parameter
    attribute ``tensor_model_parallel`` says which."""
    for name, param in model.named_parameters():
        if name.endswith("linear_kv_down_proj.weight"):
            return not getattr(param, "tensor_model_parallel", False)
    return False


def exact_path_tp_dims(hf_name: str, mla: bool, down_replicated: bool
                       ) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(train TP dim, gen TP dim) of an MLA projection or a DeepSeek MoE extra (router
    score-correction bias, ``shared_experts``) on the exact path; None for any other name.
    A None dim is replicated. Train dims follow the converter kinds (down projections
    column-parallel in the local spec, duplicated in the TE spec); gen dims are vLLM's."""
    dst = vllm_mla.gen_tp_dim(hf_name, mla=mla)
    if dst == vllm_mla.NOT_MLA:
        return None
    if mla and vllm_mla.mla_leaf(hf_name) in _DOWN_PROJECTIONS:
        return (None if down_replicated else 0), dst
    return dst, dst  # the same TP dim on both sides: heads, the shared FFN, replicas


def hf_config_keys(config: Any) -> dict:
    """HF DeepSeek-V3 attention sizes of an MLA config ({} for GQA models)."""
    if not is_mla(config):
        return {}
    c = config
    return {"q_lora_rank": int(c.q_lora_rank) if c.q_lora_rank else None,
            "kv_lora_rank": int(c.kv_lora_rank), "qk_nope_head_dim": int(c.qk_head_dim),
            "qk_rope_head_dim": int(c.qk_pos_emb_head_dim), "v_head_dim": int(c.v_head_dim)}


def unsupported_features(config: Any) -> list[str]:
    """Model features the refit refuses, one line each (checked before any collective)."""
    out = []
    mtp = int(getattr(config, "mtp_num_layers", None) or 0)
    if mtp:
        out.append(f"multi-token prediction (mtp_num_layers={mtp}) is not supported: vLLM loads "
                   "MTP layers as a separate draft model; build the model without MTP layers "
                   "(or drop them) for the refit")
    if is_mla(config) and not getattr(config, "qk_layernorm", False):
        out.append("MLA without q/kv layernorms (qk_layernorm=False) is not supported: "
                   "DeepSeek-V3's q_a_layernorm and kv_a_layernorm (and vLLM's) would receive "
                   "nothing; build the model with qk_layernorm=True")
    return out
