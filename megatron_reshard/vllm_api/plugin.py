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

import logging

_log = logging.getLogger(__name__)

BACKEND_NAME = "megatron_reshard"
ENGINE_MODULE = "megatron_reshard.vllm_api.backend"
ENGINE_CLASS = "MegatronReshardWeightTransferEngine"
TRAINER_MODULE = "megatron_reshard.vllm_api.trainer"
TRAINER_CLASS = "MegatronReshardTrainerWeightTransferEngine"
# the registries in vllm.distributed.weight_transfer.factory; the trainer one exists from vLLM 0.26
WORKER_REGISTRY = "WeightTransferEngineFactory"
TRAINER_REGISTRY = "WeightTransferTrainerFactory"


def register() -> None:
    """Register the backend with every weight-transfer registry the running vLLM has;
    idempotent (vLLM may load its plugins more than once per process, and its registries
    refuse a name twice).

    vLLM runs this in every process it starts, whether or not the backend is selected, so it
    never raises: a plugin that raises here makes every ``LLM(...)`` fail. vLLM 0.25 has the
    worker registry (``WeightTransferEngineFactory``) but no trainer registry
    (``WeightTransferTrainerFactory``, from 0.26): what is missing is logged and skipped.
    """
    try:
        from vllm.distributed.weight_transfer import factory
    except Exception as exc:  # a vLLM without weight transfer: nothing to register into
        _log.warning("megatron_reshard: this vLLM has no weight-transfer registry (%s); "
                     "backend %r not registered", exc, BACKEND_NAME)
        return
    for registry, module, cls in ((WORKER_REGISTRY, ENGINE_MODULE, ENGINE_CLASS),
                                  (TRAINER_REGISTRY, TRAINER_MODULE, TRAINER_CLASS)):
        target = getattr(factory, registry, None)
        if target is None:
            _log.info("megatron_reshard: this vLLM has no %s; %s not registered", registry, cls)
            continue
        try:
            _register_once(target, module, cls)
        except Exception as exc:  # never into vLLM's plugin loader
            _log.warning("megatron_reshard: registering %s with %s failed: %r",
                         cls, registry, exc)


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
