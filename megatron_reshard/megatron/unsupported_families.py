"""Model families and Megatron-Core layers the refit refuses, with what blocks each.

Checked before any collective (``MegatronRefitSource._check_inputs``): a named family that
is not supported yet, and the hybrid-model layers of a model whose family has no rules for
them, since a gated or linear attention layer would otherwise reach the converter as plain
attention (``attention_output_gate`` makes ``linear_qkv`` carry a gate per head that a
plain ``qkv_proj`` does not have). Qwen3-Next (``family="qwen3_next"``) and Qwen3.5 text
(``"qwen3_5_text"``, ``"qwen3_5_moe_text"``) have those rules (``megatron.qwen3_next``).
"""

from __future__ import annotations

from typing import Any, Optional

_QWEN3_5_MULTIMODAL = (
    "this HF model_type is the multimodal Qwen3.5 (vLLM's Qwen3_5(Moe)ForConditionalGeneration: "
    "a vision tower beside the language model, checkpoint names under "
    "'model.language_model.'); a megatron-core GPTModel holds the language model only: refit it "
    "as the text model, family='qwen3_5_text' (dense) or 'qwen3_5_moe_text' (MoE), into vLLM's "
    "Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM")

#: HF ``model_type`` -> why the refit refuses it (Qwen3.5 text, ``qwen3_5_text`` /
#: ``qwen3_5_moe_text``, refits: ``families`` has its flat in_proj names)
NOT_YET_SUPPORTED: dict[str, str] = {
    "qwen3_5": _QWEN3_5_MULTIMODAL,
    "qwen3_5_moe": _QWEN3_5_MULTIMODAL,
}

#: families whose rules convert Gated-DeltaNet layers and the attention output gate
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def family_problem(family: Optional[str]) -> Optional[str]:
    """Why ``family`` is refused (None: not one of ``NOT_YET_SUPPORTED``)."""
    if family not in NOT_YET_SUPPORTED:
        return None
    return f"model family {family!r} is not supported yet: {NOT_YET_SUPPORTED[family]}"


def layer_problems(config: Any, family: Optional[str] = None) -> list[str]:
    """The hybrid-model layers a ``TransformerConfig`` asks for that ``family``'s rules
    cannot convert."""
    out = []
    variant = getattr(config, "experimental_attention_variant", None)
    gated = bool(getattr(config, "attention_output_gate", False))
    if family in HYBRID_FAMILIES:
        if variant not in (None, "gated_delta_net"):
            out.append(f"experimental_attention_variant={variant!r} is not supported: only "
                       "'gated_delta_net' (Qwen3-Next / Qwen3.5 linear attention) has converter rules")
        if not gated:
            out.append(f"family={family!r} expects attention_output_gate=True (Qwen3-Next's full "
                       "attention layers gate their output; vLLM's qkv_proj holds the gate rows)")
        return out
    if variant is not None:
        out.append(f"experimental_attention_variant={variant!r} (Qwen3-Next linear attention) "
                   "is not supported for this family: pass family='qwen3_next' (or Qwen3.5's "
                   "'qwen3_5_text' / 'qwen3_5_moe_text')")
    if gated:
        out.append("attention_output_gate=True (Qwen3-Next gated full attention) is not supported "
                   "for this family: linear_qkv carries an output gate per head; pass "
                   "family='qwen3_next'")
    return out
