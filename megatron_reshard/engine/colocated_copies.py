"""The reads of a colocated refit: which mapped source view fills which destination view,
and how the copies are issued.

Torch + stdlib only (Triton, when the CUDA build of torch ships it, loads lazily).

``read_pairs`` derives a generation rank's reads from the plan's ownerships alone (the
planner's ``ParamPlan.src`` / ``.dst``): every destination piece is intersected with one
holder of each distinct source box. Replicated sources (the same boxes on several
training ranks) are read from one of them, ``holders[me % len(holders)]``, so that
generation replicas spread their reads. The pieces read must cover each destination
piece exactly once; a plan that does not is refused before any copy.

``CopyBatch`` issues the pairs (a strided pair first cut into contiguous sub-pairs along
its leading dims where that works). On CUDA with Triton, every contiguous, 8-byte
aligned pair, whatever its size (a rank's experts into vLLM's stacked ``w13``/``w2``, the
embedding, the q/k/v blocks), is copied by one kernel launch (``kernel_copies.BlockTable``:
it reads every source through device tables of pointers), and strided pairs that fold
into tiles by one more per kind (``TileTable``). Elsewhere large contiguous pairs are one
memcpy each. Everything else is ``torch._foreach_copy_`` of integer views (bits, never
float maths). On CUDA, after its first (eager) run, the kernels and the foreach copies
are captured once into a CUDA graph and replayed (``kernel_copies.Replayed``): one cheap
launch. Measured on one H200 (docs/MEASUREMENTS.md): an eager memcpy's first call took
~80 µs of host time before its bytes moved, the Triton launcher ~40 µs, and memcpys
captured as graph nodes ran at 73% of an eager memcpy's speed. The graph holds raw
addresses; the batch keeps every view it reads and writes alive.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from megatron_reshard.groups.faults import RefitError

from .copies import MEMCPY_BYTES, as_bits
from megatron_reshard.layout.geometry import box_intersect, box_numel
from megatron_reshard.layout.permuted_rows import PermutedRows, ScatteredRows
from .kernel_copies import KernelCopies, Replayed, permuted_tables
from .members import is_members


def _views(x, piece, sub) -> list:
    """Views of ``sub`` (a box inside ``piece.box``) in local ``x``: one tensor, or one per
    index of dim 0 when ``x`` is a list of members; a permuted-row destination's sub-box."""
    idx = piece.index(sub)
    if isinstance(x, PermutedRows):  # (a box that cuts its runs: their offsets)
        return [x.box(idx)]
    if is_members(x):
        first = idx[0]
        return [x[k][idx[1:]] for k in range(first.start, first.stop, first.step)]
    return [x[idx]]


def _paired(dsts: list, srcs: list) -> list:
    if len(dsts) == len(srcs):
        return list(zip(dsts, srcs))
    if len(dsts) == 1:  # a stacked destination filled from members
        return list(zip(dsts[0].unbind(0), srcs))
    return list(zip(dsts, srcs[0].unbind(0)))


def read_pairs(transfers, plans, me: int, sources: dict) -> list:
    """``[(dst view, src view), ...]`` for generation rank ``me``; ``sources[r][i]`` is
    training rank ``r``'s mapped local tensor (or members) of transfer ``i``."""
    pairs = []
    for i, (t, plan) in enumerate(zip(transfers, plans)):
        own = plan.dst.get(me)
        if own is None:
            continue
        holders: dict = {}
        for r in sorted(plan.src):
            holders.setdefault(plan.src[r].boxes, []).append(r)
        for dpiece in own.pieces:
            covered = 0
            for ranks in holders.values():
                r = ranks[me % len(ranks)]
                mapped = sources.get(r)
                if mapped is None or mapped[i] is None:
                    raise RefitError(f"colocated refit, param {t.name!r}: group rank {r} holds "
                                     f"a source box but published no view of it")
                for spiece in plan.src[r].pieces:
                    sub = box_intersect(dpiece.box, spiece.box)
                    if sub is None:
                        continue
                    covered += box_numel(sub)
                    pairs += _paired(_views(t.dst, dpiece, sub), _views(mapped[i], spiece, sub))
            if covered != box_numel(dpiece.box):
                raise RefitError(f"colocated refit, param {t.name!r} on group rank {me}: the "
                                 f"sources cover {covered} of the {box_numel(dpiece.box)} "
                                 f"elements of destination box {dpiece.box}")
    return pairs


