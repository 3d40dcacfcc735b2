"""verl 0.9.1 checkpoint engine ``megatron_reshard`` (registered when this module is imported).

Selected by configuration::

    actor_rollout_ref.rollout.checkpoint_engine.backend=megatron_reshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=megatron_reshard.adapters.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.megatron_reshard.gen_tp=2

verl's workers import ``custom_backend_module`` (so the registration below runs) and build
the engine with ``CheckpointEngineRegistry.new("megatron_reshard", bucket_size=...,
[is_master=...], **engine_kwargs["megatron_reshard"])``. Per weight update verl calls, on
every actor and rollout worker: ``prepare`` → (driver) ``build_topology`` →
``init_process_group`` → ``send_weights`` / ``receive_weights`` → ``finalize``.

What the engine does with each (``adapters.core``): the actor side sends its own Megatron
shards (``RefitSender``) and closes verl's iterator of gathered full tensors unread; the
rollout side either receives each shard straight into the target model's storage
(``RefitWorkerState``; the engine runs in vLLM's process, ``target``) or, beside verl's
stock vLLM server (``vllm_server``), drives megatron_reshard's weight-transfer backend in
vLLM's workers through the server's ``collective_rpc`` (``adapters.server_end``); either way
it yields no tensors for verl's server adapter to load. The refit groups are joined once
and kept across updates (``finalize`` keeps them; ``shutdown`` releases them). The models
are handed over explicitly (``adapters.handoff``; docs/ADAPTERS.md).
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Optional

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from megatron_reshard.adapters.core import AdapterEnds, Topology
from megatron_reshard.adapters.options import AdapterOptions

BACKEND = "megatron_reshard"
CONFIG_KEY = f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{BACKEND}"


@CheckpointEngineRegistry.register(BACKEND)
class MegatronReshardCheckpointEngine(CheckpointEngine):
    """verl's ``CheckpointEngine`` over megatron_reshard's sender and receiver."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        # bucket_size / is_master: verl's own arguments; no bucket of full tensors is filled
        # and every training rank sends its own shards
        self.bucket_size, self.is_master = bucket_size, is_master
        self.ends = AdapterEnds(AdapterOptions.parse(engine_kwargs, CONFIG_KEY), CONFIG_KEY)
        self.last_refit: Optional[dict] = None

    @property
    def wire_format(self) -> str:
        """What verl's ``CheckpointEngineWorker.update_weights`` tells the server adapter.
        Driving vLLM's server, "delta_flush": the only format whose vLLM
        ``ServerAdapter.update_weights`` (``_update_delta_weights``) reads the engine's stream
        before sending any RPC of its own, so this engine's RPCs run first and the stream
        ends empty (verl then only sets the global steps); "named_tensors" would first start
        ``update_weights_from_ipc`` on vLLM's workers, which blocks them until the stream ends."""
        return "delta_flush" if self.ends.drives_vllm_server else "named_tensors"

    def prepare(self) -> dict:
        return self.ends.prepare()

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict, dict]:
        # checked here, in verl's driver, before any worker joins a group
        topology = Topology.of(metadata, actor_wg_world_size, rollout_world_size,
                               CONFIG_KEY).as_dict()
        return ({"topology": [topology] * actor_wg_world_size,
                 "rollout_rank": [None] * actor_wg_world_size},
                {"topology": [topology] * rollout_world_size,
                 "rollout_rank": list(range(rollout_world_size))})

    def init_process_group(self, topology: dict, rollout_rank: Optional[int] = None) -> None:
        self.ends.join(Topology.from_dict(topology), rollout_rank)

    def finalize(self) -> None:
        """verl calls it after every update: the refit groups stay for the next one."""

    def shutdown(self) -> None:
        """Destroy this worker's refit groups (every worker of the groups does the same)."""
        self.ends.close()

    async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> dict:
        """One refit; ``global_steps`` (if given) becomes the weights' version, which must
        increase from update to update. Returns the refit's numbers (verl's sync metrics)."""
        return await self.ends.send(weights, global_steps)

    async def receive_weights(self, global_steps: Optional[int] = None
                              ) -> AsyncGenerator[tuple[str, Any], None]:
        """One refit into the target model; the weights are in place when it returns, so it
        yields nothing for verl's server adapter to load."""
        self.last_refit = await self.ends.receive(global_steps)
        for named_tensor in ():  # an async generator, as verl iterates it: nothing to yield
            yield named_tensor


__all__ = ["MegatronReshardCheckpointEngine", "BACKEND", "CONFIG_KEY"]
