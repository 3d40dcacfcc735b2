"""Batched execution: validate, agree, schedule into bounded rounds, move the bytes.

``xfer_batch`` runs, on every rank of the group, in this order:

1. plain-data checks of every transfer (placements, shard dims, mesh ranks inside the
   group, dtype given): identical on all ranks, so a bad description raises everywhere;
2. plans from the planner (cached by layout key); with a ``Planner`` passed across calls,
   steps 1-2 and everything else that depends only on the batch description (its
   fingerprint, the schedule, the resolved views) are cached per batch, so a repeated
   call skips them;
3. local checks of this rank's tensors (side membership, shape, dtype, device);
4. the *agreement step*: one small MAX all-reduce over the group carrying one error slot per
   rank, the batch fingerprint (as ``fp`` and ``-fp``), the hash of what this rank's
   cached schedule was built for (as ``h`` and ``-h``), and one slot per rank with a
   signature of which of its tensors are not standard-contiguous. A local error on any
   rank, or ranks whose descriptions differ, make every rank raise ``ValueError`` before
   any data moves (the failing rank with the detailed message, the others naming it). On
   NCCL this all-reduce also creates the group communicator that coalesced P2P rounds use;
5. the schedule (kept only when every rank's cache holds one built for the signatures
   voted now, so every rank decides alike; when a rank has strided tensors, one more
   all-reduce tells every rank which): an op whose box is contiguous on both
   ends and large (``DIRECT_MIN_BYTES``) goes whole, straight from tensor to tensor, in
   the first round (no staging).
   The rest is staged: per phase, R rounds with R the fewest that keep every rank within
   ``staging_bytes``, each peer pair's traffic cut into R messages (boxes cut in
   row-major order, segments at 16-byte aligned offsets), message k of every pair in
   round k, so that each round's NCCL group carries all pairs at once (identical on
   every rank, computed from plain data); R >= 2 where a pair stages 32 MiB or more, so
   that one round's copies overlap another's transfer;
6. rounds: pack staged sends, post every send/recv of the round, run local copies while
   the first round is in flight, wait, unpack staged receives. A message made of one
   segment whose view is contiguous on this side goes straight from/to the tensor.
   Copies are batched (``torch._foreach_copy_``): contiguous ones as bytes in one call
   (those of 16 MiB or more one memcpy each), strided ones as 8- or 4-byte words where
   their geometry and addresses allow.
   On CUDA the copies leave the critical path: round k+1 is packed and round k-1 unpacked
   on a side stream while round k is on the wire (two staging slots, so the schedule is
   built with half the budget and the staging memory stays within ``staging_bytes``);
   with a cached schedule the first round is packed during the agreement step. Rounds
   with nothing staged (direct messages only) are posted without the side stream.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from typing import NamedTuple, Optional, Sequence

import torch

from .geometry import box_numel, box_shape
from .plan import (ParamPlan, Planner, _mesh_key, batch_fingerprint, gc_paused,
                   layout_key)
from .transport import P2PTransport, backend_name, resolve_group

_ALIGN = 16
MIN_STAGING_BYTES = 64
_NO_VOTE = -(2 ** 62)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def cut_box(box, itemsize: int, room: int) -> tuple:
    """``(head, rest)``: the longest row-major prefix of ``box`` that is one box of at most
    ``room`` bytes (None when not even one element fits) and the boxes that cover the
    rest of ``box``, in row-major order."""
    if box_numel(box) * itemsize <= room:
        return box, []
    if not box:  # a 0-d box is one element
        return None, [box]
    (s, e), tail = box[0], box[1:]
    row = box_numel(tail) * itemsize  # bytes of one index of the first dim
    k = room // row
    if k:
        return ((s, s + k),) + tail, [((s + k, e),) + tail]
    head, rest = cut_box(tail, itemsize, room)  # one index is too big: cut inside it
    if head is None:
        return None, [box]
    first = (s, s + 1)
    return (first,) + head, [(first,) + b for b in rest] + (
        [((s + 1, e),) + tail] if s + 1 < e else [])


class _Schedule:
    """This rank's share of the global schedule (plain data, cached per batch)."""

    def __init__(self) -> None:
        self.local: list = []   # (ti, src_piece, dst_piece, box)
        self.nrounds = 0        # rounds in the global schedule (this rank may skip some)
        # [(phase, global round id, [(is_send, peer, tag, segments, nbytes, direct)])]
        self.rounds: list = []


# Smaller ops are staged even when they could go straight: each NCCL message costs
# ~20 µs of posting and launch (1000 small direct messages: 32 ms, staged: 14 ms, on
# H200), more than packing them into one message.
DIRECT_MIN_BYTES = 16 << 20

# A pair's traffic is not cut into messages smaller than this (or than an eighth of the
# budget): tiny messages only add launches.
MIN_MESSAGE_BYTES = 1 << 20

# Staged traffic with a pair of at least this much goes in two rounds or more, even when
# one fits the budget: one round's pack or unpack then overlaps the other's transfer
# (1 -> 1, 128 MiB into a strided destination on H200: 668-765 µs in one round, 590 in
# two, 576 in four; from a strided source 637-656 -> 596).
SPLIT_MIN_BYTES = 32 << 20