SPLIT_MOST = 1024  # leading-dim splits of one strided pair into contiguous sub-pairs


def _contiguous_parts(dst: torch.Tensor, src: torch.Tensor) -> list:
    """The pair cut along its leading dims until both sides are contiguous (q/k/v blocks
    of Megatron's interleaved rows: one contiguous block per KV group), or as it is."""
    if isinstance(dst, (PermutedRows, ScatteredRows)):
        return [(dst, src)]
    parts = [(dst, src)]
    while not all(d.is_contiguous() and s.is_contiguous() for d, s in parts):
        if parts[0][0].dim() < 2 or len(parts) * parts[0][0].shape[0] > SPLIT_MOST:
            return [(dst, src)]
        parts = [(d[k], s[k]) for d, s in parts for k in range(d.shape[0])]
    return parts


class CopyBatch:
    """The copies of one batch on one generation rank, grouped once, run every refit."""

    def __init__(self, pairs: list, device: torch.device):
        self.device = device
        parts = [p for whole in pairs for p in _contiguous_parts(*whole) if p[0].numel()]
        cuda = device.type == "cuda"
        # destinations in a kernel's permuted-row order: one launch per kind, written
        # straight from the sources (kernel_copies.PermutedTable); torch scatters elsewhere
        permuted = [p for p in parts if isinstance(p[0], PermutedRows)]
        scattered = [p for p in parts if isinstance(p[0], ScatteredRows)]
        parts = [p for p in parts if isinstance(p[0], torch.Tensor)]
        self.permuted, self.permuted_rest = permuted_tables(permuted, device)
        self.permuted_rest += scattered
        # the 8-byte aligned contiguous pairs in one launch when there are several, the
        # strided ones that fold into tiles in one per kind (kernel_copies.py); the rest as
        # a memcpy per large contiguous pair, else foreach copies of integer views
        self.kernels = KernelCopies(parts, device, min_blocks=2)
        rest = self.kernels.rest
        self.memcpy, self.dsts, self.srcs = [], [], []
        for dst, src in rest:
            if (dst.numel() * dst.element_size() >= MEMCPY_BYTES and dst.is_contiguous()
                    and src.is_contiguous()):
                self.memcpy.append((dst, src))
            else:  # CUDA foreach of a float dtype rewrites NaN payloads: copy bits
                self.dsts.append(as_bits(dst) if cuda else dst)
                self.srcs.append(as_bits(src) if cuda else src)
        self.pairs = len(parts) + len(permuted) + len(scattered)
        # the kernels and foreach copies captured once (after the first, eager run) and
        # replayed: one cheap launch
        # held weakly: a cycle would keep a done batch's tensors alive until a gc pass
        small = weakref.WeakMethod(self._small)
        self.replayed = Replayed(lambda: small()(), device, after=1 if (
            self.kernels.tables or self.dsts or self.permuted) else 0)

    @property
    def graph(self):
        """The captured copies, replayed from the second run on (None: eager)."""
        return self.replayed.graph

    @property
    def graph_error(self) -> Optional[str]:
        """Why the copies could not be captured (then they run eagerly)."""
        return self.replayed.error

    @property
    def runs(self) -> int:
        """The eager runs so far."""
        return self.replayed.runs

    def run(self) -> None:
        for dst, src in self.memcpy:
            dst.copy_(src)
        for dst, src in self.permuted_rest:
            dst.write(src)
        self.replayed()

    def _small(self) -> None:
        for table in self.permuted:
            table.run()
        self.kernels.run()
        if self.dsts:
            torch._foreach_copy_(self.dsts, self.srcs)
