"""Weights that vLLM derives from loaded params, refreshed after each committed refit.

A refit writes vLLM's params in place. Most layers read those params at every forward,
but vLLM's MLA attention does not: when the model loads, its MLA implementation computes
absorbed copies of ``kv_b_proj`` (``W_UK_T`` and ``W_UV``, in the activation dtype) in
``process_weights_after_loading`` and uses those copies from then on. A refit that left
them alone would generate from the old attention weights: silently wrong. So after every
committed refit of an MLA model the worker asks each MLA implementation to recompute them
from the fresh ``kv_b_proj`` (only that method: re-running vLLM's whole post-load pass
would transform already-processed quantized weights a second time).

Inside vLLM an MLA model whose layers hold no such implementation is refused loudly: the
weights are then marked inconsistent, so ``check_refit_weights_consistent`` fails.
Outside vLLM (a plain module with vLLM's names, as in the tests) nothing is derived.
Checked here against a stand-in with vLLM's attribute names; not yet run inside vLLM.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import torch

from megatron_reshard.vllm_layout.mla import is_mla_config

_DERIVED = ("W_UK_T", "W_UV")  # vLLM's MLACommonImpl: absorbed copies of kv_b_proj


class DerivedWeightsError(RuntimeError):
    """vLLM derives copies of refitted weights that this refit could not refresh."""


def _mla_impls(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(module name, implementation) of every attention layer holding absorbed MLA weights."""
    out = []
    for name, module in model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is not None and all(hasattr(impl, a) for a in _DERIVED) \
                and hasattr(impl, "process_weights_after_loading"):
            out.append((name, impl))
    return out


def refresh_derived_weights(model: torch.nn.Module, hf_config: Mapping[str, Any]) -> list[str]:
    """Recompute what vLLM derived from the refitted params; returns the refreshed layers.

    Raises ``DerivedWeightsError`` inside vLLM when the model is MLA and no layer holds an
    implementation to refresh (the absorbed copies would keep the old weights)."""
    if not is_mla_config(hf_config):
        return []
    impls = _mla_impls(model)
    if not impls:
        if "vllm" in sys.modules:
            raise DerivedWeightsError(
                "MLA model in vLLM: no attention layer holds an implementation with "
                f"{' / '.join(_DERIVED)} to recompute from the refitted kv_b_proj, so vLLM would "
                "keep generating from the old attention weights; this vLLM version keeps them "
                "elsewhere and is not supported by the refit yet")
        return []
    for _, impl in impls:
        # the copies were made in the activation dtype; they keep it
        impl.process_weights_after_loading(impl.W_UV.dtype)
    return [name for name, _ in impls]


__all__ = ["DerivedWeightsError", "refresh_derived_weights"]
