"""NeMo-RL refit transport: ``refit_transport: "megatron_reshard.adapters.nemo_rl:MegatronReshardCheckpointEngine"``.

Selected by configuration (NeMo-RL's ``create_checkpoint_engine`` imports the module and
builds the class with ``bucket_size=...`` and the options of its ``refit_cfg`` scope)::

    policy:
      generation:
        refit_transport: "megatron_reshard.adapters.nemo_rl:MegatronReshardCheckpointEngine"
        refit_cfg:
          "megatron_reshard.adapters.nemo_rl:MegatronReshardCheckpointEngine":
            gen_tp: 2

NeMo-RL runs the rollout side of its checkpoint engines inside vLLM's workers, so the
engine writes into the vLLM model handed to it there (``target`` or ``hand_off(target=
worker.model_runner.model)``: ``adapters.handoff``) and receives every shard straight
into its storage; ``receive_weight_batches`` then yields no batch for NeMo-RL to load. The
policy side sends its own Megatron shards and closes NeMo-RL's iterator of full tensors
unread. ``finalize`` (NeMo-RL's shutdown, or ``release_after_refit``) releases the refit
groups; the next sync prepares and joins new ones.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Optional

from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

from megatron_reshard.adapters.core import AdapterEnds, Topology
from megatron_reshard.adapters.options import AdapterOptions
from megatron_reshard.errors import BadInputError

TRANSPORT = "megatron_reshard.adapters.nemo_rl:MegatronReshardCheckpointEngine"
CONFIG_KEY = f"policy.generation.refit_cfg[{TRANSPORT!r}]"
# keys NeMo-RL's plugin config schema adds to every transport's options
_NEMO_RL_KEYS = ("release_after_refit",)


class MegatronReshardCheckpointEngine(CheckpointEngine):
    """NeMo-RL's ``CheckpointEngine`` over megatron_reshard's sender and receiver."""

    def __init__(self, bucket_size: int, **engine_kwargs: Any) -> None:
        self.bucket_size = bucket_size  # NeMo-RL's: no bucket of full tensors is filled
        options = AdapterOptions.parse(engine_kwargs, CONFIG_KEY, _NEMO_RL_KEYS)
        if options.vllm_server is not None:
            raise BadInputError(f"{CONFIG_KEY}.vllm_server: verl only; NeMo-RL runs the engine "
                                f"inside vLLM's workers (set target, or hand_off(target=...))")
        self.ends = AdapterEnds(options, CONFIG_KEY)
        self.last_refit: Optional[dict] = None

    def prepare(self) -> dict:
        return self.ends.prepare()

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int,
                                  rollout_world_size: int, metadata: list) -> None:
        self.ends.join(Topology.of(metadata, train_world_size, rollout_world_size, CONFIG_KEY),
                       None)

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int,
                                   rollout_world_size: int, metadata: list) -> None:
        self.ends.join(Topology.of(metadata, train_world_size, rollout_world_size, CONFIG_KEY),
                       rollout_rank)

    def finalize(self) -> None:
        self.ends.close()

    async def send_weights(self, weights: Any) -> None:
        await self.ends.send(weights, None)

    async def receive_weight_batches(self) -> AsyncGenerator[list, None]:
        self.last_refit = await self.ends.receive(None)
        for batch in ():  # an async generator, as NeMo-RL iterates it: nothing to load
            yield batch


__all__ = ["MegatronReshardCheckpointEngine", "TRANSPORT", "CONFIG_KEY"]
