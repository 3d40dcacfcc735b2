"""Model families and Megatron-Core layers the refit refuses, with what blocks each.

Checked before any collective (``MegatronRefitSource._check_inputs``): a named family that
is not supported yet, and the layers of a hybrid model whatever family is named, since a
gated or linear attention layer would otherwise reach the converter as plain attention
(``attention_output_gate`` makes ``linear_qkv`` carry a gate per head that vLLM's
``qkv_proj`` does not have).
"""

from __future__ import annotations

from typing import Any, Optional

_QWEN3_NEXT_BLOCKERS = (
    "megatron-core 0.16.1 builds Gated-DeltaNet layers only with Transformer Engine (its "
    "experimental attention block spec asserts transformer_impl='transformer_engine'), so no "
    "real model of the family can be built and checked on a CPU machine; the converter rules "
    "for GatedDeltaNet's in_proj (q/k/v/z/b/a rows, vLLM's per-key-head interleave of "
    "in_proj_qkvz / in_proj_ba over TP), conv1d, A_log, dt_bias and the gated norm, and for "
    "the output gate that attention_output_gate adds to linear_qkv, are not written; and vLLM "
    "0.33's qwen3_next / qwen3_5 model modules do not import in the project's vLLM test "
    "environment (their Gated-DeltaNet layer imports compressed_tensors, not installed), so "
    "no refit could be checked against vLLM's own loading either")

#: HF ``model_type`` -> why the refit refuses it (Qwen3.5's text types share Qwen3-Next's layers)
NOT_YET_SUPPORTED: dict[str, str] = {
    "qwen3_next": _QWEN3_NEXT_BLOCKERS,
    "qwen3_5_text": _QWEN3_NEXT_BLOCKERS,
    "qwen3_5_moe_text": _QWEN3_NEXT_BLOCKERS,
}


def family_problem(family: Optional[str]) -> Optional[str]:
    """Why ``family`` is refused (None: not one of ``NOT_YET_SUPPORTED``)."""
    if family not in NOT_YET_SUPPORTED:
        return None
    return f"model family {family!r} is not supported yet: {NOT_YET_SUPPORTED[family]}"


def layer_problems(config: Any) -> list[str]:
    """The hybrid-model layers a ``TransformerConfig`` asks for that the refit cannot convert."""
    out = []
    variant = getattr(config, "experimental_attention_variant", None)
    if variant is not None:
        out.append(f"experimental_attention_variant={variant!r} (Qwen3-Next / Qwen3.5 linear "
                   "attention) is not supported yet: its layers have no converter rules")
    if getattr(config, "attention_output_gate", False):
        out.append("attention_output_gate=True (Qwen3-Next / Qwen3.5 gated full attention) is not "
                   "supported yet: linear_qkv carries an output gate per head that no converter "
                   "rule splits off")
    return out
