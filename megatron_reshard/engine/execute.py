"""Batched execution: validate, agree, schedule into bounded rounds, move the bytes.

``xfer_batch`` runs, on every rank of the group, in this order:

1. plain-data checks of every transfer (placements, shard dims, mesh ranks inside the
   group, dtype given): identical on all ranks, so a bad description raises everywhere;
2. plans from the planner (cached by layout key);
3. local checks of this rank's tensors (side membership, shape, dtype, device);
4. the *agreement step*: one small MAX all-reduce over the group carrying one error slot per
   rank and the batch fingerprint (as ``fp`` and ``-fp``). A local error on any rank, or
   ranks whose descriptions differ, make every rank raise ``ValueError`` before any data
   moves (the failing rank with the detailed message, the others naming it). On NCCL this
   all-reduce also creates the group communicator that coalesced P2P rounds use;
5. the schedule (cached per batch): per phase and peer pair, ops become messages of
   at most ``staging_bytes``, each segment at a 16-byte aligned offset; messages are placed
   first-fit into rounds so that no rank sends + receives more than ``staging_bytes`` in
   one round (identical on every rank, computed from plain data);
6. rounds: pack staged sends, post every send/recv of the round, run local copies while
   the first round is in flight, wait, unpack staged receives. A message made of one
   segment whose view is contiguous on this side goes straight from/to the tensor.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from .geometry import box_numel, box_shape
from .plan import ParamPlan, Planner, batch_fingerprint, layout_key
from .transport import P2PTransport, backend_name, resolve_group

_ALIGN = 16
MIN_STAGING_BYTES = 64
_NO_VOTE = -(2 ** 62)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def split_box(box, itemsize: int, cap: int) -> list:
    """Row-major sub-boxes of ``box``, each of at most ``cap`` bytes."""
    shape = box_shape(box)
    slab = itemsize
    for n in shape:
        slab *= n
    d = 0
    while slab > cap and d < len(shape):
        slab //= shape[d] if shape[d] else 1
        d += 1
    if d == 0:
        return [box]
    d -= 1  # dim d is split into runs of `rows`; dims before it into single indices
    rows = max(1, cap // slab)
    out = []
    for prefix in itertools.product(*[range(s, e) for s, e in box[:d]]):
        head = tuple((i, i + 1) for i in prefix)
        for s in range(box[d][0], box[d][1], rows):
            out.append(head + ((s, min(s + rows, box[d][1])),) + box[d + 1:])
    return out


class _Schedule:
    """This rank's share of the global schedule (plain data, cached per batch)."""

    def __init__(self) -> None:
        self.local: list = []   # (ti, src_piece, dst_piece, box)
        self.nrounds = 0        # rounds in the global schedule (this rank may skip some)
        self.rounds: list = []  # [(phase, global round id, [(is_send, peer, tag, segments, nbytes)])]


def build_schedule(plans: Sequence[ParamPlan], itemsizes: Sequence[int], me: int,
                   cap: int) -> _Schedule:
    sched = _Schedule()
    for phase in (0, 1):
        pairs: dict = {}
        for ti, plan in enumerate(plans):
            isz = itemsizes[ti]
            for op in plan.ops:
                if op.phase != phase:
                    continue
                if op.src == op.dst:
                    if op.src == me:
                        sched.local.append((ti, op.src_piece, op.dst_piece, op.box))
                    continue
                nbytes = box_numel(op.box) * isz
                segs = pairs.setdefault((op.src, op.dst), [])
                for b in ([op.box] if nbytes <= cap else split_box(op.box, isz, cap)):
                    segs.append((ti, op.src_piece, op.dst_piece, b, box_numel(b) * isz))
        messages = []
        for (s, d), segs in pairs.items():
            cur, end, seq = [], 0, 0
            for ti, spi, dpi, b, nb in segs:
                start = _align(end) if cur else 0
                if cur and start + nb > cap:
                    messages.append((s, d, seq, cur, end))
                    seq, cur, start = seq + 1, [], 0
                cur.append((ti, spi, dpi, b, start, nb))
                end = start + nb
            if cur:
                messages.append((s, d, seq, cur, end))
        loads: list[dict] = []
        mine: list[list] = []
        last: dict = {}
        for s, d, seq, segs, nbytes in messages:
            r = last.get((s, d), 0)
            while r < len(loads) and (loads[r].get(s, 0) + nbytes > cap
                                      or loads[r].get(d, 0) + nbytes > cap):
                r += 1
            if r == len(loads):
                loads.append({})
                mine.append([])
            loads[r][s] = loads[r].get(s, 0) + nbytes
            loads[r][d] = loads[r].get(d, 0) + nbytes
            last[(s, d)] = r
            if s == me:
                mine[r].append((True, d, seq, segs, nbytes))
            elif d == me:
                mine[r].append((False, s, seq, segs, nbytes))
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


