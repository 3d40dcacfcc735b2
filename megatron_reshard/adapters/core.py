"""What the framework adapters share: which side a process is on and the ends of a refit
(the models they work on are handed to them explicitly: ``adapters.handoff``).

The ends are thin: the training end is ``MegatronRefitSource`` + ``RefitSender`` on one
refit group per PP stage (``groups.create_refit_group``), the rollout end is the
receiver's ``RefitWorkerState`` (the state vLLM's worker extension and weight-transfer
backend hold) writing into the vLLM model's own storage, or, beside verl's stock vLLM
server, ``ServerRolloutEnd`` driving that backend in vLLM's workers. The frameworks only
decide when each phase runs.

Phases, as both frameworks order them: ``prepare`` on every worker returns plain metadata
(the training side's payload, the stores' host and ports); the framework hands every
worker the whole list, from which ``Topology.of`` reads the refit groups; ``join`` on each
side; then one ``send`` / ``receive`` pair per weight update.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megatron_reshard.adapters.handoff import handed, model_from
from megatron_reshard.adapters.options import AdapterOptions
from megatron_reshard.adapters.server_end import ServerRolloutEnd
from megatron_reshard.adapters.topology import MARK, Topology, free_port, this_host
from megatron_reshard.errors import BadInputError, CallOrderError
from megatron_reshard.groups import create_refit_group, destroy_refit_group
from megatron_reshard.megatron import MegatronRefitSource
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.receiver.misc_transport import receive_misc_packed
from megatron_reshard.receiver.worker_state import (
    RefitResult, RefitWorkerState, model_device, vllm_tp_coords)
from megatron_reshard.wire.codec import decode_payload


def is_training_process() -> bool:
    """Megatron's parallel state is initialized here: a training worker. The same engine
    class and options reach both sides, so this is how an engine learns its side."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps is not None and bool(ps.model_parallel_is_initialized())


class TrainEnd:
    """A training rank's end: its source (built once, on the first ``prepare``: collective
    over the training world), its stage's refit group and sender (kept across updates)."""

    def __init__(self, options: AdapterOptions, key: str, device: Optional[torch.device] = None):
        self.options, self.key = options, key
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if options.group_backend == "nccl" and torch.cuda.is_available()
                                 else torch.device("cpu"))
        self.source: Optional[MegatronRefitSource] = None
        self.port: Optional[int] = None
        self.host = options.host or this_host()
        self.topology: Optional[Topology] = None
        self.group: Any = None
        self.sender: Optional[RefitSender] = None

    def prepare(self) -> dict:
        o = self.options
        if self.source is None:
            model = model_from(o.model, "model", f"{self.key}.model",
                               "the Megatron model (chunks)")
            self.source = MegatronRefitSource(
                model, gen_parallelism={"tp_size": o.gen_tp, "ep_size": 1, "pp_size": 1},
                gen_world_size=o.gen_world_size, family=o.family, vocab_size=o.vocab_size)
        s = self.source
        if s.stage_local_rank == 0 and self.port is None:
            if o.ports is None:
                self.port = free_port(self.host)
            elif len(o.ports) != s.layout.pp:
                raise BadInputError(f"{self.key}.ports: {len(o.ports)} ports for {s.layout.pp} "
                                    f"PP stages (one per stage)")
            else:
                self.port = o.ports[s.stage]
        return {MARK: 1, "side": "train", "stage": s.stage, "pp": s.layout.pp,
                "stage_local_rank": s.stage_local_rank,
                "stage_world": s.layout.world_size // s.layout.pp,
                "host": self.host, "port": self.port, "gen_world": o.gen_world_size,
                "payload": s.payload_bytes() if dist.get_rank() == 0 else None}

    def join(self, topology: Topology) -> None:
        if self.source is None:
            raise CallOrderError("init before prepare: the training end has no source yet")
        if self.group is not None and topology == self.topology:
            return  # the framework re-sends the same topology every update: keep the group
        self.close()
        s, o = self.source, self.options
        self.group = create_refit_group(
            topology.host, topology.ports[s.stage], s.stage_local_rank,
            topology.stage_world + topology.gen_world, o.group_backend, o.timeout_s,
            device=self.device if self.device.type == "cuda" else None,
            label=f"refit group of PP stage {s.stage}")
        self.sender = RefitSender(s, self.group, device=self.device,
                                  verify_checksums=o.verify_checksums)
        self.topology = topology

    def send(self, version: Optional[int]) -> dict:
        if self.sender is None:
            raise CallOrderError("send_weights before the refit groups were joined "
                                 "(init_process_group)")
        return self.sender.refit(version)

    def close(self) -> None:
        group, self.group, self.sender, self.topology = self.group, None, None, None
        if group is not None:
            destroy_refit_group(group, self.options.timeout_s)


