"""A rank's schedule resolved into views of its tensors, and run: copies, packing, streams.

Tensors are numbered ``k = 2 * ti + side`` (side 0: src, 1: dst), as in the call's
``tensors`` list. A message of one segment whose view is contiguous on this side goes
straight from/to the tensor; others go through the round's staging buffer. Staged
segments and local copies whose views are contiguous are copied as bytes (``FlatRef``),
all of a round at once; strided ones as typed views (``TypedRef``), or as words.

Rounds: pack staged sends, post every send/recv of the round, run local copies while the
first round is in flight, wait, unpack staged receives. On CUDA the copies leave the
critical path: round k+1 is packed and round k-1 unpacked on a side stream while round k
is on the wire (two staging slots kept on the Planner, so the schedule is built with half
the budget), and with a cached schedule the first round is packed during the agreement
step (``pack_ahead``). Rounds with nothing staged (direct messages only) are posted
without the side stream.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .copies import (WIDEN_BYTES, Copies, FlatRef, Strided, TypedRef, address_bits, as_words,
                     flat_view, typed_view, word_bytes)
from .geometry import box_shape
from .members import is_members, per_member_segments, unit_boxes
from .plan import Planner
from .schedule import Schedule, align, is_contiguous
from .transport import P2PTransport


class _Geom(NamedTuple):
    """Where a view lies in its tensor (shared by every tensor of the same plan and
    strides; ``typed``/``flat`` make the refs for tensor k)."""

    contiguous: bool
    strided: Optional[Strided]  # None: the whole tensor
    numel: Optional[int]        # None: the whole tensor, 1-D with stride 1
    delta: int                  # storage offset from the tensor's
    nbytes: int                 # bytes of the view
    words: int                  # strided views: the word size to copy in (``word_bytes``)

    def typed(self, k: int) -> TypedRef:
        return TypedRef(k, self.strided)

    def flat(self, k: int) -> FlatRef:
        return FlatRef(k, self.numel, self.delta)


class LocalStep(NamedTuple):
    """A local copy: as bytes (``flat``: FlatRefs) or as typed views (TypedRefs)."""

    flat: bool
    dst: tuple
    src: tuple
    nbytes: int
    words: int
    skew: int        # the bits of both views' byte offsets in their tensors (OR-ed)


class StagedSegment(NamedTuple):
    """A segment copied into (pack) or out of (unpack) a round's staging buffer."""

    offset: int       # in the buffer
    nbytes: int
    dtype: torch.dtype            # the transfer's
    shape: Optional[tuple]        # typed segments: the buffer side's shape
    flat: bool
    ref: tuple        # the tensor side: FlatRef or TypedRef
    words: int        # the buffer side is contiguous: words whenever the tensor's are


class StagePlan(NamedTuple):
    """A round's segments of one direction (pack or unpack), ready to copy: the buffer is
    cut into pieces by one ``split_with_sizes`` call (gaps and the other direction's bytes
    are pieces too), and piece ``i`` pairs with a view of a tensor."""

    nbytes: int      # the buffer bytes the sizes cover
    sizes: tuple     # piece sizes, in buffer order
    flat: tuple      # ((piece, FlatRef, nbytes), ...): byte copies
    typed: tuple     # ((piece, dtype, shape, TypedRef, words, skew), ...): typed copies,
                     # skew: the view's byte offset in its tensor
    whole: bool      # byte copies only, back to back from offset 0 to ``nbytes``
    # Every copy a whole 1-D tensor of one dtype: the buffer is cut in that dtype
    # (``elements``: the sizes in elements) and the tensors are copied as they are, with
    # no per-tensor byte view (~0.6 µs each on the host).
    dtype: Optional[torch.dtype]
    elements: Optional[tuple]


