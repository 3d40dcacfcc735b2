"""Exact transfer plans: who sends which box to whom, as plain data, cached by layout.

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

With a ``LinkCosts`` (``Planner(costs=...)``, off by default) a destination group may
instead be split into parts, each served from the sources and completed inside itself:
one part per node (replicas on one node complete over NVLink, each node pulling the
region once) or one part per member (every member served directly, no phase 1: cheaper
for small regions shared by many replicas, where an exchange costs ~2k messages per
member). Each group takes the split with the lowest estimated time of its busiest rank,
given the loads of the groups planned before it; ties keep the single group.
"""

from __future__ import annotations

import gc
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional, Sequence

import torch

from .geometry import (Box, Ownership, box_intersect, box_numel, placement_dims,
                       shard_ownerships)

LayoutKey = tuple  # (global_shape, src_shape, src_ranks, src_dims, dst_shape, dst_ranks, dst_dims)


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
        return {"key": self.key, "ops": [tuple(op) for op in self.ops]}


class PlanError(RuntimeError):
    """A plan that would leave a destination element unwritten or write it twice (a bug)."""


def check_writes_exactly_once(plan: ParamPlan) -> None:
    """Prove that the plan writes every element of every destination piece exactly once.

    Per destination (rank, piece): every op box lies inside the piece's box, no two op
    boxes overlap, and their sizes add up to the piece's. Linear in the ops but for the
    pairwise overlap test inside one piece (a handful of boxes). Run on every rank when a
    plan is built; a failure is a planner bug, never bad input, and nothing has moved yet.
    """
    by_piece: dict = {}
    for op in plan.ops:
        by_piece.setdefault((op.dst, op.dst_piece), []).append(op.box)
    for rank, own in plan.dst.items():
        for index, piece in enumerate(own.pieces):
            boxes = by_piece.pop((rank, index), [])
            problem = _tiling_problem(piece.box, boxes)
            if problem:
                raise PlanError(f"plan for layout {plan.key!r}: destination rank {rank}, piece "
                                f"{index} {list(piece.box)}: {problem}")
    if by_piece:
        raise PlanError(f"plan for layout {plan.key!r}: ops write pieces no destination has: "
                        f"{sorted(by_piece)}")


def _tiling_problem(target: Box, boxes: list) -> str:
    for b in boxes:
        if box_intersect(b, target) != tuple(b):
            return f"op box {list(b)} reaches outside it"
    total = sum(box_numel(b) for b in boxes)
    if total != box_numel(target):
        return f"ops write {total} elements of its {box_numel(target)}"
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b[0][0] >= a[0][1]:
                break  # sorted by the first dim's start: no later box reaches back into a
            if box_intersect(a, b) is not None:
                return f"op boxes {list(a)} and {list(b)} overlap"
    return ""


def layout_key(global_shape: Sequence[int], src_mesh, src_placements, dst_mesh,
               dst_placements, where: str = "xfer") -> LayoutKey:
    """Plain-data key of a layout pair; validates placements against shape and meshes."""
    shape = tuple(int(n) for n in global_shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"{where}: global_shape must be non-negative, found {shape}")
    parts = []
    for side, mesh, placements in (("src", src_mesh, src_placements),
                                   ("dst", dst_mesh, dst_placements)):
        mshape, ranks = _mesh_key(mesh)
        if len(placements) != len(mshape):
            raise ValueError(f"{where}: {side} placement count != mesh ndim: expected "
                             f"{len(mshape)} placements for mesh shape {mshape}, found "
                             f"{len(placements)} ({list(placements)})")
        parts += [mshape, ranks, placement_dims(placements, len(shape), f"{where}: {side}")]
    return (shape, *parts)


def _mesh_key(mesh) -> tuple:
    if hasattr(mesh, "key"):
        return mesh.key()
    t = mesh.mesh if hasattr(mesh, "mesh") else mesh
    return (tuple(t.shape), tuple(int(r) for r in t.flatten().tolist()))


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


