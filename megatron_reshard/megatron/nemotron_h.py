"""Nemotron-H (megatron-core ``MambaModel``): why the refit refuses it, said once.

No Megatron import. The converter's name rules exist (``families.NEMOTRON_H_RULES``) but
no tensor rule for the Mamba-2 mixer's fused ``in_proj`` / ``conv1d`` and no vLLM layout
for them, and none can be checked here against a real model: megatron-core 0.16.1 cannot
build a ``MambaModel`` with Mamba layers on a machine without CUDA (measured, see
``BLOCKER``).
"""

from __future__ import annotations

from typing import Any, Optional

BLOCKER = (
    "Nemotron-H / megatron-core MambaModel is not supported yet: the Mamba-2 mixer's fused "
    "in_proj ([z, x, B, C, dt] per TP rank) and conv1d ([x, B, C] per TP rank) have no "
    "tensor rule nor vLLM layout here (vLLM's NemotronH also derives A = -exp(A_log) after "
    "loading), and megatron-core 0.16.1 cannot build the model without CUDA to check one: "
    "ssm/mamba_mixer.py imports triton and needs mamba_ssm, places its conv1d / dt_bias / "
    "A_log with torch.cuda.current_device() and the CUDA RNG tracker, "
    "mamba_layer_specs.mamba_stack_spec is Transformer-Engine only and MambaStack's final "
    "norm is TENorm whatever the spec says"
)


def unsupported(model: Any, family: Optional[str]) -> list[str]:
    """The refusal line for a Nemotron-H family or a MambaModel, else nothing."""
    if family == "nemotron_h" or type(model).__name__ == "MambaModel":
        return [BLOCKER]
    return []
