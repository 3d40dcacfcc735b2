"""Model families and Megatron-Core layers the refit refuses, with what blocks each.

Checked before any collective (``MegatronRefitSource._check_inputs``): a named family that
is not supported yet, and the hybrid-model layers of a model whose family has no rules for
them, since a gated or linear attention layer would otherwise reach the converter as plain
attention (``attention_output_gate`` makes ``linear_qkv`` carry a gate per head that a
plain ``qkv_proj`` does not have). Qwen3-Next (``family="qwen3_next"``) has those rules
(``megatron.qwen3_next``).
"""

from __future__ import annotations

from typing import Any, Optional

_QWEN3_5_BLOCKERS = (
    "vLLM 0.33's Qwen3.5 module (models/qwen3_5.py) imports its vision tower (qwen3_vl -> "
    "transformers' Qwen2-VL image processor -> torchvision), and torchvision has no CPU build "
    "for torch 2.13 (PyPI's wheel is CUDA-linked: 'operator torchvision::nms does not exist'), "
    "so no refit can be checked against vLLM's own Qwen3.5 classes here; Qwen3.5's checkpoint "
    "also names the Gated-DeltaNet projections apart (in_proj_qkv, in_proj_z, in_proj_b, "
    "in_proj_a, loaded flat, not per key head), for which no converter rule is written. "
    "Qwen3-Next's layers are the same: family='qwen3_next' refits")

#: HF ``model_type`` -> why the refit refuses it
NOT_YET_SUPPORTED: dict[str, str] = {
    "qwen3_5_text": _QWEN3_5_BLOCKERS,
    "qwen3_5_moe_text": _QWEN3_5_BLOCKERS,
}

#: families whose rules convert Gated-DeltaNet layers and the attention output gate
HYBRID_FAMILIES = ("qwen3_next",)


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
                       "'gated_delta_net' (Qwen3-Next's linear attention) has converter rules")
        if not gated:
            out.append(f"family={family!r} expects attention_output_gate=True (Qwen3-Next's full "
                       "attention layers gate their output; vLLM's qkv_proj holds the gate rows)")
        return out
    if variant is not None:
        out.append(f"experimental_attention_variant={variant!r} (Qwen3-Next linear attention) "
                   "is not supported for this family: pass family='qwen3_next'")
    if gated:
        out.append("attention_output_gate=True (Qwen3-Next gated full attention) is not supported "
                   "for this family: linear_qkv carries an output gate per head; pass "
                   "family='qwen3_next'")
    return out
