"""vLLM plugin: registers the ``megatron_reshard`` weight-transfer backend.

vLLM (0.33) calls every entry point of the group ``vllm.general_plugins`` in each of its
processes (``vllm.plugins.load_general_plugins``); this package declares
``megatron_reshard = "megatron_reshard.vllm_plugin:register"`` there (``pyproject.toml``),
so an unmodified vLLM accepts ``WeightTransferConfig(backend="megatron_reshard")``.

The registration is lazy: vLLM imports ``megatron_reshard.vllm_backend`` only when a worker
builds the engine. Importing this module imports nothing of vLLM; ``register()`` does.
"""

from __future__ import annotations

BACKEND_NAME = "megatron_reshard"
ENGINE_MODULE = "megatron_reshard.vllm_backend"
ENGINE_CLASS = "MegatronReshardWeightTransferEngine"


def register() -> None:
    """Register the backend with vLLM's ``WeightTransferEngineFactory``; idempotent (vLLM
    may load its plugins more than once per process, and its registry refuses a name twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME in getattr(WeightTransferEngineFactory, "_registry", {}):
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:
        if BACKEND_NAME not in getattr(WeightTransferEngineFactory, "_registry", {}):
            raise


__all__ = ["BACKEND_NAME", "ENGINE_CLASS", "ENGINE_MODULE", "register"]
