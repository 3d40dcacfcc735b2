"""The plan of one param: who sends which box to whom, as plain data, from its layout key.

A plan depends only on the layout key ``(global_shape, src mesh, src placements, dst mesh,
dst placements)`` (plain tuples), never on tensors, so every rank computes the same plan
and the same op order. Ops come in two phases:

- phase 0: sources -> destination *targets* (or a local copy when a rank is on both sides);
- phase 1: replica completion inside a destination group, from the member that received a
  region in phase 0 (read from its destination tensor) to the other members.

Destination ranks with identical regions form one group. Each region piece is split into
``k`` balanced stripes along its first dim of extent >= k (dim 0 when possible, so stripes
are contiguous); each member receives one stripe from the sources and the members then
exchange stripes point-to-point (an all-gather made of P2P sends, because collectives on a
subset of an unregistered group are impractical). A piece too small to stripe goes whole
to one member (the representative) which forwards it to the others (a P2P broadcast).
Members that already hold the whole region as sources copy it locally and leave the group.
Replicated sources are deduplicated: each intersection is read from one holder, the
destination itself when it is a holder, else the holder with the least bytes so far. When
a plan reads a replicated piece fewer times than it has holders (training DP replicas
feeding one generation replica), each large read is split into one stripe per holder, so
that every replica sends its share instead of the first one sending everything.

With a ``LinkCosts`` (``Planner(costs=...)``, ``link_costs.py``; real refits use one when the
group spans nodes, ``refit.loop.choose_costs``) a
destination group may instead be split into parts, each served from the sources and
completed inside itself: one part per node (replicas on one node complete over NVLink,
each node pulling the region once) or one part per member (every member served directly, no phase 1: cheaper
for small regions shared by many replicas, where an exchange costs ~2k messages per
member). Each group takes the split with the lowest estimated time of its busiest rank,
given the loads of the groups planned before it; ties keep the single group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional

from megatron_reshard.layout.geometry import Box, Ownership, box_intersect, box_numel, shard_ownerships
from .link_costs import LinkCosts, RankLoads, splits


class LayoutKey(NamedTuple):
    """What a plan depends on, as plain tuples (``plan.layout_key`` builds and validates it):
    the global shape and, per side, the mesh shape, its ranks in mesh order and per mesh
    axis the tensor dim it shards (``geometry.placement_dims``)."""

    global_shape: tuple
    src_mesh_shape: tuple
    src_ranks: tuple
    src_dims: tuple
    dst_mesh_shape: tuple
    dst_ranks: tuple
    dst_dims: tuple


class Op(NamedTuple):
    """One box moving from ``src`` to ``dst`` (a local copy when they are equal).

    ``src_piece`` indexes the sender's source pieces in phase 0 and its destination pieces
    in phase 1; ``dst_piece`` indexes the receiver's destination pieces.
    """

    phase: int
    src: int
    src_piece: int
    dst: int
    dst_piece: int
    box: Box


@dataclass(frozen=True)
class ParamPlan:
    key: LayoutKey
    src: dict  # rank -> Ownership
    dst: dict  # rank -> Ownership
    ops: tuple  # tuple[Op, ...]
    fingerprint: str
    _by_rank: dict = field(default_factory=dict, compare=False, repr=False)

    def ops_of(self, rank: int) -> tuple:
        """The ops this rank takes part in (memoised; plan order kept)."""
        got = self._by_rank.get(rank)
        if got is None:
            got = tuple(op for op in self.ops if op.src == rank or op.dst == rank)
            self._by_rank[rank] = got
        return got

    def to_plain(self) -> dict:
        return {"key": tuple(self.key), "ops": [tuple(op) for op in self.ops]}


def _balanced(n: int, k: int) -> list[tuple[int, int]]:
    q, r = divmod(n, k)
    out, s = [], 0
    for i in range(k):
        e = s + q + (1 if i < r else 0)
        out.append((s, e))
        s = e
    return out


def _overlap(box: Box, own: Optional[Ownership]) -> int:
    if own is None:
        return 0
    total = 0
    for p in own.pieces:
        hit = box_intersect(box, p.box)
        if hit is not None:
            total += box_numel(hit)
    return total


class SplitCost(NamedTuple):
    """How a split of a destination group is ranked (lower is better, compared in order):
    the busiest rank's estimate over the whole plan so far, then over the ranks it touches."""

    worst: float
    touched: float


class _Split(NamedTuple):
    """The best split of a destination group so far: its cost, its ops, the sources' loads."""

    cost: SplitCost
    ops: list
    load: dict


