"""The rollout end beside verl's stock vLLM server: it holds no model and drives vLLM's own
workers, which run megatron_reshard's vLLM weight-transfer backend, through the server's
``collective_rpc`` (docs/ADAPTERS.md, "verl's stock vLLM server").

In verl 0.9.1 the rollout checkpoint engine runs in ``CheckpointEngineWorker`` (a Ray actor
beside the vLLM worker processes); verl's ``vLLMHttpServer`` actor (one per replica and
node, named ``vllm_server_<replica>_<node>``) owns vLLM's ``AsyncLLM`` and forwards
``collective_rpc(method, timeout, args, kwargs)`` to every vLLM worker, whose
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` / ``shutdown_weight_transfer_engine`` call the weight-transfer
engine vLLM built with its model (``weight_transfer_config.backend=megatron_reshard``). So
the shards land in vLLM's storage from the refit groups the vLLM workers join; this end
only orders the calls.

Ordering against verl's calls (``CheckpointEngineManager.update_weights``): every worker's
``init_process_group`` runs at once and verl waits for all, so rollout rank 0 only *fires*
``init_weight_transfer_engine`` there (a Ray call runs on its own) while the training ranks
block joining the same groups; the update awaits it first, so its error is raised there.
The other rollout ranks' engines do nothing: rank 0's call reaches every vLLM worker.
vLLM derives each worker's refit-group rank from its own rank, so one vLLM server (one
replica of ``gen_tp`` workers) per refit.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from megatron_reshard.adapters.handoff import handed
from megatron_reshard.adapters.options import AdapterOptions
from megatron_reshard.adapters.topology import MARK, Topology
from megatron_reshard.errors import BadInputError, CallOrderError


def server_from(option: Optional[str], key: str) -> Any:
    """verl's vLLM server: the Ray actor the ``vllm_server`` option names, else the handle
    ``hand_off(vllm_server=...)`` gave."""
    if option is None:
        server = handed("vllm_server")
        if server is None:
            raise BadInputError(f"{key}: not set, and no vLLM server was handed to this process")
        return server
    import ray  # only here: the option names a Ray actor (verl's workers run under Ray)

    if not ray.is_initialized():
        raise BadInputError(f"{key}: {option!r} names a Ray actor, but Ray is not initialized "
                            f"in this process (the engine runs in verl's CheckpointEngineWorker)")
    try:
        return ray.get_actor(option)
    except ValueError as exc:
        raise BadInputError(f"{key}: no Ray actor named {option!r} (verl names its vLLM "
                            f"servers vllm_server_<replica>_<node>): {exc}") from exc


class ServerRolloutEnd:
    """A rollout worker's end that drives vLLM's workers through verl's vLLM server."""

    def __init__(self, options: AdapterOptions, key: str):
        self.options, self.key = options, key
        self.server: Any = None
        self.topology: Optional[Topology] = None
        self.rank: Optional[int] = None
        self.joining: Any = None  # the fired init_weight_transfer_engine call, not awaited yet
        self.joined = False       # vLLM's workers hold refit groups of ``self.topology``
        self.updates = 0

    def prepare(self) -> dict:
        o = self.options
        if o.gen_world_size != o.gen_tp:
            raise BadInputError(f"{self.key}.gen_world_size: {o.gen_world_size}, but a rollout "
                                f"side driving verl's vLLM server refits one server (one replica "
                                f"of gen_tp = {o.gen_tp} workers): vLLM derives each worker's "
                                f"refit-group rank from its rank within its replica")
        if self.server is None:  # every rank: a bad name is refused before any group forms
            self.server = server_from(o.vllm_server, f"{self.key}.vllm_server")
        return {MARK: 1, "side": "rollout"}

    def _call(self, method: str, **kwargs: Any) -> Any:
        """Fire one ``collective_rpc`` on every vLLM worker of the server; awaitable."""
        return self.server.collective_rpc.remote(method, timeout=self.options.timeout_s,
                                                 kwargs=kwargs)

    def join(self, topology: Topology, rollout_rank: int) -> None:
        if not 0 <= rollout_rank < topology.gen_world:
            raise BadInputError(f"rollout rank {rollout_rank} outside the {topology.gen_world} "
                                f"rollout workers")
        if self.topology == topology and self.rank == rollout_rank:
            return  # verl re-sends the same topology every update: the groups stay
        self.close(wait=True)  # new groups (a restarted trainer): the old ones go first
        self.topology, self.rank = topology, rollout_rank
        if rollout_rank != 0:
            return  # rollout rank 0's calls reach every vLLM worker of the server
        if self.server is None:
            raise CallOrderError("init_process_group before prepare: no vLLM server yet")
        o = self.options
        init_info = {"host": topology.host, "ports_by_stage": list(topology.ports),
                     "group_sizes": topology.stage_world + topology.gen_world,
                     "payload": topology.payload, "group_rank": None,
                     "backend": o.group_backend, "timeout_s": o.timeout_s,
                     "prepare_options": {"verify_checksums": o.verify_checksums,
                                         "keep_as_loaded": list(o.keep_as_loaded)}}
        # fired, not awaited: the training ranks are joining the same groups right now
        self.joining = self._call("init_weight_transfer_engine", init_info=init_info)

    async def receive(self, version: Optional[int]) -> dict:
        """One refit on every vLLM worker (rollout rank 0; the others have nothing to do)."""
        if self.topology is None:
            raise CallOrderError("receive_weights before the refit groups were joined "
                                 "(init_process_group)")
        if self.rank != 0:
            return {"version": version, "drove_vllm_server": False}
        if self.joining is not None:
            joining, self.joining = self.joining, None
            try:
                await joining
            except BaseException:
                self.topology = None  # the next init_process_group tries again
                raise
            self.joined = True
        await self._call("start_weight_update")
        # vLLM's worker ends the update itself when update_weights raises
        await self._call("update_weights",
                         update_info={} if version is None else {"version": version})
        await self._call("finish_weight_update")
        clear = getattr(self.server, "clear_kv_cache", None)
        if clear is not None:  # KV blocks computed from the old weights must go (README)
            await clear.remote()
        self.updates += 1
        return {"version": version, "drove_vllm_server": True, "updates": self.updates}

    def close(self, wait: bool = False) -> None:
        """Release the vLLM workers' refit groups: fired (verl's ``shutdown`` does not wait),
        or with ``wait`` finished before returning (a re-join must not overtake it)."""
        if self.rank == 0 and (self.joined or self.joining is not None):
            call = self._call("shutdown_weight_transfer_engine")
            if wait:
                _wait(call)
        self.topology = self.rank = self.joining = None
        self.joined = False


def _wait(call: Any) -> Any:
    """The result of an awaitable call (a Ray ``ObjectRef``) from synchronous code: awaited on
    a thread of its own, since verl runs the engine's synchronous methods on its event loop."""
    async def result() -> Any:
        return await call

    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, result()).result()


__all__ = ["ServerRolloutEnd", "server_from"]
