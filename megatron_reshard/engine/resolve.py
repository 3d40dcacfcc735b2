"""A rank's schedule resolved into views of its tensors: the steps a ``Program`` runs.

A message of one segment whose view is contiguous on this side goes straight from/to the
tensor; others go through the round's staging buffer. Staged segments and local copies
whose views are contiguous are copied as bytes (``FlatRef``), all of a round at once;
strided ones as typed views (``TypedRef``), or as words. Everything here depends only on
the schedule, the plans and the strides of this rank's tensors (the program's cache key).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .copies import WIDEN_BYTES, FlatRef, RowsRef, Strided, TypedRef, word_bytes
from megatron_reshard.layout.permuted_rows import PermutedRows
from megatron_reshard.layout.geometry import box_shape
from .members import is_members, per_member_segments, unit_boxes
from .schedule import Schedule, align, is_contiguous
from .steps import LocalStep, Post, RoundProgram, StagedSegment, stage_plan


class ViewGeom(NamedTuple):
    """Where a view lies in its tensor (shared by every tensor of the same plan and
    strides; ``typed``/``flat`` make the refs for tensor k)."""

    contiguous: bool
    strided: Optional[Strided]  # None: the whole tensor
    numel: Optional[int]        # None: the whole tensor, 1-D with stride 1
    delta: int                  # storage offset from the tensor's
    nbytes: int                 # bytes of the view
    words: int                  # strided views: the word size to copy in (``word_bytes``)
    rows: Optional[tuple] = None  # slices of a permuted-row destination (never contiguous)

    def typed(self, k: int) -> TypedRef:
        if self.rows is not None:
            return RowsRef(k, self.rows)
        return TypedRef(k, self.strided)

    def flat(self, k: int) -> FlatRef:
        return FlatRef(k, self.numel, self.delta)


class TensorView(NamedTuple):
    """A view of tensor ``k`` of the call (members of lists numbered after the call's)."""

    k: int
    geom: ViewGeom


class Resolved(NamedTuple):
    local: tuple     # tuple[LocalStep, ...]
    rounds: tuple    # tuple[RoundProgram, ...]
    rows: frozenset = frozenset()  # k of the destinations in a permuted-row order


class _Views:
    """The views of one rank's tensors, by (transfer, side, piece, box); many params share
    a plan and strides, so each geometry is computed once."""

    def __init__(self, transfers, plans, me: int) -> None:
        self.transfers, self.plans, self.me = transfers, plans, me
        self.shapes, self.strides = {}, {}
        self.bases = {}  # k of a list of members (members.py) -> index of its first member
        self.rows = set()  # k of a destination in a kernel's permuted-row order
        count = 2 * len(transfers)
        for ti, t in enumerate(transfers):
            for side, x in ((0, t.src), (1, t.dst)):
                if x is None:
                    continue
                k = 2 * ti + side
                if is_members(x):
                    self.bases[k], count = count, count + len(x)
                    for e, m in enumerate(x):
                        self.shapes[self.bases[k] + e] = tuple(m.shape)
                        self.strides[self.bases[k] + e] = m.stride()
                    continue
                if isinstance(x, PermutedRows):
                    self.rows.add(k)
                    self.shapes[k], self.strides[k] = tuple(x.shape), None
                    continue
                self.shapes[k], self.strides[k] = tuple(x.shape), x.stride()
        self.geometry: dict = {}

    def own(self, ti: int, side: int):
        return (self.plans[ti].src if side == 0 else self.plans[ti].dst)[self.me]

    def view(self, ti: int, side: int, piece: int, box: tuple) -> TensorView:
        """Tensor k and the geometry of the view of ``box`` in it (a box of a list of
        members lies in one member: its index of dim 0 picks the member, and the view
        keeps a leading dim of one)."""
        k = 2 * ti + side
        member = k in self.bases
        if member:
            k = self.bases[k] + self.own(ti, side).pieces[piece].index(box)[0].start
        strides = self.strides[k]
        # plans are cached by layout, so id() names a layout here (the list holds them)
        key = (id(self.plans[ti]), side, piece, box, strides, member)
        got = self.geometry.get(key)
        if got is None:
            got = self.geometry[key] = self._geom(ti, side, piece, box, k, member)
        return TensorView(k, got)

    def _geom(self, ti: int, side: int, piece: int, box: tuple, k: int,
              member: bool) -> ViewGeom:
        index = self.own(ti, side).pieces[piece].index(box)
        size = tuple(e - s for s, e in box)
        itemsize = self.transfers[ti].dtype.itemsize
        if k in self.rows:  # staged or copied into the order, never a message's buffer
            numel = 1
            for n in size:
                numel *= n
            return ViewGeom(False, None, numel, 0, numel * itemsize, 0, index)
        st_k = self.strides[k]
        if member:  # the view keeps dim 0, of one index, over the member's dims
            st_k = (0, *st_k)
            index = (slice(0, 1, 1), *index[1:])
        stride = tuple(st * sl.step for st, sl in zip(st_k, index))
        delta = sum(st * sl.start for st, sl in zip(st_k, index))
        numel = 1
        for n in size:
            numel *= n
        whole = delta == 0 and size == self.shapes[k] and stride == tuple(self.strides[k])
        simple = whole and len(size) == 1 and stride == (1,)
        return ViewGeom(is_contiguous(size, stride), None if whole else Strided(size, stride, delta),
                        None if simple else numel, delta, numel * itemsize,
                        word_bytes(size, stride, itemsize))

    def cut(self, ti: int, box: tuple) -> list:
        """``box`` per member where a side of transfer ti is a list of members."""
        members = 2 * ti in self.bases or 2 * ti + 1 in self.bases
        return unit_boxes(box) if members else [box]


def _local_step(views: _Views, mv) -> LocalStep:
    d, s = (views.view(mv.ti, 1, mv.dst_piece, mv.box),
            views.view(mv.ti, 0, mv.src_piece, mv.box))
    dg, sg = d.geom, s.geom
    if (dg.strided is None and sg.strided is None and dg.contiguous and sg.contiguous
            and dg.nbytes < WIDEN_BYTES):
        # small whole tensor to whole tensor: copied as they are, no view made per call
        # (larger ones go as bytes, which copy as words or a memcpy)
        return LocalStep(False, dg.typed(d.k), sg.typed(s.k), dg.nbytes, 0, 0)
    if dg.contiguous and sg.contiguous:
        return LocalStep(True, dg.flat(d.k), sg.flat(s.k), dg.nbytes, 0, 0)
    isz = views.transfers[mv.ti].dtype.itemsize
    return LocalStep(False, dg.typed(d.k), sg.typed(s.k), dg.nbytes, min(dg.words, sg.words),
                     dg.delta * isz | sg.delta * isz)


def _round(views: _Views, rnd) -> RoundProgram:
    posts, packs, unpacks, total = [], [], [], 0
    for msg in rnd.messages:
        side = (0 if rnd.phase == 0 else 1) if msg.is_send else 1
        segments = msg.segments
        if views.bases:  # a segment of a list of members: one per member, back to back
            segments = [part for sg in segments for part in per_member_segments(
                sg, 2 * sg.ti + side in views.bases,
                views.transfers[sg.ti].dtype.itemsize)]
        tviews = [views.view(sg.ti, side, sg.src_piece if msg.is_send else sg.dst_piece,
                             sg.box) for sg in segments]
        first = tviews[0]
        if len(tviews) == 1 and first.geom.contiguous:  # straight from/to the tensor
            posts.append(Post(msg.is_send, msg.peer, msg.tag, first.geom.flat(first.k), 0,
                              msg.nbytes))
            continue
        for sg, tv in zip(segments, tviews):
            dtype, v = views.transfers[sg.ti].dtype, tv.geom
            seg = (StagedSegment(total + sg.offset, sg.nbytes, dtype, None, True,
                                 v.flat(tv.k), 0) if v.contiguous else
                   StagedSegment(total + sg.offset, sg.nbytes, dtype, box_shape(sg.box),
                                 False, v.typed(tv.k), v.words))
            (packs if msg.is_send else unpacks).append(seg)
        posts.append(Post(msg.is_send, msg.peer, msg.tag, None, total, msg.nbytes))
        total = align(total + msg.nbytes)
    return RoundProgram(rnd.phase, total, tuple(posts), stage_plan(packs, total),
                        stage_plan(unpacks, total))


def resolve(sched: Schedule, transfers, plans, me: int) -> Resolved:
    """The steps of rank ``me`` for ``sched``, on the tensors (and their strides) of
    ``transfers``."""
    views = _Views(transfers, plans, me)
    local = tuple(_local_step(views, m._replace(box=b))
                  for m in sched.local for b in views.cut(m.ti, m.box))
    return Resolved(local, tuple(_round(views, rnd) for rnd in sched.rounds),
                    frozenset(views.rows))