def build_plan(key: LayoutKey, costs: Optional[LinkCosts] = None) -> ParamPlan:
    """Compute the plan for one layout key (see the module docstring for the rules)."""
    key = LayoutKey(*key)  # callers may build it as a plain tuple
    shape, s_shape, s_ranks, s_dims, d_shape, d_ranks, d_dims = key
    src = shard_ownerships(shape, s_shape, s_ranks, s_dims)
    dst = shard_ownerships(shape, d_shape, d_ranks, d_dims)

    # Source groups: ranks holding identical boxes are interchangeable holders.
    src_groups: dict[tuple, list[int]] = {}
    for r in s_ranks:
        boxes = src[r].boxes
        if boxes:
            src_groups.setdefault(boxes, []).append(r)
    src_pieces = [(pi, p.box, holders) for boxes, holders in src_groups.items()
                  for pi, p in enumerate(src[holders[0]].pieces)]
    load = {r: 0 for r in s_ranks}
    ops: list[Op] = []

    def serve(member: int, dpi: int, target: Box, out: list, load: dict) -> None:
        for spi, sbox, holders in src_pieces:
            hit = box_intersect(target, sbox)
            if hit is None:
                continue
            if member in src and member in holders:
                holder = member
            else:
                holder = min(holders, key=load.__getitem__)  # first of the least loaded
                load[holder] += box_numel(hit)
            out.append(Op(0, holder, spi, member, dpi, hit))

    def complete(part: list, boxes: tuple, out: list, load: dict) -> None:
        """Serve one stripe per member of ``part`` from the sources, then exchange them."""
        k = len(part)
        for dpi, b in enumerate(boxes):
            stripes = (_stripes(b, k) if k > 1 else None) or [b]
            free = list(part)
            for stripe in stripes:
                # Give each stripe to the free member that already holds most of it.
                owner = max(free, key=lambda m: (_overlap(stripe, src.get(m)), -free.index(m)))
                free.remove(owner)
                serve(owner, dpi, stripe, out, load)
                for other in part:
                    if other != owner:
                        out.append(Op(1, owner, dpi, other, dpi, stripe))

    loads = RankLoads(costs, d_ranks) if costs is not None else None
    dst_groups: dict[tuple, list[int]] = {}
    for r in d_ranks:
        boxes = dst[r].boxes
        if boxes:
            dst_groups.setdefault(boxes, []).append(r)
    for boxes, members in dst_groups.items():
        region_numel = sum(box_numel(b) for b in boxes)
        local = [m for m in members
                 if m in src and sum(_overlap(b, src[m]) for b in boxes) == region_numel]
        for m in local:  # holds the whole region already: local copies only
            for dpi, b in enumerate(boxes):
                serve(m, dpi, b, ops, load)
        rest = [m for m in members if m not in local]
        if not rest:
            continue
        if loads is None or len(rest) == 1:
            complete(rest, boxes, ops, load)
            continue
        best = None
        for parts in splits(rest, loads.node):
            if best is not None and len(parts) == 1:
                # One exchange among k members costs each owner k-1 messages: skip building
                # its k*(k-1) ops when that alone loses (thousands of replicas of a norm).
                bound = (len(rest) - 1) * costs.message_us * 1e-6 * costs.dst_weight
                if SplitCost(max(loads.top, bound), bound) > best.cost:
                    continue
            trial_ops: list[Op] = []
            trial_load = dict(load)
            for part in parts:
                complete(part, boxes, trial_ops, trial_load)
            touched = loads.worst(loads.add(trial_ops))
            cost = SplitCost(max(loads.top, touched), touched)
            if best is None or cost <= best.cost:  # on ties the later, fewer-part split
                best = _Split(cost, trial_ops, trial_load)
        ops.extend(best.ops)
        load = best.load
        loads.commit(best.ops)
        loads.top = best.cost.worst
    ops = _spread_over_holders(ops, src_groups)
    ops.sort(key=lambda op: op.phase)  # stable: phase 0 first, plan order kept inside
    plain = repr((tuple(key), [tuple.__repr__(op) for op in ops]))
    if costs is not None:
        plain += repr(costs)
    fp = hashlib.blake2b(plain.encode(), digest_size=12).hexdigest()
    return ParamPlan(key, src, dst, tuple(ops), fp)


_MIN_SPREAD_STRIPE = 1 << 16  # elements: below ~128 KiB a message's fixed cost dominates


def _spread_over_holders(ops: list, src_groups: Mapping) -> list:
    """Replicated sources that would serve fewer reads than they have holders (training DP
    replicas feeding one generation replica: each plan reads every shard once, and the
    least-loaded rule alone picks the same first holder in every param) read each box in
    equal stripes, one from every holder, when each stripe is large enough to pay for its
    message. Reads a holder makes for itself (local copies) are left as they are."""
    holders_of = {r: tuple(h) for h in src_groups.values() if len(h) > 1 for r in h}
    if not holders_of:
        return ops
    free: dict = {}
    for i, op in enumerate(ops):
        group = holders_of.get(op.src)
        if op.phase == 0 and group is not None and op.dst not in group:
            free.setdefault(group, []).append(i)
    out = list(ops)
    for group, idx in free.items():
        h = len(group)
        if len(idx) >= h:
            continue  # enough reads to spread whole (least-loaded holder each)
        for i in idx:
            op = ops[i]
            stripes = _stripes(op.box, h)
            if stripes is None or box_numel(op.box) < h * _MIN_SPREAD_STRIPE:
                continue
            out[i] = [op._replace(src=holder, box=b) for holder, b in zip(group, stripes)]
    return [x for item in out for x in (item if isinstance(item, list) else (item,))]


def _stripes(box: Box, k: int) -> Optional[list]:
    """``box`` in ``k`` balanced stripes along its first dim of extent >= k (None: none)."""
    dim = next((d for d, (s, e) in enumerate(box) if e - s >= k), None)
    if dim is None:
        return None
    base = box[dim][0]
    return [box[:dim] + ((base + s, base + e),) + box[dim + 1:]
            for s, e in _balanced(box[dim][1] - base, k)]
