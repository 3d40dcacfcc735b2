"""vLLM's per-rank layout of Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2). Torch-free.

Source: vLLM ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV2MLAAttention``,
``DeepSeekV2FusedQkvAProjLinear``, ``DeepseekV2MoE``; read at commit 002d6073). Per
generation TP rank r of T, with ``nh`` heads:

================================  ===============================================  ==========
HF name (``self_attn.`` prefix)   vLLM param                                       per rank
================================  ===============================================  ==========
``q_a_proj`` [q_lora, H]          ``fused_qkv_a_proj`` rows ``[0, q_lora)``        replicated
``kv_a_proj_with_mqa``            ``fused_qkv_a_proj`` rows ``[q_lora, q_lora +    replicated
[kv_lora + rope, H]               kv_lora + rope)`` (with q LoRA; ``disable_tp``)
                                  ``kv_a_proj_with_mqa`` itself (without q LoRA)
``q_a_layernorm``, ``kv_a_        the same names                                    replicated
layernorm``
``q_b_proj`` / ``q_proj``         the same name, ColumnParallelLinear              rows: heads
[nh·(nope + rope), q_lora / H]                                                      split by T
``kv_b_proj`` [nh·(nope + v),     the same name, ColumnParallelLinear              rows: heads
kv_lora]                                                                            split by T
``o_proj`` [H, nh·v]              the same name, RowParallelLinear                 columns
================================  ===============================================  ==========

Rows of ``q_b_proj`` / ``kv_b_proj`` are head-major (``[nope | rope]`` resp. ``[nope | v]``
per head), so an even row split is a split by heads. The MoE side: ``mlp.gate.weight``
replicated; ``mlp.gate.e_score_correction_bias`` [E] is a float32 parameter (whatever the
model dtype) where ``topk_method == "noaux_tc"``; ``mlp.shared_experts`` is a
``DeepseekV2MLP`` (``gate_up_proj`` / ``down_proj``, TP-sharded like a dense MLP unless
sequence-parallel MoE is on); routed experts are FusedMoE ``w13``/``w2``; layers below
``first_k_dense_replace`` have a dense ``mlp``. MTP layers (``model.layers.<n_layers + i>``
in checkpoints) are not part of vLLM's main model.
"""

from __future__ import annotations

from typing import Any, Optional

ATTN = ".self_attn."
FUSED_A = "fused_qkv_a_proj"
Q_A, KV_A = "q_a_proj", "kv_a_proj_with_mqa"

#: HF MLA projection (after ``self_attn.``) -> generation TP dim (None: replicated).
GEN_TP_DIM: dict[str, Optional[int]] = {
    "q_a_proj.weight": None,
    "kv_a_proj_with_mqa.weight": None,
    "q_a_layernorm.weight": None,
    "kv_a_layernorm.weight": None,
    "q_b_proj.weight": 0,
    "q_proj.weight": 0,
    "kv_b_proj.weight": 0,
    "o_proj.weight": 1,
}

#: MoE-side names DeepSeek-V3 adds (suffix -> generation TP dim).
MOE_GEN_TP_DIM: dict[str, Optional[int]] = {
    ".mlp.gate.e_score_correction_bias": None,
    ".mlp.shared_experts.gate_proj.weight": 0,
    ".mlp.shared_experts.up_proj.weight": 0,
    ".mlp.shared_experts.down_proj.weight": 1,
}

NOT_MLA = -1


# ``hf_config`` below: the payload's ``wire.HFConfig`` record, read by field (this package
# sits below ``wire`` and does not import it)


def is_mla_config(hf_config: Any) -> bool:
    return bool(hf_config.kv_lora_rank)


def mla_leaf(hf_name: str) -> Optional[str]:
    """``q_b_proj.weight`` for ``model.layers.3.self_attn.q_b_proj.weight``; None if not MLA."""
    head, sep, leaf = hf_name.rpartition(ATTN)
    return leaf if sep and leaf in GEN_TP_DIM else None


def gen_tp_dim(hf_name: str, mla: bool = True):
    """vLLM's TP dim of an MLA or DeepSeek MoE param (None: replicated), ``NOT_MLA`` otherwise.

    ``mla=False`` (a GQA model): the attention names are not MLA's (``q_proj`` is then part
    of ``qkv_proj``), only the MoE names are answered.
    """
    leaf = mla_leaf(hf_name) if mla else None
    if leaf is not None:
        return GEN_TP_DIM[leaf]
    for suffix, dim in MOE_GEN_TP_DIM.items():
        if hf_name.endswith(suffix):
            return dim
    return NOT_MLA


def heads_split_problem(hf_name: str, hf_config: Any, tp_size: int) -> Optional[str]:
    """Why vLLM cannot hold MLA param ``hf_name`` at TP ``tp_size`` (it splits whole heads:
    ``assert num_heads % tp_size == 0``), or None."""
    leaf = mla_leaf(hf_name) if is_mla_config(hf_config) else None
    if leaf is None or GEN_TP_DIM[leaf] is None:
        return None
    heads = int(hf_config.num_attention_heads or 0)
    if heads and heads % tp_size:
        return f"{heads} MLA heads do not split over tp_size={tp_size} (vLLM splits whole heads)"
    return None


def fused_a_rows(hf_name: str, hf_config: Any) -> Optional[tuple[str, int, int]]:
    """``(fused target name, first row, stop row)`` where vLLM fuses ``hf_name`` into
    ``fused_qkv_a_proj`` (models with q LoRA); None for any other name."""
    head, sep, leaf = hf_name.rpartition(ATTN)
    if not sep or leaf not in (f"{Q_A}.weight", f"{KV_A}.weight"):
        return None
    q_lora = int(hf_config.q_lora_rank or 0)
    if not q_lora:
        return None
    kv_rows = int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    target = f"{head}{ATTN}{FUSED_A}.weight"
    if leaf.startswith(Q_A):
        return target, 0, q_lora
    return target, q_lora, q_lora + kv_rows


def fused_a_shape(hf_config: Any) -> tuple[int, int]:
    """Shape of ``fused_qkv_a_proj.weight`` on every rank (replicated)."""
    return (int(hf_config.q_lora_rank) + int(hf_config.kv_lora_rank)
            + int(hf_config.qk_rope_head_dim), int(hf_config.hidden_size))
