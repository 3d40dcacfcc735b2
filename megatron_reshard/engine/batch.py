"""Per-batch state, cached on the Planner.

A refit sends the same batches again and again; only the tensors change. Everything here
is plain data derived from the batch description (and, for a ``Program``, from the
strides of this rank's tensors), so a warm call only checks its tensors, runs the
agreement step and moves bytes.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import NamedTuple, Optional

import torch

from .agree import Description, hash_ints
from .checks import expected
from .plan import mesh_key, batch_fingerprint
from .program import Program
from .schedule import Schedule


class LightItem(NamedTuple):
    """One transfer in a ``light_key``."""

    name: str
    dtype: object
    layout: tuple  # (shape, src mesh key, src placements, dst mesh key, dst placements, world)


def light_key(transfers, world: int) -> Optional[tuple]:
    """A hashable description of the batch that is cheap to build on every call: per
    transfer (name, dtype, (shape, src mesh key, src placements, dst mesh key, dst
    placements, group size)). Placements stay objects (``Shard(0) == Shard(0)``); anything
    odd (meshes without a key) gives None: no caching, full path."""
    mesh_keys: dict = {}  # id -> key, for this call only (the meshes are alive meanwhile)
    try:
        items = []
        for t in transfers:
            sm, dm = t.src_mesh, t.dst_mesh
            sk = mesh_keys.get(id(sm))
            if sk is None:
                sk = mesh_keys[id(sm)] = mesh_key(sm)
            dk = mesh_keys.get(id(dm))
            if dk is None:
                dk = mesh_keys[id(dm)] = mesh_key(dm)
            lay = (tuple(map(int, t.global_shape)), sk, tuple(t.src_placements),
                   dk, tuple(t.dst_placements), world)
            items.append(LightItem(t.name, t.dtype, lay))
    except Exception:
        return None
    return tuple(items)


_ROW = attrgetter("name", "dtype", "global_shape", "src_mesh", "src_placements", "dst_mesh",
                  "dst_placements")


def layout_rows(transfers) -> list:
    """Per transfer: name, dtype, global shape, meshes and placements, as given, compared
    with ``==`` against the rows a cached batch was built from (``kept_rows``). The
    comparison is exact (by value) and, for the same objects on every call (a refit loop),
    an identity check in C: one ``attrgetter`` per param, where the light key's placement
    hashing costs ~1 µs."""
    return list(map(_ROW, transfers))


def kept_rows(rows: list) -> Optional[list]:
    """``rows`` as remembered: a list given in a row (placements, a shape) is copied, so
    that changing it in place afterwards makes the next call's rows differ. None (not
    remembered): a global shape that is not a tuple or list (a tensor's ``==`` is not a
    bool)."""
    if not _SHAPES.issuperset(map(type, map(_GLOBAL_SHAPE, rows))):
        return None
    return [row if list not in set(map(type, row)) else
            tuple(list(v) if type(v) is list else v for v in row) for row in rows]


_SHAPES = frozenset((tuple, list, torch.Size))
_GLOBAL_SHAPE = itemgetter(2)


def rows_head(me: int, staging_bytes: int, transfers) -> tuple:
    """The cheap dict key under which ``layout_rows`` are remembered (verified on a hit)."""
    return (me, staging_bytes, len(transfers), transfers[0].name if transfers else None,
            transfers[-1].name if transfers else None)


def signature(strided: tuple) -> int:
    """A rank's vote for its non-standard tensors: 0 for none, else a hash of them."""
    return hash_ints(strided) if strided else 0


class StridedTensors(NamedTuple):
    """A rank's non-standard-contiguous tensors: their indices k and vote signature."""

    tensors: tuple
    signature: int


class Batch:
    """What one batch description gives on this rank: plans, fingerprint, what each local
    tensor must look like, the schedule, and execution programs per tensor-stride
    signature."""

    def __init__(self, transfers, plans, me: int) -> None:
        self.plans = plans
        self.items = [(t.name, str(t.dtype), p.fingerprint) for t, p in zip(transfers, plans)]
        self.fp_hex = batch_fingerprint(self.items)
        self.fp = int(self.fp_hex[:15], 16)
        # per tensor of the call (src, dst of each transfer): its local shape and dtype
        # on this rank, None where this rank holds no tensor (checks.local_ok)
        shapes, dtypes = [], []
        for t, p in zip(transfers, plans):
            for own in (p.src.get(me), p.dst.get(me)):
                shapes.append(None if own is None else own.local_shape)
                dtypes.append(None if own is None else t.dtype)
        self.expected = expected(shapes, dtypes)
        self.sched: Optional[Schedule] = None  # built after the agreement step
        self.sched_hash = 0  # hash_ints of every rank's signature it was built for
        self.programs: dict = {}
        self.fusion = None  # fuse.Fusion: small params of one layout moved as one
        self._strided: dict = {}  # strides -> this rank's non-standard tensors (k)
        self.lane = None  # lane.Lane: the last call that skipped its vote, to match at once

    def strided_of(self, strides: tuple, tensors: list) -> "StridedTensors":
        """This rank's tensors that are not standard-contiguous (cached per strides)."""
        got = self._strided.get(strides)
        if got is None:
            if len(self._strided) >= 8:
                self._strided.clear()
            ks = tuple(k for k, x in enumerate(tensors)
                       if x is not None and (not isinstance(x, torch.Tensor)
                                             or not x.is_contiguous()))
            got = self._strided[strides] = StridedTensors(ks, signature(ks))
        return got

    @property
    def exec_plans(self) -> list:
        """The plans the schedule is built from: one per transfer, or per fused group."""
        return self.plans if self.fusion is None else list(self.fusion.plans)

    def program(self, xfers, me: int, strides: tuple) -> Program:
        """The schedule resolved for these tensor strides (cached); ``xfers``: the
        transfers as run (fused groups in place of their members)."""
        prog = self.programs.get(strides)
        if prog is None:
            prog = Program(self.sched, xfers, self.exec_plans, me)
            if len(self.programs) >= 8:
                self.programs.clear()
            self.programs[strides] = prog
        return prog

    def description(self, transfers) -> Description:
        """How this rank describes the batch (for the agreement's failure path)."""

        def text(i: int) -> str:
            t = transfers[i]
            shape, s_shape, s_ranks, _, d_shape, d_ranks, _ = self.plans[i].key
            return (f"{t.name!r} {t.dtype} global shape {shape}: src mesh {list(s_ranks)} "
                    f"(shape {s_shape}) {list(t.src_placements)} -> dst mesh "
                    f"{list(d_ranks)} (shape {d_shape}) {list(t.dst_placements)}")

        return Description([t.name for t in transfers],
                           lambda: [hash_ints(item) for item in self.items], text)