def _message_sizes(pair_bytes: dict, cap: int) -> dict:
    """Per peer pair, the size of its messages: ``ceil(bytes / R)`` (aligned, at least
    MIN_MESSAGE_BYTES or ``cap / 8``, at most ``cap``) for the fewest rounds R such that one
    message of each pair per round keeps every rank within ``cap`` (and R >= 2 when a
    pair moves SPLIT_MIN_BYTES or more).

    Every round then carries all peer pairs at once: one NCCL group per round uses every
    link, where rounds of whole messages would serialise the pairs of a rank (measured:
    ~285 vs ~227 GB/s per destination for a 2×2 exchange, ../shared/GPU.md)."""
    load: dict = {}
    for (s, d), nb in pair_bytes.items():
        load[s] = load.get(s, 0) + nb
        load[d] = load.get(d, 0) + nb
    least = 2 if max(pair_bytes.values(), default=0) >= SPLIT_MIN_BYTES else 1
    first = rounds = max(least, -(-max(load.values(), default=0) // cap))
    previous, floor = None, min(MIN_MESSAGE_BYTES, cap // 8)
    while True:
        size = {p: min(cap, max(_align(-(-nb // rounds)), floor))
                for p, nb in pair_bytes.items()}
        per_rank: dict = {}
        for (s, d), m in size.items():
            per_rank[s] = per_rank.get(s, 0) + m
            per_rank[d] = per_rank.get(d, 0) + m
        # stop when it fits, or when more rounds no longer shrink messages (minimum size):
        # the placement then spills the excess into extra rounds
        if all(v <= cap for v in per_rank.values()) or size == previous or rounds >= 4 * first:
            return size
        previous, rounds = size, rounds + 1


def _cut_messages(segs: list, itemsize_of, size: int) -> list:
    """A pair's segments ``(ti, src_piece, dst_piece, box)`` packed in order into messages
    of at most ``size`` bytes, boxes cut where a message fills up. Returns
    ``[(segments, nbytes)]`` with segments ``(ti, src_piece, dst_piece, box, offset, nbytes)``
    at 16-byte aligned offsets."""
    messages, cur, end = [], [], 0
    todo = list(reversed(segs))  # a stack: pop() takes the next segment
    while todo:
        ti, spi, dpi, box = todo.pop()
        isz = itemsize_of[ti]
        start = _align(end) if cur else 0
        head, rest = cut_box(box, isz, size - start) if start < size else (None, [box])
        if head is None and not cur:  # not one element fits a message of `size`
            head, rest = cut_box(box, isz, max(size, isz))
        if head is not None:
            nb = box_numel(head) * isz
            cur.append((ti, spi, dpi, head, start, nb))
            end = start + nb
        todo.extend((ti, spi, dpi, b) for b in reversed(rest))
        if rest and cur:  # this message is full
            messages.append((cur, end))
            cur, end = [], 0
    if cur:
        messages.append((cur, end))
    return messages


def _direct_test(plans, strided: Optional[set]):
    """``direct(ti, op)``: whether op can go straight from tensor to tensor on both ends
    (its box is one contiguous run of a standard-strided local tensor on each side, and
    neither end's tensor is in ``strided``, the agreed set of ``(rank, k)`` of non-standard
    tensors). ``strided`` None: no op is direct."""
    if strided is None:
        return lambda ti, op: False
    flat: dict = {}

    def flat_in(own, piece, box) -> bool:
        key = (id(own), piece, box)
        got = flat.get(key)
        if got is None:
            std, n = [], 1
            for size in reversed(own.local_shape):
                std.append(n)
                n *= size
            index = own.pieces[piece].index(box)
            stride = tuple(st * sl.step for st, sl in zip(reversed(std), index))
            got = flat[key] = _is_contiguous(box_shape(box), stride)
        return got

    def direct(ti, op) -> bool:
        plan = plans[ti]
        src_side = 0 if op.phase == 0 else 1  # phase 1 forwards from a destination tensor
        src_own = (plan.src if op.phase == 0 else plan.dst)[op.src]
        return ((op.src, 2 * ti + src_side) not in strided
                and (op.dst, 2 * ti + 1) not in strided
                and flat_in(src_own, op.src_piece, op.box)
                and flat_in(plan.dst[op.dst], op.dst_piece, op.box))

    return direct


def build_schedule(plans: Sequence[ParamPlan], itemsizes: Sequence[int], me: int,
                   cap: int, strided: Optional[set] = None) -> _Schedule:
    """The global schedule, computed alike on every rank from plain data: per phase, each
    peer pair's traffic cut into messages and the messages placed into rounds in which no
    rank stages more than ``cap`` bytes (sends + receives); this rank keeps its part.

    An op of at least ``min(DIRECT_MIN_BYTES, cap / 8)`` whose box is contiguous on both
    ends (see ``_direct_test``; needs ``strided``, the agreed set of ranks' non-standard
    tensors) is a *direct* message: uncut, no staging, in the first round. Every other
    message counts fully on both ends.
    """
    sched = _Schedule()
    direct = _direct_test(plans, strided)
    direct_min = min(DIRECT_MIN_BYTES, cap // 8)
    for phase in (0, 1):
        pairs: dict = {}
        pair_bytes: dict = {}
        straight: list = []  # direct messages: (s, d, segment)
        for ti, plan in enumerate(plans):
            isz = itemsizes[ti]
            for op in plan.ops:
                if op.phase != phase:
                    continue
                if op.src == op.dst:
                    if op.src == me:
                        sched.local.append((ti, op.src_piece, op.dst_piece, op.box))
                    continue
                nb = box_numel(op.box) * isz
                if nb >= direct_min and direct(ti, op):
                    straight.append((op.src, op.dst,
                                     (ti, op.src_piece, op.dst_piece, op.box, 0, nb)))
                    continue
                pairs.setdefault((op.src, op.dst), []).append(
                    (ti, op.src_piece, op.dst_piece, op.box))
                pair_bytes[(op.src, op.dst)] = pair_bytes.get((op.src, op.dst), 0) + nb
        if not pairs and not straight:
            continue
        size = _message_sizes(pair_bytes, cap)
        # message k of every pair before message k+1 of any: round k carries all pairs
        staged = []
        for (s, d), segs in pairs.items():
            for seq, (msg, nbytes) in enumerate(_cut_messages(segs, itemsizes, size[(s, d)])):
                staged.append((seq, s, d, msg, nbytes, False))
        staged.sort(key=lambda m: m[0])  # stable: pairs keep their first-appearance order
        count: dict = {}  # messages per pair: their tags
        for m in staged:
            count[(m[1], m[2])] = count.get((m[1], m[2]), 0) + 1
        messages = []
        for s, d, seg in straight:
            tag = count.get((s, d), 0)
            count[(s, d)] = tag + 1
            messages.append((tag, s, d, [seg], seg[5], True))
        messages += staged
        loads: list[dict] = []
        mine: list[list] = []
        after: dict = {}  # per pair: the first round its next staged message may go in
        for seq, s, d, segs, nbytes, is_direct in messages:
            cost = 0 if is_direct else nbytes
            # direct messages go in the first round; a pair's staged messages each in a
            # later round than the one before, even where two would fit one round: the
            # unpack of one then overlaps the transfer of the next
            r = 0 if is_direct else after.get((s, d), 0)
            while r < len(loads) and (loads[r].get(s, 0) + cost > cap
                                      or loads[r].get(d, 0) + cost > cap):
                r += 1
            if r == len(loads):
                loads.append({})
                mine.append([])
            loads[r][s] = loads[r].get(s, 0) + cost
            loads[r][d] = loads[r].get(d, 0) + cost
            if not is_direct:
                after[(s, d)] = r + 1
            if s == me:
                mine[r].append((True, d, seq, segs, nbytes, is_direct))
            elif d == me:
                mine[r].append((False, s, seq, segs, nbytes, is_direct))
        base = sched.nrounds
        sched.rounds.extend((phase, base + i, msgs) for i, msgs in enumerate(mine) if msgs)
        sched.nrounds += len(mine)
    return sched


def _describe(t) -> str:
    return "None" if t is None else f"tensor{tuple(t.shape)} {t.dtype} on {t.device}"


def _check_local(transfers, plans, me: int, device_type: str) -> tuple[Optional[int], str,
                                                                      Optional[torch.device]]:
    """First problem with this rank's tensors: (transfer index, message, device)."""
    device = None
    for i, (t, plan) in enumerate(zip(transfers, plans)):
        for side, tensor, owns in (("src", t.src, plan.src), ("dst", t.dst, plan.dst)):
            own = owns.get(me)
            where = f"param {t.name!r} on rank {me}"
            if own is None and tensor is not None:
                return i, (f"{where}: {side} given on a non-{side} rank (rank {me} is not in "
                           f"the {side} mesh {sorted(owns)}): expected None, found "
                           f"{_describe(tensor)}"), device
            if own is None:
                continue
            if tensor is None:
                return i, (f"{where}: {side} missing on a {side} rank: expected a local tensor "
                           f"of shape {own.local_shape}, found None"), device
            if not isinstance(tensor, torch.Tensor):
                return i, f"{where}: {side} must be a torch.Tensor, found {type(tensor)}", device
            if tuple(tensor.shape) != own.local_shape:
                return i, (f"{where}: wrong local {side} shape: expected {own.local_shape}, "
                           f"found {tuple(tensor.shape)}"), device
            if tensor.dtype != t.dtype:
                return i, (f"{where}: wrong {side} dtype: expected {t.dtype}, found "
                           f"{tensor.dtype}"), device
            if tensor.device.type != device_type:
                return i, (f"{where}: wrong {side} device for this group's backend: expected "
                           f"a {device_type} tensor, found {tensor.device}"), device
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                return i, (f"{where}: wrong {side} device: expected {device} (as the batch's "
                           f"other tensors on this rank), found {tensor.device}"), device
    return None, "", device


# ---- per-batch state, cached on the Planner ------------------------------------------
#
# A refit sends the same batches again and again; only the tensors change. Everything
# below is plain data derived from the batch description (and, for a _Program, from the
# strides of this rank's tensors), so a warm call only validates its tensors, runs the
# agreement step and moves bytes.


def _light_key(transfers, world: int) -> Optional[tuple]:
    """A hashable description of the batch that is cheap to build on every call: per
    transfer (name, dtype, (shape, src mesh key, src placements, dst mesh key, dst
    placements)). Placements stay objects (``Shard(0) == Shard(0)``); anything odd
    (unhashable placements, meshes without a key) gives None: no caching, full path."""
    mesh_keys: dict = {}  # id -> key, for this call only (the meshes are alive meanwhile)
    try:
        items = []
        for t in transfers:
            sm, dm = t.src_mesh, t.dst_mesh
            sk = mesh_keys.get(id(sm))
            if sk is None:
                sk = mesh_keys[id(sm)] = _mesh_key(sm)
            dk = mesh_keys.get(id(dm))
            if dk is None:
                dk = mesh_keys[id(dm)] = _mesh_key(dm)
            lay = (tuple(map(int, t.global_shape)), sk, tuple(t.src_placements),
                   dk, tuple(t.dst_placements), world)
            items.append((t.name, t.dtype, lay))
    except Exception:
        return None
    return tuple(items)


class _Batch:
    """What one batch description gives on this rank: plans, fingerprint, what each local
    tensor must look like, the schedule, and execution programs per tensor-stride
    signature."""

    def __init__(self, transfers, plans, me: int) -> None:
        self.plans = plans
        self.fp_hex = batch_fingerprint([(t.name, str(t.dtype), p.fingerprint)
                                         for t, p in zip(transfers, plans)])
        self.fp = int(self.fp_hex[:15], 16)
        # local shape of this rank's src / dst tensor per transfer; None: must be None
        self.expect = []
        for p in plans:
            s, d = p.src.get(me), p.dst.get(me)
            self.expect.append((None if s is None else s.local_shape,
                                None if d is None else d.local_shape))
        self.sched: Optional[_Schedule] = None  # built after the agreement step
        self.sched_hash = 0  # _hash_ints of every rank's _signature it was built for
        self.programs: dict = {}
        self._strided: dict = {}  # strides -> this rank's non-standard tensors (k)

    def strided_of(self, strides: tuple, tensors: list) -> tuple:
        """``(ks, signature)``: indices k of this rank's tensors that are not
        standard-contiguous, and their ``_signature`` (cached per strides)."""
        got = self._strided.get(strides)
        if got is None:
            if len(self._strided) >= 8:
                self._strided.clear()
            ks = tuple(k for k, x in enumerate(tensors)
                       if x is not None and not x.is_contiguous())
            got = self._strided[strides] = (ks, _signature(ks))
        return got


def _local_ok(transfers, expect, device_type: str,
              tensors: list) -> tuple[bool, Optional[torch.device]]:
    """Fast form of ``_check_local``'s verdict and device (same checks, no messages).
    Appends this rank's tensors to ``tensors``, two per transfer (src, dst)."""
    device = None
    for t, (src_shape, dst_shape) in zip(transfers, expect):
        for tensor, shape in ((t.src, src_shape), (t.dst, dst_shape)):
            tensors.append(tensor)
            if shape is None:
                if tensor is not None:
                    return False, None
                continue
            if (not isinstance(tensor, torch.Tensor) or tensor.shape != shape
                    or tensor.dtype != t.dtype):
                return False, None
            if device is None:
                device = tensor.device
                if device.type != device_type:
                    return False, None
            elif tensor.device != device:
                return False, None
    return True, device


def xfer_batch(transfers: Sequence, group=None, *, stream=None,
               staging_bytes: int = 256 << 20, planner: Optional[Planner] = None,
               backend: str = "python", agree: bool = True, _vote: bool = True) -> None:
    """Move every transfer of the batch from its source layout to its destination layout.

    Every rank of ``group`` calls with the same list (names, shapes, dtypes, layouts,
    order) and the same ``staging_bytes``; a rank passes ``None`` for a side it does not
    hold. ``dst`` tensors are written in place. Pass one ``Planner`` across calls to reuse
    plans, schedules and execution programs (a warm call then costs a few µs per param
    on the host). Raises ``ValueError`` on every rank before any data moves when any
    rank's input is invalid.
    
    ``agree=False`` skips the agreement step (one small all-reduce and the call's only
    host sync) for a caller that already ran this exact batch successfully on every rank,
    as the refit loop does from its second refit on: local checks still run, but a rank
    that fails one then raises alone and its peers wait for the group's timeout.
    """
    with gc_paused():
        _xfer_batch(transfers, group, stream, staging_bytes, planner, backend, agree, _vote)


def _xfer_batch(transfers, group, stream, staging_bytes: int, planner: Optional[Planner],
                backend: str, agree: bool, _vote: bool) -> None:
    planner = planner if planner is not None else Planner()
    group = resolve_group(group)
    me, world = group.rank(), group.size()
    if staging_bytes < MIN_STAGING_BYTES:
        raise ValueError(f"xfer_batch: staging_bytes must be >= {MIN_STAGING_BYTES}, "
                         f"found {staging_bytes}")
    light = _light_key(transfers, world)
    bkey = None if light is None else (me, staging_bytes, light)
    scope = id(group)
    try:
        batch = None if bkey is None else planner.batch(scope, bkey)
    except TypeError:  # unhashable placements (e.g. wire-form dicts): no caching
        light = bkey = batch = None
    if batch is None:
        keys = []
        for i, t in enumerate(transfers):
            where = f"xfer_batch: param {t.name!r} on rank {me}"
            if t.dtype is None:
                raise ValueError(f"{where}: dtype is required, found None")

            def build(t=t, where=where):
                key = layout_key(t.global_shape, t.src_mesh, t.src_placements, t.dst_mesh,
                                 t.dst_placements, where)
                for side, ranks in (("src", key[2]), ("dst", key[5])):
                    bad = [r for r in ranks if r >= world]
                    if bad:
                        raise ValueError(f"{where}: {side} mesh rank outside the group: ranks "
                                         f"{bad} not in [0, {world}) (group size {world})")
                return key

            keys.append(build() if light is None else planner.layout(light[i][2], build))
        batch = _Batch(transfers, planner.plan_all(keys), me)
        if bkey is not None:
            planner.remember_batch(scope, bkey, batch)
    plans = batch.plans
    if backend != "python":
        from . import m2n

        ok, why = m2n.select([p.key for p in plans])
        if backend == "m2n" and not ok:
            raise ValueError(f"xfer_batch: backend 'm2n' cannot be used: {why}")
        # ok is never true today (m2n.ADAPTER_VERIFIED is False): fall through to Python.

    bname = backend_name(group)
    device_type = "cuda" if bname == "nccl" else "cpu"
    tensors: list = []  # this rank's tensors, two per transfer: src at 2 * ti, dst at 2 * ti + 1
    ok, device = _local_ok(transfers, batch.expect, device_type, tensors)
    bad_index, message = None, ""
    if not ok:  # rare: rerun the detailed checks for the message
        bad_index, message, device = _check_local(transfers, plans, me, device_type)
    transport = P2PTransport(group, device if bad_index is None else None)
    strides = None if bad_index is not None else tuple(
        [None if x is None else x.stride() for x in tensors])

    # agree=False: the caller vouches that this batch already agreed on every rank. Its
    # schedule is then cached on every rank of the group alike (Planner.remember_batch);
    # where it is not (a fresh planner), every rank runs the agreement below.
    if not agree and batch.sched is not None:
        if bad_index is not None:
            raise ValueError(f"xfer_batch: {message} (agree=False: peers are not told)")
        _execute(batch, transfers, plans, me, tensors, strides, transport, stream, planner)
        return
    # The agreement step (_agree), the only host sync of a call. Where the schedule is
    # cached, the first round's pack runs meanwhile on the side stream: a local read of
    # this rank's own tensors into its own staging slot, discarded if the call stops.
    on_cuda = transport.device.type == "cuda"
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    early = None  # CUDA: the first round packed during the agreement, on a cached schedule
    if on_cuda and strides is not None and batch.sched is not None:
        with ctx:
            early = _program(batch, transfers, plans, me, strides).pack_ahead(
                tensors, transport, planner)
    try:
        sigs, rebuild = _agree(batch, transfers, me, world, strides, tensors, bad_index,
                               message, transport, planner, ctx, _vote)
        if rebuild:  # decided from the all-reduced votes: alike on every rank
            with ctx:
                strided = (_exchange_strided(batch.strided_of(strides, tensors)[0],
                                             len(tensors), transport) if any(sigs) else set())
            # CUDA rounds are double-buffered (see _Program.run): two slots share the budget
            budget = max(MIN_STAGING_BYTES, staging_bytes // 2) if on_cuda else staging_bytes
            batch.sched = build_schedule(plans, [t.dtype.itemsize for t in transfers], me,
                                         budget, strided)
            batch.sched_hash = _hash_ints(sigs)
            batch.programs.clear()
            _discard_early(early)
            early = None
    except BaseException:
        _discard_early(early)
        raise
    _execute(batch, transfers, plans, me, tensors, strides, transport, stream, planner, early)


def _discard_early(early: Optional[tuple]) -> None:
    """The current stream waits for a ``pack_ahead`` that will not run, so its slots
    are freed only after the side stream is done writing them."""
    if early is not None:
        early[2].wait_event(early[1])


def _agree(batch, transfers, me: int, world: int, strides, tensors, bad_index, message,
           transport: P2PTransport, planner: Planner, ctx, vote: bool) -> tuple:
    """The agreement step (module docstring, step 4). Returns every rank's signature and
    whether the schedule must be (re)built, the same on every rank.

    Besides the errors and the fingerprint, each rank votes a signature of which of its
    tensors are not standard-contiguous (the schedule depends on all ranks': direct
    messages need a contiguous view on both ends), and the hash of the signatures its
    cached schedule was built for (0: none). The schedule is kept only where every rank
    holds one built for exactly the signatures voted now."""
    fp_hex, fp = batch.fp_hex, batch.fp
    values = [0] * (2 * world + 4)
    values[me] = 0 if bad_index is None else bad_index + 1
    values[world], values[world + 1] = (fp, -fp) if vote else (_NO_VOTE, _NO_VOTE)
    cached = batch.sched_hash if batch.sched is not None else 0
    values[world + 2], values[world + 3] = cached, -cached
    values[world + 4 + me] = 0 if strides is None else batch.strided_of(strides, tensors)[1]
    with ctx:
        got = _allreduce_votes(values, transport, planner)
    if bad_index is not None:
        raise ValueError(f"xfer_batch: {message}")
    failed = [(r, got[r] - 1) for r in range(world) if got[r]]
    if failed:
        who = "; ".join(f"rank {r} rejected param {transfers[i].name!r}" for r, i in failed)
        raise ValueError(f"xfer_batch on rank {me}: {who} (see that rank's error); "
                         f"no data was moved")
    if got[world] != -got[world + 1]:
        raise ValueError(f"xfer_batch on rank {me}: ranks disagree on the batch description "
                         f"(names, shapes, dtypes, layouts or order differ; this rank's "
                         f"fingerprint {fp_hex})")
    sigs = tuple(got[world + 4:])
    same_cache = got[world + 2] == -got[world + 3]  # max == min over the ranks
    return sigs, not (same_cache and got[world + 2] == _hash_ints(sigs))


def _allreduce_votes(values: list, transport: P2PTransport, planner: Planner) -> list:
    """MAX all-reduce of ``values`` (int64) over the group, back on the host. On CUDA
    the votes go up from and come back into pinned buffers reused across calls, on the
    current stream, and the host waits for that stream only."""
    if transport.device.type != "cuda":
        flags = torch.tensor(values, dtype=torch.int64)
        transport.allreduce_max(flags)
        return flags.tolist()
    host_in, flags, host_out = planner.vote_buffers(transport.device, len(values))
    host_in.copy_(torch.tensor(values, dtype=torch.int64))
    flags.copy_(host_in, non_blocking=True)
    transport.allreduce_max(flags)
    host_out.copy_(flags, non_blocking=True)
    torch.cuda.current_stream(transport.device).synchronize()
    return host_out.tolist()


def _hash_ints(values: tuple) -> int:
    """A stable 60-bit hash of a tuple of ints, never 0."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).hexdigest()
    return 1 + int(digest[:15], 16)


def _signature(strided: tuple) -> int:
    """A rank's vote for its non-standard tensors: 0 for none, else a hash of them."""
    return _hash_ints(strided) if strided else 0


def _exchange_strided(mine: tuple, ntensors: int, transport: P2PTransport) -> set:
    """Every rank's non-standard tensors as ``{(rank, k)}``: one MAX all-reduce of a
    [ranks, tensors] byte map, each rank filling its row (once per batch and layout)."""
    rows = torch.zeros(transport.size(), ntensors, dtype=torch.uint8)
    if mine:
        rows[transport.rank(), list(mine)] = 1
    rows = rows.to(transport.device)
    transport.allreduce_max(rows)
    return {(r, k) for r, k in rows.nonzero().tolist()}


def _program(batch, transfers, plans, me: int, strides: tuple) -> "_Program":
    """The batch's schedule resolved for these tensor strides (cached on the batch)."""
    prog = batch.programs.get(strides)
    if prog is None:
        prog = _Program(batch.sched, transfers, plans, me)
        if len(batch.programs) >= 8:
            batch.programs.clear()
        batch.programs[strides] = prog
    return prog


def _execute(batch, transfers, plans, me: int, tensors, strides: tuple,
             transport: P2PTransport, stream, planner: Planner,
             early: Optional[tuple] = None) -> None:
    """Run this rank's part of an agreed batch with the batch's schedule."""
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    prog = _program(batch, transfers, plans, me, strides)
    with ctx:
        if stream is not None:
            for x in tensors:
                if x is not None and x.is_cuda:
                    x.record_stream(stream)
        prog.run(tensors, transport, planner, early)


# ---- execution -------------------------------------------------------------------------
#
# Views are made with ``as_strided`` from geometry computed once per _Program (from the
# plan's slices and the tensor's strides, which are part of the program's key): one call
# per view instead of Python indexing, and the same elements as ``tensor[slices]``.


def _is_contiguous(shape, stride) -> bool:
    """``Tensor.is_contiguous()`` of a tensor with this shape and stride (torch's rule:
    size-1 dims are skipped, an empty tensor is contiguous)."""
    if 0 in shape:
        return True
    expected = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1:
            if st != expected:
                return False
            expected *= n
    return True


def _typed(tensors, ref) -> torch.Tensor:
    """The view ``ref = (k, geometry)`` of tensor ``k``; geometry None: the whole tensor."""
    k, geom = ref
    x = tensors[k]
    if geom is None:
        return x
    size, stride, delta = geom
    return x.as_strided(size, stride, x.storage_offset() + delta)


def _flat(tensors, ref) -> torch.Tensor:
    """The bytes of the contiguous view ``ref = (k, numel, delta)``; numel None: tensor ``k``
    is 1-D with stride 1 and whole."""
    k, numel, delta = ref
    x = tensors[k]
    if numel is None:
        return x.view(torch.uint8)
    return x.as_strided((numel,), (1,), x.storage_offset() + delta).view(torch.uint8)


# Copy speed (H200; docs/MEASUREMENTS.md, fourth session): torch copies a strided view
# element by element, so a 256 MiB strided bf16 pack took 302 µs, the same bytes as 8-byte
# words 140 µs, a contiguous memcpy 129. Strided copies therefore run as the widest word
# their geometry and addresses allow. The batched foreach kernel moves contiguous bytes at
# half a memcpy's speed (128 MiB: 145 µs against 67), but each separate ``copy_`` costs
# the host ~10 µs: contiguous pairs of _MEMCPY_BYTES or more are copied one by one (a
# memcpy each; 8 local copies of 32 MiB: 490 → 297 µs), smaller ones stay batched (at
# 1 MiB, 400 params of 0.5-4 MiB took 7 → 11 ms).
_WORDS = {8: torch.int64, 4: torch.int32}
_MEMCPY_BYTES = 16 << 20


def _word_bytes(size, stride, itemsize: int) -> int:
    """The widest word (8 or 4 bytes, wider than an element; 0: none) that a view of this
    size and stride (in elements) can be copied as, by ``Tensor.view(dtype)``'s rule: unit
    last stride, the last dim's bytes and every other stride's a multiple of the word. The
    view's address is checked per call (``_words_pair``)."""
    if not size or 0 in size or stride[-1] != 1:
        return 0
    for w in (8, 4):
        if w > itemsize and all(b * itemsize % w == 0 for b in (size[-1], *stride[:-1])):
            return w
    return 0


def _as_words(v: torch.Tensor, w: int) -> Optional[torch.Tensor]:
    if v.data_ptr() % w or v.storage_offset() * v.element_size() % w:
        return None
    return v.view(_WORDS[w])


def _words_pair(dst: torch.Tensor, src: torch.Tensor, w: int) -> tuple:
    """``(dst, src)`` as ``w``-byte words when both addresses allow it (their geometry
    passed ``_word_bytes``), else as they are. Bit-exact either way: a copy moves bits."""
    if w:
        dw, sw = _as_words(dst, w), _as_words(src, w)
        if dw is not None and sw is not None:
            return dw, sw
    return dst, src


class _Copies:
    """One batch of copies ``dst <- src`` whose destinations never overlap, issued as few
    kernels as the views allow (see _MEMCPY_BYTES): large contiguous pairs at once, one
    memcpy each; the other contiguous pairs (uint8 views of equal length) as one
    ``_foreach_copy_`` (multi-tensor kernels on CUDA, whatever the params' dtypes); strided
    pairs as one ``_foreach_copy_`` as well, which runs them one ``copy_`` each, in C++."""

    def __init__(self) -> None:
        self.flat_dst, self.flat_src, self.typed_dst, self.typed_src = [], [], [], []

    def flat(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        if nbytes >= _MEMCPY_BYTES:
            dst.copy_(src)
        else:
            self.flat_dst.append(dst)
            self.flat_src.append(src)

    def typed(self, dst: torch.Tensor, src: torch.Tensor, w: int) -> None:
        dst, src = _words_pair(dst, src, w)
        self.typed_dst.append(dst)
        self.typed_src.append(src)

    def run(self) -> None:
        if self.flat_dst:
            torch._foreach_copy_(self.flat_dst, self.flat_src)
        if self.typed_dst:
            torch._foreach_copy_(self.typed_dst, self.typed_src)


class _Geom(NamedTuple):
    """Where a view lies in its tensor, for ``_typed`` / ``_flat`` refs."""

    contiguous: bool
    typed: Optional[tuple]  # (size, stride, storage offset delta); None: the whole tensor
    numel: Optional[int]    # None: the whole tensor, 1-D with stride 1
    delta: int              # storage offset from the tensor's
    nbytes: int             # bytes of the view
    words: int              # strided views: the word size to copy in (``_word_bytes``)


class _Program:
    """The schedule resolved for one set of tensor strides on this rank. Plain data;
    ``run`` only makes views and copies.

    Tensors are numbered ``k = 2 * ti + side`` (side 0: src, 1: dst), as in the call's
    ``tensors`` list. A message of one segment whose view is contiguous goes straight
    from/to the tensor; others go through the round's staging buffer. Staged segments and
    local copies whose views are contiguous are copied as bytes (``_flat`` refs), all of
    a round at once; strided ones as typed views (``_typed`` refs), or as words.
    """

    def __init__(self, sched: _Schedule, transfers, plans, me: int) -> None:
        self._side = None  # CUDA side stream for pack/unpack, created on first use
        shapes, strides = {}, {}
        for ti, t in enumerate(transfers):
            for side, x in ((0, t.src), (1, t.dst)):
                if x is not None:
                    shapes[2 * ti + side], strides[2 * ti + side] = tuple(x.shape), x.stride()

        geometry: dict = {}  # many params share a plan and strides: compute each view once

        def view(ti, side, piece, box) -> tuple[int, _Geom]:
            """Tensor k and the geometry of the view of ``box`` in it."""
            k = 2 * ti + side
            # plans are cached by layout, so id() names a layout here (the list holds them)
            key = (id(plans[ti]), side, piece, box, strides[k])
            got = geometry.get(key)
            if got is None:
                own = (plans[ti].src if side == 0 else plans[ti].dst)[me]
                index = own.pieces[piece].index(box)
                size = tuple(e - s for s, e in box)
                stride = tuple(st * sl.step for st, sl in zip(strides[k], index))
                delta = sum(st * sl.start for st, sl in zip(strides[k], index))
                numel = 1
                for n in size:
                    numel *= n
                whole = delta == 0 and size == shapes[k] and stride == tuple(strides[k])
                simple = whole and len(size) == 1 and stride == (1,)
                itemsize = transfers[ti].dtype.itemsize
                got = geometry[key] = _Geom(_is_contiguous(size, stride),
                                            None if whole else (size, stride, delta),
                                            None if simple else numel, delta,
                                            numel * itemsize,
                                            _word_bytes(size, stride, itemsize))
            return k, got

        def is_flat(v):
            return v[1].contiguous

        def typed(v):  # a _typed ref
            return v[0], v[1].typed

        def flat(v):  # a _flat ref
            return v[0], v[1].numel, v[1].delta

        # (True, dst flat, src flat, bytes) or (False, dst typed, src typed, word bytes)
        self.local = []
        for ti, spi, dpi, box in sched.local:
            d, s = view(ti, 1, dpi, box), view(ti, 0, spi, box)
            if is_flat(d) and is_flat(s):
                self.local.append((True, flat(d), flat(s), d[1].nbytes))
            else:
                self.local.append((False, typed(d), typed(s),
                                   min(d[1].words, s[1].words)))
        self.rounds = []  # (phase, buffer bytes, posts, packs, unpacks)
        for phase, _, msgs in sched.rounds:
            posts, packs, unpacks, total = [], [], [], 0
            for is_send, peer, tag, segs, nbytes, _ in msgs:
                side = (0 if phase == 0 else 1) if is_send else 1
                views = [view(ti, side, spi if is_send else dpi, box)
                         for ti, spi, dpi, box, _, _ in segs]
                if len(segs) == 1 and is_flat(views[0]):  # direct
                    posts.append((is_send, peer, tag, flat(views[0]), 0, nbytes))
                    continue
                for (ti, _, _, box, off, nb), v in zip(segs, views):
                    # (buffer offset, bytes, dtype, box shape, flat?, tensor-side ref,
                    # word bytes); the buffer's side is contiguous: words if the tensor's are
                    seg = ((total + off, nb, None, None, True, flat(v), 0) if is_flat(v) else
                           (total + off, nb, transfers[ti].dtype, box_shape(box), False,
                            typed(v), v[1].words))
                    (packs if is_send else unpacks).append(seg)
                posts.append((is_send, peer, tag, None, total, nbytes))
                total = _align(total + nbytes)
            self.rounds.append((phase, total, posts, packs, unpacks))
        self.staged = any(r[3] or r[4] for r in self.rounds)  # else: no staging at all

    def _local_copies(self, tensors) -> None:
        copies = _Copies()
        for is_flat, d, s, n in self.local:
            if is_flat:
                copies.flat(_flat(tensors, d), _flat(tensors, s), n)
            else:
                copies.typed(_typed(tensors, d), _typed(tensors, s), n)
        copies.run()

    @staticmethod
    def _stage(buf, segs, tensors, pack: bool) -> None:
        """Copy segments into (pack) or out of the staging buffer."""
        copies = _Copies()
        for off, nb, dtype, shape, is_flat, ref, words in segs:
            chunk = buf[off: off + nb]
            if is_flat:
                pair = (chunk, _flat(tensors, ref))
                copies.flat(*(pair if pack else pair[::-1]), nb)
            else:
                pair = (chunk.view(dtype).view(shape), _typed(tensors, ref))
                copies.typed(*(pair if pack else pair[::-1]), words)
        copies.run()

    def _post(self, buf, posts, tensors, transport: P2PTransport, local_done: bool) -> bool:
        """Post one round's sends and receives (waited for on exit); the local copies run
        during the first round, overlapping its transfers. Returns whether they ran."""
        with transport.round():
            for is_send, peer, tag, ref, off, nbytes in posts:
                tensor = buf[off: off + nbytes] if ref is None else _flat(tensors, ref)
                (transport.send if is_send else transport.recv)(tensor, peer, tag)
            if not local_done:
                self._local_copies(tensors)
                local_done = True
        return local_done

    def pack_ahead(self, tensors, transport: P2PTransport,
                   planner: Planner) -> Optional[tuple]:
        """CUDA: allocate the staging slots and pack the first round now, on the side
        stream, so that the pack overlaps whatever the current stream does next (the
        agreement step). Returns ``early`` for ``run``, or None when there is nothing to
        pack; a caller that does not go on to ``run`` passes it to ``_discard_early``."""
        first = next((r for r in self.rounds if r[0] == 0), None)
        if transport.device.type != "cuda" or first is None or not first[3]:
            return None
        device = transport.device
        main, side = torch.cuda.current_stream(device), self._side_stream(device)
        slots = self._slots(device, planner)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._stage(slots[0], first[3], tensors, pack=True)
            packed = torch.cuda.Event()
            packed.record(side)
        return slots, packed, main

    def _side_stream(self, device) -> "torch.cuda.Stream":
        """The program's CUDA side stream for packs, unpacks and local copies."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _slots(self, device, planner: Planner) -> list:
        """The planner's staging slots for the current stream, big enough for every round."""
        return planner.staging_slots(device, max(total for _, total, _, _, _ in self.rounds))

    def run(self, tensors, transport: P2PTransport, planner: Planner,
            early: Optional[tuple] = None) -> None:
        if transport.device.type == "cuda" and (self.staged or (self.local and self.rounds)):
            self._run_overlapped(tensors, transport, planner, early)
            return
        local_done = False
        for phase, total, posts, packs, unpacks in self.rounds:
            if phase == 1 and not local_done:  # phase-1 sends may forward locally copied data
                self._local_copies(tensors)
                local_done = True
            buf = torch.empty(total, dtype=torch.uint8, device=transport.device) if total else None
            if packs:
                self._stage(buf, packs, tensors, pack=True)
            local_done = self._post(buf, posts, tensors, transport, local_done)
            if unpacks:
                self._stage(buf, unpacks, tensors, pack=False)
        if not local_done:
            self._local_copies(tensors)

    def _run_overlapped(self, tensors, transport: P2PTransport, planner: Planner,
                        early: Optional[tuple]) -> None:
        """CUDA: the copies of neighbouring rounds and the local copies run on a side
        stream during transfers.

        Per phase, with round k's buffer in slot k % 2: the side stream packs round k+1
        while round k is on the wire, then waits for round k and unpacks it; the current
        stream only waits for a round's pack before posting it. The local copies go on the
        side stream after the first round is posted: on the current stream they would
        run before the round's NCCL kernel (NCCL's stream waits for the current one when
        the group is launched), so a 128 MiB local copy delayed the transfer by its whole
        duration. No host sync. Every stream is joined back into the current one before
        returning, so the slots and the callers' tensors are released in order. ``early``
        (from ``pack_ahead``): the slots, with the first round already packed.
        """
        device = transport.device
        main, side = torch.cuda.current_stream(device), self._side_stream(device)
        slots = (early[0] if early is not None else
                 self._slots(device, planner) if self.staged else [None, None])
        local_done = not self.local
        for phase in (0, 1):
            rounds = [r for r in self.rounds if r[0] == phase]
            if not rounds:
                continue
            if phase == 1 and not local_done:  # phase-1 sends may forward locally copied data
                self._local_copies(tensors)
                local_done = True
            packed: list = []

            def pack(k: int) -> None:
                with torch.cuda.stream(side):
                    if rounds[k][3]:
                        self._stage(slots[k % 2], rounds[k][3], tensors, pack=True)
                    packed.append(torch.cuda.Event())
                    packed[k].record(side)

            if phase == 0 and early is not None:
                packed.append(early[1])
            else:
                side.wait_stream(main)  # data written on the current stream is visible
                pack(0)
            for k, (_, _, posts, _, unpacks) in enumerate(rounds):
                main.wait_event(packed[k])
                buf = slots[k % 2]
                self._post(buf, posts, tensors, transport, local_done=True)
                done = torch.cuda.Event()
                done.record(main)
                if k + 1 < len(rounds):
                    # slot (k+1) % 2 held round k-1, which the side stream waited for already
                    pack(k + 1)
                if not local_done:  # behind the first packs, alongside the first round
                    with torch.cuda.stream(side):
                        self._local_copies(tensors)
                    local_done = True
                with torch.cuda.stream(side):
                    side.wait_event(done)  # always: the next pack into this slot waits too
                    if unpacks:
                        self._stage(buf, unpacks, tensors, pack=False)
            main.wait_stream(side)
        if not local_done:
            self._local_copies(tensors)