class RolloutEnd:
    """A rollout rank's end: the receiver's worker state writing into the vLLM model."""

    def __init__(self, options: AdapterOptions, key: str):
        self.options, self.key = options, key
        self.state = RefitWorkerState()
        self.model: Optional[torch.nn.Module] = None
        self.topology: Optional[Topology] = None
        self.rank: Optional[int] = None
        self.last: Optional[RefitResult] = None

    def prepare(self) -> dict:
        """Take the model now: a rollout worker without one refuses before any group forms."""
        if self.model is None:
            self.model = model_from(self.options.target, "target", f"{self.key}.target",
                                    "the vLLM model to write into (this process has no "
                                    "Megatron parallel state: taken for a rollout worker)")
        return {MARK: 1, "side": "rollout"}

    def join(self, topology: Topology, rollout_rank: int) -> None:
        if not 0 <= rollout_rank < topology.gen_world:
            raise BadInputError(f"rollout rank {rollout_rank} outside the {topology.gen_world} "
                                f"rollout workers")
        if self.topology == topology and self.rank == rollout_rank:
            return
        self.close()
        if self.model is None:
            raise CallOrderError("init before prepare: the rollout end has no model yet")
        o = self.options
        size = topology.stage_world + topology.gen_world
        self.state.join_groups(topology.host, list(topology.ports),
                               topology.stage_world + rollout_rank, size, o.group_backend,
                               o.timeout_s)
        model = self.model
        self.state.prepare(model, decode_payload(topology.payload),
                           {"verify_checksums": o.verify_checksums,
                            "keep_as_loaded": list(o.keep_as_loaded)},
                           receive_misc=lambda stage, group, items: receive_misc_packed(
                               stage, group, items, model_device(model)),
                           vllm_tp=vllm_tp_coords())
        self.topology, self.rank = topology, rollout_rank

    def receive(self, version: Optional[int] = None) -> RefitResult:
        """One refit into the model; with ``version`` the committed one must equal it."""
        if self.model is None or self.state.session is None:
            raise CallOrderError("receive_weights before the refit groups were joined "
                                 "(init_process_group)")
        self.last = self.state.refit(self.model, None)
        if version is not None and self.last.version != version:
            raise BadInputError(f"the refit committed version {self.last.version}, the "
                                f"framework announced {version}")
        return self.last

    def close(self) -> None:
        if self.state.groups is not None:
            self.state.destroy_groups(self.options.timeout_s)
        self.topology = self.rank = None


class AdapterEnds:
    """The end of this process (training or rollout, told by Megatron's parallel state),
    as both framework engines drive it; ``key`` is the options' configuration path."""

    def __init__(self, options: AdapterOptions, key: str):
        self.options, self.key = options, key
        self.train: Optional[TrainEnd] = None
        self.rollout: Optional[Union[RolloutEnd, ServerRolloutEnd]] = None

    def prepare(self) -> dict:
        if is_training_process():
            self.train = self.train or TrainEnd(self.options, self.key)
            return self.train.prepare()
        self.rollout = self.rollout or self._rollout_end()
        return self.rollout.prepare()

    def _rollout_end(self) -> Union[RolloutEnd, ServerRolloutEnd]:
        """In vLLM's process (a ``target``): write into its model; beside verl's vLLM server
        (a ``vllm_server``): drive vLLM's workers. Neither: refuse, naming both keys."""
        o = self.options
        target = o.target is not None or handed("target") is not None
        server = o.vllm_server is not None or handed("vllm_server") is not None
        if target and server:
            raise BadInputError(f"{self.key}.target / {self.key}.vllm_server: both given (set or "
                                f"handed off); a rollout worker either writes into the vLLM "
                                f"model it holds or drives verl's vLLM server, not both")
        if target:
            return RolloutEnd(o, self.key)
        if server:
            return ServerRolloutEnd(o, self.key)
        raise BadInputError(
            f"{self.key}.target / {self.key}.vllm_server: neither set, and nothing was handed "
            f"to this process (it has no Megatron parallel state: a rollout worker). In vLLM's "
            f"process set target to a 'module:function' returning the vLLM model or call "
            f"megatron_reshard.adapters.hand_off(target=...); beside verl's vLLM server set "
            f"vllm_server to its Ray actor name (docs/ADAPTERS.md)")

    @property
    def drives_vllm_server(self) -> bool:
        return isinstance(self.rollout, ServerRolloutEnd)

    def join(self, topology: Topology, rollout_rank: Optional[int]) -> None:
        """Join the refit groups: ``rollout_rank`` None on a training worker."""
        if (self.train is None) == (self.rollout is None):
            raise CallOrderError("init_process_group before prepare")
        if self.train is not None:
            if rollout_rank is not None:
                raise BadInputError(f"a training worker (Megatron's parallel state is "
                                    f"initialized) was given rollout rank {rollout_rank}")
            self.train.join(topology)
        else:
            if rollout_rank is None:
                raise BadInputError("a rollout worker (no Megatron parallel state) was given no "
                                    "rollout rank: the framework placed it among the training "
                                    "workers")
            self.rollout.join(topology, rollout_rank)

    async def send(self, weights: Any, version: Optional[int]) -> dict:
        """One refit from this training rank. ``weights``, the framework's iterator of full
        tensors, is closed unread: the gathers that would build them never start (the same
        on every training rank, so no collective is left half-entered)."""
        close = getattr(weights, "close", None)
        if callable(close):
            close()
        if self.train is None:
            raise CallOrderError("send_weights on a worker that prepared no training end")
        stats = await asyncio.to_thread(self.train.send, version)
        return {f"megatron_reshard/{k}": v for k, v in stats.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    async def receive(self, version: Optional[int]) -> dict:
        """One refit into vLLM's storage; its result as plain data."""
        if self.rollout is None:
            raise CallOrderError("receive_weights on a worker that prepared no rollout end")
        if isinstance(self.rollout, ServerRolloutEnd):
            return await self.rollout.receive(version)
        return (await asyncio.to_thread(self.rollout.receive, version)).as_dict()

    def close(self) -> None:
        for end in (self.train, self.rollout):
            if end is not None:
                end.close()


__all__ = ["AdapterEnds", "TrainEnd", "RolloutEnd", "Topology", "is_training_process", "MARK"]