def _bytes(view: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous view (as_strided: size-1 dims may carry any stride)."""
    return view.as_strided((view.numel(),), (1,)).view(torch.uint8)


def xfer_batch(transfers: Sequence, group=None, *, stream=None,
               staging_bytes: int = 256 << 20, planner: Optional[Planner] = None,
               backend: str = "python", _vote: bool = True) -> None:
    """Move every transfer of the batch from its source layout to its destination layout.

    Every rank of ``group`` calls with the same list (names, shapes, dtypes, layouts,
    order) and the same ``staging_bytes``; a rank passes ``None`` for a side it does not
    hold. ``dst`` tensors are written in place. Pass one ``Planner`` across calls to reuse
    plans and schedules. Raises ``ValueError`` on every rank before any data moves when
    any rank's input is invalid.
    """
    planner = planner if planner is not None else Planner()
    group = resolve_group(group)
    me, world = group.rank(), group.size()
    if staging_bytes < MIN_STAGING_BYTES:
        raise ValueError(f"xfer_batch: staging_bytes must be >= {MIN_STAGING_BYTES}, "
                         f"found {staging_bytes}")
    keys = []
    for t in transfers:
        where = f"xfer_batch: param {t.name!r} on rank {me}"
        if t.dtype is None:
            raise ValueError(f"{where}: dtype is required, found None")
        key = layout_key(t.global_shape, t.src_mesh, t.src_placements, t.dst_mesh,
                         t.dst_placements, where)
        for side, ranks in (("src", key[2]), ("dst", key[5])):
            bad = [r for r in ranks if r >= world]
            if bad:
                raise ValueError(f"{where}: {side} mesh rank outside the group: ranks {bad} "
                                 f"not in [0, {world}) (group size {world})")
        keys.append(key)
    plans = planner.plan_all(keys)
    if backend != "python":
        from . import m2n

        ok, why = m2n.select([p.key for p in plans])
        if backend == "m2n" and not ok:
            raise ValueError(f"xfer_batch: backend 'm2n' cannot be used: {why}")
        # ok is never true today (m2n.ADAPTER_VERIFIED is False): fall through to Python.

    bname = backend_name(group)
    device_type = "cuda" if bname == "nccl" else "cpu"
    bad_index, message, device = _check_local(transfers, plans, me, device_type)
    transport = P2PTransport(group, device if bad_index is None else None)

    fp_hex = batch_fingerprint([(t.name, str(t.dtype), p.fingerprint)
                                for t, p in zip(transfers, plans)])
    fp = int(fp_hex[:15], 16)
    flags = torch.zeros(world + 2, dtype=torch.int64)
    flags[me] = 0 if bad_index is None else bad_index + 1
    flags[world], flags[world + 1] = (fp, -fp) if _vote else (_NO_VOTE, _NO_VOTE)
    flags = flags.to(transport.device)
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    with ctx:
        transport.allreduce_max(flags)
        got = flags.tolist()
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

    itemsizes = [t.dtype.itemsize for t in transfers]
    sched = planner.schedule((fp_hex, world, staging_bytes, me),
                             lambda: build_schedule(plans, itemsizes, me, staging_bytes))
    with ctx:
        if stream is not None:
            for t in transfers:
                for x in (t.src, t.dst):
                    if x is not None and x.is_cuda:
                        x.record_stream(stream)
        _run(sched, transfers, plans, me, transport)


def _run(sched: _Schedule, transfers, plans, me: int, transport: P2PTransport) -> None:
    def src_view(ti, phase, piece, box):
        plan, t = plans[ti], transfers[ti]
        if phase == 0:
            return plan.src[me].pieces[piece].view(t.src, box)
        return plan.dst[me].pieces[piece].view(t.dst, box)

    def dst_view(ti, piece, box):
        return plans[ti].dst[me].pieces[piece].view(transfers[ti].dst, box)

    def local_copies():
        for ti, spi, dpi, box in sched.local:
            dst_view(ti, dpi, box).copy_(plans[ti].src[me].pieces[spi].view(transfers[ti].src, box))

    local_done = False
    for phase, _, msgs in sched.rounds:
        if phase == 1 and not local_done:  # phase-1 sends may forward locally copied data
            local_copies()
            local_done = True
        # Decide direct vs staged per message on this side; size the round's staging buffer.
        posts, staged, total = [], [], 0
        for is_send, peer, tag, segs, nbytes in msgs:
            direct = None
            if len(segs) == 1:
                ti, spi, dpi, box, _, _ = segs[0]
                view = src_view(ti, phase, spi, box) if is_send else dst_view(ti, dpi, box)
                if view.is_contiguous():
                    direct = _bytes(view)
            if direct is None:
                staged.append((is_send, segs, total))
                posts.append((is_send, peer, tag, (total, nbytes)))
                total = _align(total + nbytes)
            else:
                posts.append((is_send, peer, tag, direct))
        buf = torch.empty(total, dtype=torch.uint8, device=transport.device) if total else None
        for is_send, segs, base in staged:
            if is_send:
                for ti, spi, dpi, box, off, nb in segs:
                    chunk = buf[base + off: base + off + nb]
                    chunk.view(transfers[ti].dtype).view(box_shape(box)).copy_(
                        src_view(ti, phase, spi, box))
        with transport.round():
            for is_send, peer, tag, what in posts:
                tensor = buf[what[0]: what[0] + what[1]] if isinstance(what, tuple) else what
                (transport.send if is_send else transport.recv)(tensor, peer, tag)
            if not local_done:
                local_copies()
                local_done = True
        for is_send, segs, base in staged:
            if not is_send:
                for ti, spi, dpi, box, off, nb in segs:
                    chunk = buf[base + off: base + off + nb]
                    dst_view(ti, dpi, box).copy_(
                        chunk.view(transfers[ti].dtype).view(box_shape(box)))
    if not local_done:
        local_copies()
