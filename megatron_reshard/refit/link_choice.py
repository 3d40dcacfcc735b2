"""Which link model a refit group's plans use, from what its ranks agreed on in the plan
check (``refit.loop.RefitLoop.verify_plan``): each rank's node code, the planner option,
and how many stages' traffic a destination carries (docs/DESIGN.md, "Which planner a refit
uses"). Torch + stdlib only (the receiver imports it)."""

from __future__ import annotations

import hashlib
import math
import socket
from typing import Mapping, Optional, Sequence

from megatron_reshard.engine.link_costs import LinkCosts
from megatron_reshard.wire.records import ParamRecord


def node_code(node: Optional[str]) -> int:
    """A 62-bit code of a node's name (the host name when None): equal names, equal codes
    on every process, so the ranks of a group can tell who shares a node."""
    name = socket.gethostname() if node is None else str(node)
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 62) - 1)


def choose_costs(planner: str, nodes: Sequence[int], dst_weight: float) -> Optional[LinkCosts]:
    """The link model a group's plans use, from what every rank of it agreed on: its
    ranks' node codes by group rank. None: the default planner. ``"auto"`` is link-aware
    when the group spans more than one node (docs/DESIGN.md, "Which planner a refit uses").
    ``dst_weight``: how many stages' traffic a destination's links carry
    (``stage_weight``)."""
    if planner == "default" or (planner == "auto" and len(set(nodes)) < 2):
        return None
    return LinkCosts(tuple(enumerate(int(n) for n in nodes)), dst_weight=dst_weight)


def stage_weight(stages: Mapping[int, Sequence[ParamRecord]]) -> float:
    """A generation rank takes part in every stage's group, a training rank in its own:
    the job's bulk bytes over the heaviest stage's (the PP size when stages are even), as
    the simulator weighs them (``tools.simulate.link_costs``). Payload-derived."""
    sizes = [sum(math.prod(p.global_shape) * p.torch_dtype.itemsize for p in ps)
             for ps in stages.values()]
    top = max(sizes, default=0)
    return round(sum(sizes) / top, 3) if top else 1.0


__all__ = ["choose_costs", "node_code", "stage_weight"]
