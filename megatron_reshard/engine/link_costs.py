"""The planner's optional link model: how replicas of a destination region complete.

With a ``LinkCosts`` (``Planner(costs=...)``; real refits pass one when
the refit group spans more than one node, ``refit.loop.choose_costs``) ``build_plan`` may split a
destination group into parts (``splits``) and keeps the split with the lowest estimated
time of its busiest rank (``RankLoads``), given the loads of the groups planned before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megatron_reshard.layout.geometry import box_numel


@dataclass(frozen=True)
class LinkCosts:
    """What the planner may assume about the links, for choosing how replicas complete.

    ``nodes``: ``(group rank, node id)`` pairs (ranks not listed are alone on their node);
    bandwidths in GB/s per GPU per direction; ``message_us`` the fixed cost of a message;
    ``elem_bytes`` the bytes per element the estimate assumes (layout keys carry no dtype);
    ``dst_weight`` how many refit groups share the destination ranks (training PP stages:
    a destination's links carry that many groups' traffic while a source carries one).
    Plain data: every rank must pass the same value, and it enters the plan fingerprint.
    """

    nodes: tuple = ()
    nvlink_gbps: float = 450.0
    net_gbps: float = 50.0
    message_us: float = 5.0
    elem_bytes: int = 2
    dst_weight: float = 1.0

    def node_map(self) -> dict:
        return dict(self.nodes)


@dataclass
class RankLoad:
    """One rank's load in a plan being built: elements over each link kind, and messages."""

    net_in: int = 0
    net_out: int = 0
    nvl_in: int = 0
    nvl_out: int = 0
    messages: int = 0

    def copy(self) -> "RankLoad":
        return RankLoad(self.net_in, self.net_out, self.nvl_in, self.nvl_out, self.messages)


class RankLoads:
    """Per-rank loads of a plan being built: the committed ones (groups already planned)
    and trial tables on top of them (one candidate split of the next group)."""

    def __init__(self, costs: LinkCosts, dst_ranks: Sequence[int]) -> None:
        self.node = costs.node_map()
        self.dst = set(dst_ranks)
        self.costs = costs
        self.committed: dict[int, RankLoad] = {}
        self.top = 0.0  # the busiest committed rank's estimate

    def _row(self, r: int, table: dict) -> RankLoad:
        row = table.get(r)
        if row is None:
            base = self.committed.get(r)
            row = table[r] = RankLoad() if base is None else base.copy()
        return row

    def add(self, ops: Sequence, table: Optional[dict] = None) -> dict:
        """Add ``ops``' loads to ``table`` (rows copied from the committed loads on first
        touch) and return it; ``commit(ops)`` adds them to the committed loads."""
        table = {} if table is None else table
        for op in ops:
            if op.src == op.dst:
                continue
            n = box_numel(op.box)
            near = self.node.get(op.src, ("r", op.src)) == self.node.get(op.dst, ("r", op.dst))
            src, dst = self._row(op.src, table), self._row(op.dst, table)
            if near:
                dst.nvl_in += n
                src.nvl_out += n
            else:
                dst.net_in += n
                src.net_out += n
            src.messages += 1
            dst.messages += 1
        return table

    def commit(self, ops: Sequence) -> None:
        self.add(ops, self.committed)

    def worst(self, table: Mapping[int, RankLoad]) -> float:
        """The estimated time of the busiest rank of ``table``."""
        c = self.costs
        net = 1e9 * c.net_gbps / c.elem_bytes
        nvl = 1e9 * c.nvlink_gbps / c.elem_bytes
        out = 0.0
        for r, load in table.items():
            t = (max(load.net_in, load.net_out) / net + max(load.nvl_in, load.nvl_out) / nvl
                 + load.messages * c.message_us * 1e-6)
            if r in self.dst:
                t *= c.dst_weight
            out = max(out, t)
        return out


def splits(members: list, node: Mapping) -> list:
    """Candidate partitions of a destination group: one part per member, one part per node
    (when that differs from both others), the whole group (evaluated last, kept on ties)."""
    by_node: dict = {}
    for m in members:
        by_node.setdefault(node.get(m, ("r", m)), []).append(m)
    per_node = list(by_node.values())
    out = [[[m] for m in members]]
    if 1 < len(per_node) < len(members):
        out.append(per_node)
    out.append([members])
    return out
