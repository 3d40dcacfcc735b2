"""Weights that vLLM derives from loaded params, recomputed after each committed refit.

A refit writes vLLM's params in place. Most layers read those params at every forward, but
vLLM's MLA attention does not: after loading, ``process_weights_after_loading(act_dtype)``
of each MLA attention layer absorbs ``kv_b_proj`` into ``W_UK_T`` / ``W_UV`` (ROCm's
FP8/FP4 BMM paths: ``W_K`` / ``W_V`` and their scales) and uses those from then on. With an
unquantized ``kv_b_proj`` the absorbed tensors are views of its storage (the cast is a no-op,
the rest reshapes), so a refit in place updates them; with an FP8 ``kv_b_proj`` (real
DeepSeek-V3 / Kimi-K2 checkpoints) they are real copies, and a refit that left them would
generate from the old attention weights: silently wrong.

So after every committed refit the worker re-runs that layer method, vLLM's own code, for
each MLA layer whose ``kv_b_proj`` the refit wrote, and nothing else (re-running the whole
post-load pass would transform already-processed quantized weights a second time). Where
the layer method puts a result in new storage, it is copied back into the storage the layer
had, so captured CUDA graphs keep reading the right addresses. The refresh checks itself:
every written ``kv_b_proj`` must belong to a refreshed layer, else ``DerivedWeightsError``
and the weights are marked inconsistent.

It runs after ``receiver.staged_conversion`` has converted the refitted block-FP8 layers
(an FP8 ``kv_b_proj`` included), as vLLM's loader runs the quant methods' post-load before
the attention layers'; vLLM then dequantizes the converted ``kv_b_proj``.

Nothing else is re-run, and never an expert layer: vLLM's MoE post-load converts the
storage it is given (FlashInfer CUTLASS swaps w13's halves, TRTLLM permutes into its block
layout), so re-running it on converted storage would convert twice. The refit writes
expert weights straight into vLLM's converted order (``receiver.kernel_layouts``), and
``_holder`` refuses any module holding expert weights.

Where the layer keeps them: vLLM 0.33 registers the absorbed tensors as ``Parameter``s of
the ``MLAAttention`` layer itself (``...self_attn.mla_attn.mla_attn``), listed by
``named_parameters()``; older vLLM kept them as attributes of its implementation
(``layer.impl``). Both are found here by duck typing (torch only, no vLLM import).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Collection, Optional

import torch

from megatron_reshard.errors import MegatronReshardError

# attributes vLLM's MLA layers derive from kv_b_proj after loading
DERIVED_ATTRIBUTES = ("W_UK_T", "W_UV", "W_K", "W_K_scale", "W_V", "W_V_scale", "W_UK_T_dcp_qrep")
_MARKERS = ("W_UK_T", "W_UV", "W_K", "W_V")  # an MLA layer holds at least one pair of these
_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")  # vLLM's routed experts: never re-processed


class DerivedWeightsError(MegatronReshardError, RuntimeError):
    """vLLM derives copies of refitted weights that this refit could not refresh."""


def _holder(module: torch.nn.Module) -> Optional[Any]:
    """The object whose ``process_weights_after_loading(act_dtype)`` derives the absorbed
    tensors of ``module``: the module (vLLM 0.33), its ``impl`` (older vLLM), or None."""
    if any(hasattr(module, w) for w in _EXPERT_WEIGHTS):
        return None  # its post-load would convert the expert storage a second time
    for obj in (module, getattr(module, "impl", None)):
        if obj is not None and callable(getattr(obj, "process_weights_after_loading", None)) \
                and any(isinstance(getattr(obj, a, None), torch.Tensor) for a in _MARKERS):
            return obj
    return None


def mla_layers(model: torch.nn.Module) -> list[tuple[str, Any, torch.nn.Module]]:
    """``(module name, holder, kv_b_proj)`` of every attention layer holding absorbed MLA
    weights (``kv_b_proj`` kept on the layer or on its implementation)."""
    out = []
    for name, module in model.named_modules():
        holder = _holder(module)
        if holder is None:
            continue
        kv_b = getattr(module, "kv_b_proj", None) or getattr(holder, "kv_b_proj", None)
        if isinstance(kv_b, torch.nn.Module):
            out.append((name, holder, kv_b))
    return out


def may_derive(model: torch.nn.Module) -> bool:
    """Whether ``refresh_derived_weights`` can ever find work in ``model``: some module of
    it is named ``kv_b_proj`` (MLA's; every MLA layer ``mla_layers`` finds keeps one in the
    module tree, and an orphan is a ``kv_b_proj.weight``). One walk, at ``prepare_refit``:
    vLLM does not add modules to a loaded model (``receiver.live_targets`` reads the
    params from the modules' tables bound at prepare on the same ground), so a model
    without one skips the walks of every refit (~0.4 ms for a 4-layer model on a loaded
    CPU; more for hundreds of modules, ``scripts/bench_refit_overhead.py``)."""
    return any(name.rpartition(".")[2] == "kv_b_proj" for name, _ in model.named_modules())


def derived_param_names(model: torch.nn.Module) -> set[str]:
    """Names (as ``model.named_parameters()`` lists them) of the params vLLM derives after
    loading: never refit targets, recomputed by ``refresh_derived_weights``."""
    derived = {id(getattr(holder, a)) for _, holder, _ in mla_layers(model)
               for a in DERIVED_ATTRIBUTES if isinstance(getattr(holder, a, None), torch.Tensor)}
    return {n for n, p in model.named_parameters() if id(p) in derived}


def _derived_storage(holder: Any) -> dict[str, torch.Tensor]:
    """The derived tensors' current storage (``.data``: a Parameter whose ``.data`` vLLM
    rebinds stays the same object, so the old storage must be held apart)."""
    return {a: t.data for a in DERIVED_ATTRIBUTES
            if isinstance(t := getattr(holder, a, None), torch.Tensor)}


def _keep_storage(holder: Any, before: dict[str, torch.Tensor], layer_name: str) -> int:
    """Put each recomputed tensor back into the storage it had before (same address).
    Returns the bytes vLLM's recomputation held apart from that storage (its staging)."""
    staged = 0
    for attr, old in before.items():
        new = getattr(holder, attr, None)
        if isinstance(new, torch.Tensor) and new.data_ptr() == old.data_ptr() \
                and new.stride() == old.stride():
            continue
        if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype:
            raise DerivedWeightsError(
                f"{layer_name}.{attr}: vLLM recomputed it as "
                f"{None if new is None else (tuple(new.shape), new.dtype)}, the layer held "
                f"{(tuple(old.shape), old.dtype)}; it cannot be refreshed in place")
        with torch.no_grad():
            old.copy_(new)
        staged += new.numel() * new.element_size()
        if isinstance(new, torch.nn.Parameter):
            new.data = old  # the same Parameter object, over its old storage
        else:
            setattr(holder, attr, old)
    return staged