class _Loads:
    """Per-rank loads of a plan being built, in elements and messages (LinkCosts mode)."""

    def __init__(self, costs: LinkCosts, dst_ranks: Sequence[int]) -> None:
        self.node = costs.node_map()
        self.dst = set(dst_ranks)
        self.costs = costs
        self.v: dict = {}  # rank -> [net_in, net_out, nvl_in, nvl_out, messages]
        self.top = 0.0  # the busiest committed rank's estimate

    def _row(self, r: int, table: dict) -> list:
        row = table.get(r)
        if row is None:
            row = table[r] = list(self.v.get(r, (0, 0, 0, 0, 0)))
        return row

    def add(self, ops: Sequence[Op], table: Optional[dict] = None) -> dict:
        """Add ``ops``' loads to ``table`` (rows copied from the committed loads on first
        touch) and return it; ``add(ops, self.v)`` commits them."""
        table = {} if table is None else table
        for op in ops:
            if op.src == op.dst:
                continue
            n = box_numel(op.box)
            near = self.node.get(op.src, ("r", op.src)) == self.node.get(op.dst, ("r", op.dst))
            src, dst = self._row(op.src, table), self._row(op.dst, table)
            dst[2 if near else 0] += n
            src[3 if near else 1] += n
            src[4] += 1
            dst[4] += 1
        return table

    def worst(self, table: dict) -> float:
        c = self.costs
        net = 1e9 * c.net_gbps / c.elem_bytes
        nvl = 1e9 * c.nvlink_gbps / c.elem_bytes
        out = 0.0
        for r, (ni, no, vi, vo, m) in table.items():
            t = max(ni, no) / net + max(vi, vo) / nvl + m * c.message_us * 1e-6
            if r in self.dst:
                t *= c.dst_weight
            out = max(out, t)
        return out


def build_plan(key: LayoutKey, costs: Optional[LinkCosts] = None) -> ParamPlan:
    """Compute the plan for one layout key (see the module docstring for the rules)."""
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

    loads = _Loads(costs, d_ranks) if costs is not None else None
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
        for parts in _splits(rest, loads.node):
            if best is not None and len(parts) == 1:
                # One exchange among k members costs each owner k-1 messages: skip building
                # its k*(k-1) ops when that alone loses (thousands of replicas of a norm).
                bound = (len(rest) - 1) * costs.message_us * 1e-6 * costs.dst_weight
                if (max(loads.top, bound), bound) > best[0]:
                    continue
            trial_ops: list[Op] = []
            trial_load = dict(load)
            for part in parts:
                complete(part, boxes, trial_ops, trial_load)
            touched = loads.worst(loads.add(trial_ops))
            cost = (max(loads.top, touched), touched)
            if best is None or cost <= best[0]:  # on ties the later, fewer-part split
                best = (cost, trial_ops, trial_load)
        ops.extend(best[1])
        load = best[2]
        loads.add(best[1], loads.v)
        loads.top = best[0][0]
    ops = _spread_over_holders(ops, src_groups)
    ops.sort(key=lambda op: op.phase)  # stable: phase 0 first, plan order kept inside
    plain = repr((key, [tuple.__repr__(op) for op in ops]))
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


def _splits(members: list, node: Mapping) -> list:
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


