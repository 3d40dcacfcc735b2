"""The refit topology the frameworks' metadata lists carry: which refit groups the workers
join (one per training PP stage), where their stores listen, and the training side's
payload. Plain data, checked whole on every worker (or the driver) before any group forms."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_reshard.errors import BadInputError

MARK = "megatron_reshard"  # in every metadata entry: a list from another engine is refused


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def this_host() -> str:
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class Topology:
    """The refit groups, read from the framework's metadata list (training entries first):
    one group per PP stage of ``stage_world`` training ranks + ``gen_world`` rollout ranks,
    its store at ``host:ports[stage]``."""

    host: str
    ports: tuple
    stage_world: int
    gen_world: int
    payload: bytes

    @classmethod
    def of(cls, metadata: Sequence[Any], train_world: int, rollout_world: int,
           key: str) -> "Topology":
        if len(metadata) != train_world + rollout_world:
            raise BadInputError(f"metadata: {len(metadata)} entries for {train_world} training "
                                f"+ {rollout_world} rollout workers")
        sides = [m.get("side") if isinstance(m, dict) and m.get(MARK) else None
                 for m in metadata]
        if None in sides:
            raise BadInputError(f"metadata[{sides.index(None)}]: not from a megatron_reshard "
                                f"engine ({metadata[sides.index(None)]!r:.200})")
        expected = ["train"] * train_world + ["rollout"] * rollout_world
        if sides != expected:
            raise BadInputError(f"metadata sides {sides}, expected {expected}: a training "
                                f"worker without Megatron's parallel state, or a rollout "
                                f"worker with it")
        train = metadata[:train_world]
        first = {m["stage"]: m for m in train if m["stage_local_rank"] == 0}
        pp, stage_world = train[0]["pp"], train[0]["stage_world"]
        if sorted(first) != list(range(pp)) or pp * stage_world != train_world:
            raise BadInputError(f"metadata: training ranks by stage {sorted(first)} do not make "
                                f"PP {pp} x {stage_world} ranks = {train_world} workers")
        hosts = {m["host"] for m in first.values()}
        if len(hosts) != 1:
            raise BadInputError(f"{key}.host: the first training ranks of the PP stages are on "
                                f"{sorted(hosts)}; the refit groups' stores need one host")
        payloads = [m["payload"] for m in train if m.get("payload") is not None]
        gen_world = train[0]["gen_world"]
        if rollout_world != gen_world:
            raise BadInputError(f"{key}.gen_world_size: {gen_world}, but the framework has "
                                f"{rollout_world} rollout workers")
        if len(payloads) != 1:
            raise BadInputError(f"metadata: {len(payloads)} payloads, expected one (training "
                                f"rank 0's)")
        return cls(host=hosts.pop(), ports=tuple(first[s]["port"] for s in range(pp)),
                   stage_world=stage_world, gen_world=gen_world, payload=payloads[0])

    def as_dict(self) -> dict:
        """Plain data, for frameworks that hand each worker its own arguments."""
        return {"host": self.host, "ports": list(self.ports), "stage_world": self.stage_world,
                "gen_world": self.gen_world, "payload": self.payload}

    @classmethod
    def from_dict(cls, d: dict) -> "Topology":
        return cls(host=d["host"], ports=tuple(d["ports"]), stage_world=d["stage_world"],
                   gen_world=d["gen_world"], payload=d["payload"])


__all__ = ["MARK", "Topology", "free_port", "this_host"]
