"""What differs between the vLLM versions the backend supports (0.25.1 to 0.34.0), in one place.

Imports vLLM (like every module of ``vllm_api`` but ``plugin``); each switch below looks at
what the running vLLM has, not at its version string, and says which versions differ.

- ``WorkerEngineCompat``: a base the worker engine lists before vLLM's
  ``WeightTransferEngine``. vLLM before 0.26 declares the trainer's send as an abstract
  static method of the worker engine (``trainer_send_weights(iterator, trainer_args)``),
  so an engine without it cannot be built there ("Can't instantiate abstract class");
  from 0.26 the trainer side is its own class (``TrainerWeightTransferEngine``, this
  backend's ``vllm_api.trainer``) and the worker engine has no such method.
- ``HAS_TRAINER_API``: vLLM's trainer-side registry (``WeightTransferTrainerFactory``)
  exists (0.26 and later).

The differences the receiver meets live in the receiver instead, which imports no vLLM and
reaches vLLM's code through the live model only (each reads a signature or an attribute,
never a version string):

- ``receiver.kernel_layouts``: vLLM's MoE conversion gets a ``layer`` argument only where it
  takes one (0.25.1's does not); 0.25.1's older CPU MoE path (``cpu_fused_moe``) is written
  where it keeps w13/w2 as loaded and refused where it prepacks them.
- ``receiver.staged_conversion``: 0.25.1's name of the online FP8 linear base class.
- ``receiver.derived``: MLA's ``W_UK_T`` / ``W_UV`` are parameters of the ``MLAAttention``
  layer (0.34.0), plain attributes of it (0.25.1) or of its ``impl`` (older), all found by
  duck typing; its post-load takes the model dtype (0.25.1) or nothing (0.34.0).

What differs only for the CPU tests (no CPU MLA backend, gpt-oss's stacked experts, the FP8
kernel hooks) is in ``testing.vllm_oldest_shims`` / ``testing.vllm_models``;
docs/VLLM_CHECKS.md, "The two ends of the range", lists every difference and its test.
"""

from __future__ import annotations

from typing import Any, Iterator

from vllm.distributed.weight_transfer import base as _base
from vllm.distributed.weight_transfer import factory as _factory

_ABSTRACT = getattr(_base.WeightTransferEngine, "__abstractmethods__", frozenset())

LEGACY_TRAINER_SEND = "trainer_send_weights" in _ABSTRACT
HAS_TRAINER_API = hasattr(_factory, "WeightTransferTrainerFactory")

# what a trainer on a vLLM without the trainer API runs instead of trainer_send_weights
TRAINER_SIDE_TEXT = ("this backend's training side is megatron_reshard's RefitSender over a refit "
                     "group (the shards travel as they lie, never as full tensors from an "
                     "iterator); with vLLM >= 0.26 also vLLM's trainer API "
                     "(megatron_reshard.vllm_api.trainer)")


class _TrainerSendWeightsRefused:
    """vLLM < 0.26: fills the worker engine's abstract ``trainer_send_weights``."""

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
        raise NotImplementedError("megatron_reshard: trainer_send_weights(iterator, ...) is not "
                                  "how this backend sends: " + TRAINER_SIDE_TEXT)


class _Nothing:
    pass


WorkerEngineCompat = _TrainerSendWeightsRefused if LEGACY_TRAINER_SEND else _Nothing

__all__ = ["HAS_TRAINER_API", "LEGACY_TRAINER_SEND", "TRAINER_SIDE_TEXT", "WorkerEngineCompat"]