def refresh_derived_weights(model: torch.nn.Module, written: Collection[torch.Tensor],
                            act_dtype: Optional[torch.dtype] = None,
                            stats: Optional[dict] = None) -> list[str]:
    """Recompute what vLLM derived from the refitted params ``written`` (the tensors the
    refit wrote); returns the names of the refreshed layers.

    ``act_dtype`` is vLLM's model dtype (``model_config.dtype``, what vLLM passes at load);
    by default the dtype of the layer's ``W_UV`` (vLLM casts the absorbed weights to it).
    Raises ``DerivedWeightsError`` when a written ``kv_b_proj`` has no layer to refresh or a
    result cannot go back into its storage. ``stats`` (a dict) gets ``peak_staging_bytes``
    (the most one layer's recomputation held apart from its storage) and ``max_layer_s``.

    Runs after ``receiver.staged_conversion`` has converted the refitted linear layers
    (an FP8 ``kv_b_proj`` included), as vLLM's loader runs the quant methods' post-load
    before the attention layers'. Deriving is a function of ``kv_b_proj`` alone, so a
    second run gives the same bytes: nothing is converted twice."""
    # by address: the receiver holds its targets as tensors over the params' storage
    written_at = {t.data_ptr() for t in written}
    refreshed, done = [], set()
    layers = mla_layers(model)  # one walk of the modules per refit
    for name, holder, kv_b_proj in layers:
        weight = getattr(kv_b_proj, "weight", None)
        if weight is None or weight.data_ptr() not in written_at:
            continue
        before = _derived_storage(holder)
        dtype = act_dtype or getattr(holder, "W_UV", getattr(holder, "W_UK_T", weight)).dtype
        t0 = time.perf_counter()
        with torch.no_grad():
            _post_load(holder, dtype)
        staged = _keep_storage(holder, before, name)
        if stats is not None:
            stats["peak_staging_bytes"] = max(stats.get("peak_staging_bytes", 0), staged)
            stats["max_layer_s"] = max(stats.get("max_layer_s", 0.0), time.perf_counter() - t0)
        refreshed.append(name)
        done.add(weight.data_ptr())
    orphans = sorted(n for n, p in model.named_parameters() if n.endswith("kv_b_proj.weight")
                     and p.data_ptr() in written_at and p.data_ptr() not in done)
    if orphans and (layers or _looks_like_vllm(model)):
        raise DerivedWeightsError(
            f"the refit wrote {orphans} but no MLA attention layer using them was found to "
            f"recompute {' / '.join(_MARKERS)} from; vLLM would keep generating from the old "
            f"attention weights (this vLLM version keeps them where the refit does not look)")
    return refreshed


def _post_load(holder: Any, dtype: torch.dtype) -> None:
    """The holder's own post-load step: vLLM 0.33 and older pass the model dtype, vLLM 0.34's
    ``MLAAttention`` takes no argument (it reads its own ``act_dtype``)."""
    if inspect.signature(holder.process_weights_after_loading).parameters:
        holder.process_weights_after_loading(dtype)
    else:
        holder.process_weights_after_loading()


def _looks_like_vllm(model: torch.nn.Module) -> bool:
    """A vLLM model (its MLA attention modules are named ``mla_attn``)."""
    return any(n.endswith("mla_attn") for n, _ in model.named_modules())


__all__ = ["DERIVED_ATTRIBUTES", "DerivedWeightsError", "derived_param_names", "may_derive",
           "mla_layers", "refresh_derived_weights"]
