"""How an adapter engine gets what it works on: handed to it explicitly, never searched for.

Neither framework gives its checkpoint engine the model: verl and NeMo-RL build the engine
from configuration alone (``CheckpointEngineRegistry.new(backend, **engine_kwargs)``,
``create_checkpoint_engine(refit_transport, engine_kwargs=...)``) and pass it only iterators
of full tensors. So each end takes its object from one of two explicit hand-offs, in order:

1. the configuration key (the option): ``model`` / ``target`` name a ``"module:function"``
   the engine calls with no argument; ``vllm_server`` names verl's vLLM server Ray actor;
2. the registration call ``hand_off(model=..., target=..., vllm_server=...)``, made in the
   worker process by the code that holds the object (a framework worker subclass, a
   launcher hook) before the engine's first ``prepare``.

Neither given: the engine refuses at ``prepare`` (before any group forms), naming the key
and the call. One process holds one worker of each kind, so the hand-off is per process.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_reshard.adapters.options import load_function
from megatron_reshard.errors import BadInputError

_SLOTS = ("model", "target", "vllm_server")
_handed: dict[str, Any] = {}


def _is_module_or_chunks(value: Any) -> bool:
    return isinstance(value, torch.nn.Module) or (
        isinstance(value, (list, tuple)) and bool(value)
        and all(isinstance(v, torch.nn.Module) for v in value))


def hand_off(*, model: Any = None, target: Optional[torch.nn.Module] = None,
             vllm_server: Any = None) -> None:
    """Give this process's adapter engines what they work on (each argument optional).

    ``model``: the Megatron model (a module or its virtual-pipeline chunks) a training
    worker refits from. ``target``: the vLLM model (``model_runner.model``) a rollout worker
    in vLLM's process writes into. ``vllm_server``: a handle on verl's vLLM server (a Ray
    actor handle of ``vLLMHttpServer``: ``collective_rpc.remote(...)``) a rollout worker
    beside vLLM drives (docs/ADAPTERS.md, "verl's stock vLLM server")."""
    if model is not None and not _is_module_or_chunks(model):
        raise BadInputError(f"hand_off(model=...): expected a torch.nn.Module or a non-empty "
                            f"list of them (the Megatron chunks), found {type(model).__name__}")
    if target is not None and not isinstance(target, torch.nn.Module):
        raise BadInputError(f"hand_off(target=...): expected the vLLM model (a "
                            f"torch.nn.Module), found {type(target).__name__}")
    if vllm_server is not None and not hasattr(getattr(vllm_server, "collective_rpc", None),
                                               "remote"):
        raise BadInputError(f"hand_off(vllm_server=...): expected a Ray actor handle of verl's "
                            f"vLLM server (with collective_rpc.remote), found "
                            f"{type(vllm_server).__name__}")
    for slot, value in (("model", model), ("target", target), ("vllm_server", vllm_server)):
        if value is not None:
            _handed[slot] = value


def clear_hand_off() -> None:
    """Forget everything handed to this process (a worker that drops its model)."""
    _handed.clear()


def handed(slot: str) -> Any:
    """What ``hand_off`` gave for ``slot`` (None if nothing)."""
    if slot not in _SLOTS:
        raise BadInputError(f"unknown hand-off slot {slot!r}; known: {list(_SLOTS)}")
    return _handed.get(slot)


def model_from(option: Optional[str], slot: str, key: str, what: str) -> Any:
    """The object an end works on: the ``"module:function"`` option if set, else what
    ``hand_off`` gave for ``slot``; neither: an error naming the option and the call."""
    if option is not None:
        value = load_function(option, key)()
        if value is None:
            raise BadInputError(f"{key}: {option} returned None, expected {what}")
        return value
    value = handed(slot)
    if value is None:
        raise BadInputError(f"{key}: not set, and nothing was handed to this process: set {key} "
                            f"to a 'module:function' returning {what}, or call "
                            f"megatron_reshard.adapters.hand_off({slot}=...) in the worker "
                            f"before the engine's first prepare (docs/ADAPTERS.md)")
    return value


__all__ = ["hand_off", "clear_hand_off", "handed", "model_from"]