def _stage_plan(segs: list, total: int) -> Optional[StagePlan]:
    """The StagePlan of ``segs`` (StagedSegments in buffer order) in a buffer of ``total``
    bytes; None when there are none."""
    if not segs:
        return None
    sizes, flat, typed, cursor = [], [], [], 0
    for seg in segs:
        if seg.offset > cursor:
            sizes.append(seg.offset - cursor)
        sizes.append(seg.nbytes)
        cursor = seg.offset + seg.nbytes
        piece = len(sizes) - 1
        if seg.flat:
            flat.append((piece, seg.ref, seg.nbytes))
        else:
            skew = 0 if seg.ref.view is None else seg.ref.view.delta * seg.dtype.itemsize
            typed.append((piece, seg.dtype, seg.shape, seg.ref, seg.words, skew))
    if cursor < total:
        sizes.append(total - cursor)
    whole = not typed and len(flat) == len(sizes)
    dtypes = {seg.dtype for seg in segs}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    elements = None
    if (dtype is not None and not typed and all(ref.numel is None for _, ref, _ in flat)
            and all(n % dtype.itemsize == 0 for n in (total, *sizes))):
        elements = tuple(n // dtype.itemsize for n in sizes)
    return StagePlan(total, tuple(sizes), tuple(flat), tuple(typed), whole, dtype, elements)


class Post(NamedTuple):
    """A send or receive of a round: from/to the tensor (``ref``) or the buffer."""

    is_send: bool
    peer: int
    tag: int
    ref: Optional[FlatRef]  # None: ``nbytes`` of the staging buffer from ``offset``
    offset: int
    nbytes: int


class RoundProgram(NamedTuple):
    phase: int
    nbytes: int      # staging buffer bytes
    posts: tuple     # tuple[Post, ...]
    packs: Optional[StagePlan]    # None: nothing to pack
    unpacks: Optional[StagePlan]


class EarlyPack(NamedTuple):
    """The first round packed ahead on the side stream (``Program.pack_ahead``)."""

    slots: list
    packed: "torch.cuda.Event"
    main: "torch.cuda.Stream"

    def discard(self) -> None:
        """The current stream waits for a pack that will not be used, so its slots are
        freed only after the side stream is done writing them."""
        self.main.wait_event(self.packed)


def _bits(tensors, k: int, cache: dict) -> int:
    """``address_bits`` of tensor k, once per copy batch."""
    got = cache.get(k)
    if got is None:
        got = cache[k] = address_bits(tensors[k])
    return got


class Program:
    """The schedule resolved for one set of tensor strides on this rank. Plain data;
    ``run`` only makes views and copies."""

    def __init__(self, sched: Schedule, transfers, plans, me: int) -> None:
        self._side = None  # CUDA side stream for pack/unpack, created on first use
        shapes, strides = {}, {}
        bases = {}  # k of a list of members (members.py) -> index of its first member
        count = 2 * len(transfers)
        for ti, t in enumerate(transfers):
            for side, x in ((0, t.src), (1, t.dst)):
                if x is None:
                    continue
                k = 2 * ti + side
                if is_members(x):
                    bases[k], count = count, count + len(x)
                    for e, m in enumerate(x):
                        shapes[bases[k] + e], strides[bases[k] + e] = tuple(m.shape), m.stride()
                    continue
                shapes[k], strides[k] = tuple(x.shape), x.stride()
        geometry: dict = {}  # many params share a plan and strides: compute each view once

        def view(ti, side, piece, box) -> tuple[int, _Geom]:
            """Tensor k and the geometry of the view of ``box`` in it (a box of a list of
            members lies in one member: its index of dim 0 picks the member, and the
            view keeps a leading dim of one)."""
            k = 2 * ti + side
            member = k in bases
            if member:
                own = (plans[ti].src if side == 0 else plans[ti].dst)[me]
                k = bases[k] + own.pieces[piece].index(box)[0].start
            # plans are cached by layout, so id() names a layout here (the list holds them)
            key = (id(plans[ti]), side, piece, box, strides[k], member)
            got = geometry.get(key)
            if got is None:
                own = (plans[ti].src if side == 0 else plans[ti].dst)[me]
                index = own.pieces[piece].index(box)
                size = tuple(e - s for s, e in box)
                if member:  # the view keeps dim 0, of one index, over the member's dims
                    st_k = (0, *strides[k])
                    index = (slice(0, 1, 1), *index[1:])
                else:
                    st_k = strides[k]
                stride = tuple(st * sl.step for st, sl in zip(st_k, index))
                delta = sum(st * sl.start for st, sl in zip(st_k, index))
                numel = 1
                for n in size:
                    numel *= n
                whole = delta == 0 and size == shapes[k] and stride == tuple(strides[k])
                simple = whole and len(size) == 1 and stride == (1,)
                itemsize = transfers[ti].dtype.itemsize
                got = geometry[key] = _Geom(
                    is_contiguous(size, stride), None if whole else Strided(size, stride, delta),
                    None if simple else numel, delta, numel * itemsize,
                    word_bytes(size, stride, itemsize))
            return k, got

        def cut(ti, box) -> list:
            """``box`` per member where a side of transfer ti is a list of members."""
            return unit_boxes(box) if (2 * ti in bases or 2 * ti + 1 in bases) else [box]

        self.local = []
        for mv in (m._replace(box=b) for m in sched.local for b in cut(m.ti, m.box)):
            (dk, d), (sk, s) = (view(mv.ti, 1, mv.dst_piece, mv.box),
                                view(mv.ti, 0, mv.src_piece, mv.box))
            if (d.strided is None and s.strided is None and d.contiguous and s.contiguous
                    and d.nbytes < WIDEN_BYTES):
                # small whole tensor to whole tensor: copied as they are, no view made per
                # call (larger ones go as bytes, which copy as words or a memcpy)
                self.local.append(LocalStep(False, d.typed(dk), s.typed(sk), d.nbytes, 0, 0))
            elif d.contiguous and s.contiguous:
                self.local.append(LocalStep(True, d.flat(dk), s.flat(sk), d.nbytes, 0, 0))
            else:
                isz = transfers[mv.ti].dtype.itemsize
                self.local.append(LocalStep(False, d.typed(dk), s.typed(sk), d.nbytes,
                                            min(d.words, s.words),
                                            d.delta * isz | s.delta * isz))
        self.rounds = []
        for rnd in sched.rounds:
            posts, packs, unpacks, total = [], [], [], 0
            for msg in rnd.messages:
                side = (0 if rnd.phase == 0 else 1) if msg.is_send else 1
                segments = msg.segments
                if bases:  # a segment of a list of members: one per member, back to back
                    segments = [part for sg in segments for part in per_member_segments(
                        sg, 2 * sg.ti + side in bases, transfers[sg.ti].dtype.itemsize)]
                views = [view(sg.ti, side, sg.src_piece if msg.is_send else sg.dst_piece,
                              sg.box) for sg in segments]
                k, v = views[0]
                if len(views) == 1 and v.contiguous:  # straight from/to the tensor
                    posts.append(Post(msg.is_send, msg.peer, msg.tag, v.flat(k), 0,
                                      msg.nbytes))
                    continue
                for sg, (k, v) in zip(segments, views):
                    seg = (StagedSegment(total + sg.offset, sg.nbytes, transfers[sg.ti].dtype,
                                         None, True, v.flat(k), 0) if v.contiguous else
                           StagedSegment(total + sg.offset, sg.nbytes,
                                         transfers[sg.ti].dtype, box_shape(sg.box), False,
                                         v.typed(k), v.words))
                    (packs if msg.is_send else unpacks).append(seg)
                posts.append(Post(msg.is_send, msg.peer, msg.tag, None, total, msg.nbytes))
                total = align(total + msg.nbytes)
            self.rounds.append(RoundProgram(rnd.phase, total, tuple(posts),
                                            _stage_plan(packs, total),
                                            _stage_plan(unpacks, total)))
        self.staged = any(r.packs or r.unpacks for r in self.rounds)  # else: no staging

    # ---- copies -----------------------------------------------------------------------

    def _local_copies(self, tensors) -> None:
        copies, bits = Copies(), {}
        for step in self.local:
            if step.flat:
                copies.flat(flat_view(tensors, step.dst), flat_view(tensors, step.src),
                            step.nbytes)
                continue
            dst, src = typed_view(tensors, step.dst), typed_view(tensors, step.src)
            w = step.words
            if w and (_bits(tensors, step.dst.k, bits) | _bits(tensors, step.src.k, bits)
                      | step.skew) % w == 0:
                dst, src = as_words(dst, w), as_words(src, w)
            copies.exact(dst, src)
        copies.run()

    @staticmethod
    def _stage(buf, plan: StagePlan, tensors, pack: bool) -> None:
        """Copy segments into (pack) or out of the staging buffer. The buffer's pieces
        start at 16-byte aligned offsets: a typed segment goes as words whenever its
        tensor side can."""
        cpu_cat = pack and plan.whole and buf.device.type == "cpu"
        if plan.elements is not None:  # whole 1-D tensors of one dtype: as they are
            typed_buf = buf[:plan.nbytes].view(plan.dtype)
            if cpu_cat:
                torch.cat([tensors[ref.k] for _, ref, _ in plan.flat], out=typed_buf)
                return
            pieces, copies = typed_buf.split_with_sizes(plan.elements), Copies()
            for i, ref, nb in plan.flat:
                if pack:
                    copies.flat(pieces[i], tensors[ref.k], nb)
                else:
                    copies.flat(tensors[ref.k], pieces[i], nb)
            copies.run()
            return
        if cpu_cat:
            # one cat instead of a copy per segment: 1,000 segments of 8 KiB on CPU, 1.4 ms
            # against 3.0 (each copy_ costs the host ~1.5 µs); not measured on CUDA yet
            torch.cat([flat_view(tensors, ref) for _, ref, _ in plan.flat],
                      out=buf[:plan.nbytes])
            return
        pieces = buf[:plan.nbytes].split_with_sizes(plan.sizes)
        copies, bits = Copies(), {}
        for i, ref, nb in plan.flat:
            if pack:
                copies.flat(pieces[i], flat_view(tensors, ref), nb)
            else:
                copies.flat(flat_view(tensors, ref), pieces[i], nb)
        for i, dtype, shape, ref, w, skew in plan.typed:
            chunk, view = pieces[i].view(dtype).view(shape), typed_view(tensors, ref)
            if w and (_bits(tensors, ref.k, bits) | skew) % w == 0:
                chunk, view = as_words(chunk, w), as_words(view, w)
            if pack:
                copies.exact(chunk, view)
            else:
                copies.exact(view, chunk)
        copies.run()

    def _post(self, buf, posts, tensors, transport: P2PTransport, local_done: bool) -> bool:
        """Post one round's sends and receives (waited for on exit); the local copies run
        during the first round, overlapping its transfers. Returns whether they ran."""
        with transport.round():
            for p in posts:
                tensor = (buf[p.offset: p.offset + p.nbytes] if p.ref is None
                          else flat_view(tensors, p.ref))
                (transport.send if p.is_send else transport.recv)(tensor, p.peer, p.tag)
            if not local_done:
                self._local_copies(tensors)
                local_done = True
        return local_done

    # ---- CUDA staging and streams -------------------------------------------------------

    def _side_stream(self, device) -> "torch.cuda.Stream":
        """The program's CUDA side stream for packs, unpacks and local copies."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _slots(self, device, planner: Planner) -> list:
        """The planner's staging slots for the current stream, big enough for every round."""
        return planner.staging_slots(device, max(r.nbytes for r in self.rounds))

    def pack_ahead(self, tensors, transport: P2PTransport, planner: Planner,
                   ready: "torch.cuda.Event") -> Optional[EarlyPack]:
        """CUDA: allocate the staging slots and pack the first round now, on the side
        stream once the current stream reaches ``ready``, so that the pack overlaps the
        agreement step. Returns the pack for ``run``, or None when there is nothing to
        pack; a caller that does not go on to ``run`` calls its ``discard()``."""
        first = next((r for r in self.rounds if r.phase == 0), None)
        if transport.device.type != "cuda" or first is None or not first.packs:
            return None
        device = transport.device
        main, side = torch.cuda.current_stream(device), self._side_stream(device)
        slots = self._slots(device, planner)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            self._stage(slots[0], first.packs, tensors, pack=True)
            packed = torch.cuda.Event()
            packed.record(side)
        return EarlyPack(slots, packed, main)

    def run(self, tensors, transport: P2PTransport, planner: Planner,
            early: Optional[EarlyPack] = None) -> None:
        if transport.device.type == "cuda" and (self.staged or (self.local and self.rounds)):
            self._run_overlapped(tensors, transport, planner, early)
            return
        local_done = False
        for rnd in self.rounds:
            if rnd.phase == 1 and not local_done:  # phase-1 sends may forward local copies
                self._local_copies(tensors)
                local_done = True
            buf = (torch.empty(rnd.nbytes, dtype=torch.uint8, device=transport.device)
                   if rnd.nbytes else None)
            if rnd.packs:
                self._stage(buf, rnd.packs, tensors, pack=True)
            local_done = self._post(buf, rnd.posts, tensors, transport, local_done)
            if rnd.unpacks:
                self._stage(buf, rnd.unpacks, tensors, pack=False)
            buf = None  # freed before the next round's: one round's buffer at a time
        if not local_done:
            self._local_copies(tensors)

    def _run_overlapped(self, tensors, transport: P2PTransport, planner: Planner,
                        early: Optional[EarlyPack]) -> None:
        """CUDA: the copies of neighbouring rounds and the local copies run on a side
        stream during transfers.

        Per phase, with round k's buffer in slot k % 2: the side stream packs round k+1
        while round k is on the wire, then waits for round k and unpacks it; the current
        stream only waits for a round's pack before posting it. The local copies go on the
        side stream after the first round is posted: on the current stream they would
        run before the round's NCCL kernel (NCCL's stream waits for the current one when
        the group is launched), so a 128 MiB local copy delayed the transfer by its whole
        duration. No host sync. Every stream is joined back into the current one before
        returning, so the slots and the callers' tensors are released in order.
        """
        device = transport.device
        main, side = torch.cuda.current_stream(device), self._side_stream(device)
        slots = (early.slots if early is not None else
                 self._slots(device, planner) if self.staged else [None, None])
        local_done = not self.local
        for phase in (0, 1):
            rounds = [r for r in self.rounds if r.phase == phase]
            if not rounds:
                continue
            if phase == 1 and not local_done:  # phase-1 sends may forward local copies
                self._local_copies(tensors)
                local_done = True
            packed: list = []

            def pack(k: int) -> None:
                with torch.cuda.stream(side):
                    if rounds[k].packs:
                        self._stage(slots[k % 2], rounds[k].packs, tensors, pack=True)
                    packed.append(torch.cuda.Event())
                    packed[k].record(side)

            if phase == 0 and early is not None:
                packed.append(early.packed)
            else:
                side.wait_stream(main)  # data written on the current stream is visible
                pack(0)
            for k, rnd in enumerate(rounds):
                main.wait_event(packed[k])
                buf = slots[k % 2]
                self._post(buf, rnd.posts, tensors, transport, local_done=True)
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
                    if rnd.unpacks:
                        self._stage(buf, rnd.unpacks, tensors, pack=False)
            main.wait_stream(side)
        if not local_done:
            self._local_copies(tensors)