@contextmanager
def gc_paused():
    """Pause Python's cyclic GC inside: the engine allocates many small acyclic tuples
    (plans, batch keys, views), and the GC passes they trigger walk every object the
    caches hold: ~40% of cold planning time, and ~90 ms of a warm 10,000-param lookup that
    takes 10 ms without them. Garbage is collected as usual once it is resumed."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_STAGING_STREAMS = 4  # streams with kept staging slots per Planner (see staging_slots)


class Planner:
    """Owns the caches of one refit session: plans (layout key -> ParamPlan), validated
    layout keys, per-batch state per group (fingerprint, schedule, execution programs),
    the agreement step's reusable vote buffers and the CUDA staging slots.

    Everything cached is computed from plain data (layout tuples, names, dtypes,
    placements, tensor strides, the ranks' agreed stride signatures; never from tensors'
    contents or mesh object identity), so a cache hit gives exactly what recomputing
    would. One planner per refit session; ``clear()`` drops everything deterministically.
    """

    def __init__(self, costs: Optional[LinkCosts] = None) -> None:
        self.costs = costs  # None: the default plans (no link model)
        self._plans: dict[LayoutKey, ParamPlan] = {}
        self._layouts: dict[tuple, LayoutKey] = {}
        self._batches: dict[int, dict[tuple, object]] = {}  # group scope -> batches
        self._by_rows: dict[int, dict[tuple, tuple]] = {}  # scope -> head -> (batch, rows)
        self._votes: dict[tuple, tuple] = {}  # (device, n) -> agreement buffers
        self._staging: dict[tuple, list] = {}  # (device index, stream) -> two CUDA slots

    def plan(self, key: LayoutKey) -> ParamPlan:
        got = self._plans.get(key)
        if got is None:
            got = build_plan(key, self.costs)
            check_writes_exactly_once(got)
            self._plans[key] = got
        return got

    def plan_all(self, keys: Sequence[LayoutKey]) -> list[ParamPlan]:
        """Plans for many keys (with the cyclic GC paused, see ``gc_paused``)."""
        with gc_paused():
            return [self.plan(k) for k in keys]

    def layout(self, light: tuple, build) -> LayoutKey:
        """The validated layout key for ``light`` (a hashable description of the layout
        made of plain keys and placement objects), from ``build()`` on first use. ``build``
        raises on invalid layouts, so only valid ones are cached."""
        got = self._layouts.get(light)
        if got is None:
            got = build()
            self._layouts[light] = got
        return got

    def batch(self, scope: int, key: tuple) -> Optional[object]:
        """Cached per-batch state for ``key`` in ``scope`` (one group), or None."""
        return self._batches.get(scope, {}).get(key)

    def remember_batch(self, scope: int, key: tuple, value: object) -> None:
        # One cache per group, bounded against callers whose batches never repeat. Every
        # rank of a group calls the same batches on it in the same order, so its ranks
        # clear their caches at the same call: a batch is then rebuilt (and agreed) on all
        # of them at once, whatever other groups a rank also serves. Generous: a refit loop
        # cycles through all its batches (one per ~512 MiB of weights), and a bound below
        # that count would clear the cache before any batch came round again.
        batches = self._batches.setdefault(scope, {})
        if len(batches) >= 1024:
            batches.clear()
        batches[key] = value

    def batch_by_rows(self, scope: int, head: tuple, rows: list) -> Optional[object]:
        """The batch remembered under ``head`` if it was built from these ``rows``
        (``batch.layout_rows``), else None."""
        got = self._by_rows.get(scope, {}).get(head)
        return got[0] if got is not None and got[1] == rows else None

    def remember_rows(self, scope: int, head: tuple, batch: object, rows: list) -> None:
        """Remember ``batch`` with the rows it was built from; bounded and cleared like
        ``remember_batch``; a miss only costs the light key."""
        known = self._by_rows.setdefault(scope, {})
        if len(known) >= 1024:
            known.clear()
        known[head] = (batch, rows)

    def vote_buffers(self, device, n: int) -> tuple:
        """Reused buffers of the agreement step on a CUDA device: pinned host in/out
        and device int64[n] (allocating and pinning them on each call costs ~50 µs)."""
        key = (device, n)
        got = self._votes.get(key)
        if got is None:
            got = self._votes[key] = (
                torch.empty(n, dtype=torch.int64).pin_memory(),
                torch.empty(n, dtype=torch.int64, device=device),
                torch.empty(n, dtype=torch.int64).pin_memory())
        return got

    def staging_slots(self, device: torch.device, nbytes: int) -> list:
        """The two CUDA staging slots (uint8, at least ``nbytes`` each) of calls on the
        current stream, kept across calls.

        Kept, not allocated per call: NCCL holds every buffer it sends or receives until
        its stream is past it (``recordStream``), so slots freed at the end of each call
        stay unusable while the host queues the next calls, and a caller that never syncs
        (the refit loop's generation side) made the allocator reserve new ones for every
        batch in flight: 2.1 GiB for a 256 MiB budget (docs/MEASUREMENTS.md). Reusing the
        same slots in the same stream's order is safe without any sync: each call joins
        its side stream and NCCL's work into the current stream before it returns. One
        pair per stream (at most ``_STAGING_STREAMS``, least recently used dropped);
        ``release_staging()`` gives them back."""
        stream = torch.cuda.current_stream(device)
        key = (stream.device_index, stream.cuda_stream)
        got = self._staging.pop(key, None)
        if got is not None and got[0].numel() < nbytes:
            got = None  # the smaller pair goes back to the allocator before the new one
        if got is None:
            got = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self._staging[key] = got  # most recently used last
        while len(self._staging) > _STAGING_STREAMS:
            del self._staging[next(iter(self._staging))]
        return got

    def release_staging(self) -> None:
        """Drop the kept CUDA staging slots (the allocator reuses them once the streams
        that used them are past)."""
        self._staging.clear()

    def clear(self) -> None:
        self._plans.clear()
        self._layouts.clear()
        self._batches.clear()
        self._by_rows.clear()
        self._votes.clear()
        self._staging.clear()

    def __len__(self) -> int:
        return len(self._plans)


def batch_fingerprint(items: Sequence[tuple]) -> str:
    """Stable hash of a batch description: (name, dtype string, plan fingerprint) items."""
    h = hashlib.blake2b(digest_size=12)
    for name, dtype, fp in items:
        h.update(f"{name}\x00{dtype}\x00{fp}\x01".encode())
    return h.hexdigest()
