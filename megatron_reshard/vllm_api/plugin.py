"""vLLM plugin: registers the ``megatron_reshard`` weight-transfer backend, both sides.

vLLM (0.33) calls every entry point of the group ``vllm.general_plugins`` in each of its
processes (``vllm.plugins.load_general_plugins``); this package declares
``megatron_reshard = "megatron_reshard.vllm_api.plugin:register"`` there (``pyproject.toml``),
so an unmodified vLLM accepts ``WeightTransferConfig(backend="megatron_reshard")``. The
trainer side (``WeightTransferTrainerFactory``, engine ``megatron_reshard.vllm_api.trainer``) is
registered under the same name; a training process that never runs vLLM's plugin loader gets
it by importing its init info (``vllm_api.trainer`` calls ``register()`` on import).

The registration is lazy: vLLM imports ``megatron_reshard.vllm_api.backend`` only when a worker
builds the engine (``vllm_api.trainer`` when a trainer does). Importing this module imports
nothing of vLLM; ``register()`` does.
"""

from __future__ import annotations

BACKEND_NAME = "megatron_reshard"
ENGINE_MODULE = "megatron_reshard.vllm_api.backend"
ENGINE_CLASS = "MegatronReshardWeightTransferEngine"
TRAINER_MODULE = "megatron_reshard.vllm_api.trainer"
TRAINER_CLASS = "MegatronReshardTrainerWeightTransferEngine"


def register() -> None:
    """Register the backend with vLLM's ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory``; idempotent (vLLM may load its plugins more than once
    per process, and its registries refuse a name twice)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    _register_once(WeightTransferEngineFactory, ENGINE_MODULE, ENGINE_CLASS)
    _register_once(WeightTransferTrainerFactory, TRAINER_MODULE, TRAINER_CLASS)


def _register_once(factory, module: str, cls: str) -> None:
    if BACKEND_NAME in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_engine(BACKEND_NAME, module, cls)
    except ValueError:
        if BACKEND_NAME not in getattr(factory, "_registry", {}):
            raise


__all__ = ["BACKEND_NAME", "ENGINE_CLASS", "ENGINE_MODULE", "TRAINER_CLASS", "TRAINER_MODULE",
           "register"]
