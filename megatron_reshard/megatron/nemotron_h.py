"""Nemotron-H (megatron-core ``MambaModel``): what the refit refuses, said once.

No Megatron import. The hybrid model with Mamba-2, attention and MLP layers refits through
the converter's rules (``families.NEMOTRON_H_RULES``, the mixer's tensors in
``megatron.mamba``, vLLM's layout in ``vllm_layout.mamba``), checked bit for bit against
vLLM's ``NemotronHForCausalLM.load_weights`` (tests/real_vllm/test_nemotron_h.py). Refused,
before any collective:

- MoE layers (``E`` in the hybrid pattern: Nemotron-3 Nano): their names are in the rules,
  but vLLM's NemotronH MoE is non-gated (squared-ReLU experts, ``is_non_gated_moe``), which
  vLLM 0.34's CPU MoE refuses to build (measured: "is_act_and_mul=False is supported only
  for CUDA, XPU and ROCm"), so no layout was checked against vLLM;
- Mamba layers without ``mamba_num_heads`` in the config (megatron-core then derives the
  heads from ``hidden_size``; the refit does not guess the geometry);
- a ``MambaModel`` under another family's names, or ``family="nemotron_h"`` for a model
  that is no ``MambaModel``.
"""

from __future__ import annotations

from typing import Any, Optional

MOE_LAYERS = (
    "Nemotron-H MoE layers ('E' in the hybrid pattern {pattern!r}) are not supported yet: vLLM's "
    "NemotronH experts are non-gated (squared ReLU), which vLLM 0.34's CPU MoE refuses to build "
    "('is_act_and_mul=False is supported only for CUDA, XPU and ROCm'), so their layout has not "
    "been checked against vLLM's own loading; Mamba-2, attention and MLP layers are supported")
NO_GEOMETRY = ("Nemotron-H Mamba layers need mamba_num_heads in the TransformerConfig (found None: "
               "megatron-core derives the heads from hidden_size, which the refit does not guess)")


def mamba_gen_tp_problem(config: Any, tp: int) -> Optional[str]:
    """Why vLLM's ``MambaMixer2`` cannot be split over ``tp`` generation ranks (None: it can):
    it asserts that TP divides the Mamba heads, and divides the groups or the model has one
    group (replicated). None for a config without Mamba geometry."""
    heads, groups = getattr(config, "mamba_num_heads", None), getattr(config, "mamba_num_groups", None)
    if not heads or not groups:
        return None
    if int(heads) % tp:
        return f"the model's {heads} Mamba heads do not split over tp_size={tp}"
    if int(groups) % tp and int(groups) != 1:
        return (f"the model's {groups} Mamba groups neither split over tp_size={tp} nor are one "
                f"group (vLLM's MambaMixer2 replicates only a single group)")
    return None


def unsupported(model: Any, family: Optional[str]) -> list[str]:
    """Why the refit refuses this model under ``family``; [] when it does not."""
    is_mamba = type(model).__name__ == "MambaModel"
    if family == "nemotron_h" and not is_mamba:
        return [f"family='nemotron_h' needs a megatron-core MambaModel, got {type(model).__name__}"]
    if not is_mamba:
        return []
    if family != "nemotron_h":
        return [f"a megatron-core MambaModel refits under Nemotron-H's names only: pass "
                f"family='nemotron_h' (got family={family!r}, given or inferred from the config)"]
    pattern = str(getattr(getattr(model, "decoder", None), "hybrid_override_pattern", None) or "")
    config = getattr(model, "config", None)
    problems = []
    if "E" in pattern or getattr(config, "num_moe_experts", None):
        problems.append(MOE_LAYERS.format(pattern=pattern))
    if "M" in pattern and not getattr(config, "mamba_num_heads", None):
        problems.append(NO_GEOMETRY)
    return problems
