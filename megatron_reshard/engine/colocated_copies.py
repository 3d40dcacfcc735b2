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
its leading dims where that works): large contiguous pairs as one memcpy each; on CUDA
the other contiguous, 8-byte aligned pairs (a rank's experts into vLLM's stacked
``w13``/``w2``) as one Triton kernel that reads every source through a
device table of pointers (one launch instead of one per expert, docs/MEASUREMENTS.md);
everything else as ``torch._foreach_copy_`` of integer views (bits, never float maths).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_reshard.groups.faults import RefitError

from .copies import MEMCPY_BYTES, as_bits
from .geometry import box_intersect, box_numel
from .members import is_members


def _views(x, piece, sub) -> list:
    """Views of ``sub`` (a box inside ``piece.box``) in local ``x``: one tensor, or one per
    index of dim 0 when ``x`` is a list of members."""
    idx = piece.index(sub)
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
    parts = [(dst, src)]
    while not all(d.is_contiguous() and s.is_contiguous() for d, s in parts):
        if parts[0][0].dim() < 2 or len(parts) * parts[0][0].shape[0] > SPLIT_MOST:
            return [(dst, src)]
        parts = [(d[k], s[k]) for d, s in parts for k in range(d.shape[0])]
    return parts


def _aligned(d: torch.Tensor, s: torch.Tensor) -> bool:
    nbytes = d.numel() * d.element_size()
    return (d.is_contiguous() and s.is_contiguous() and nbytes % 8 == 0
            and (d.data_ptr() | s.data_ptr()) % 8 == 0)


class CopyBatch:
    """The copies of one batch on one generation rank, grouped once, run every refit."""

    def __init__(self, pairs: list, device: torch.device):
        self.device = device
        self.memcpy, small, self.dsts, self.srcs = [], [], [], []
        cuda = device.type == "cuda"
        for whole in pairs:
            for dst, src in _contiguous_parts(*whole):
                if dst.numel() == 0:
                    continue
                if (dst.numel() * dst.element_size() >= MEMCPY_BYTES and dst.is_contiguous()
                        and src.is_contiguous()):
                    self.memcpy.append((dst, src))
                elif cuda and _aligned(dst, src):
                    small.append((dst, src))
                else:  # CUDA foreach of a float dtype rewrites NaN payloads: copy bits
                    self.dsts.append(as_bits(dst) if cuda else dst)
                    self.srcs.append(as_bits(src) if cuda else src)
        self.table = pointer_table([d for d, _ in small], [s for _, s in small])
        if self.table is None:
            self.dsts += [as_bits(d) for d, _ in small]
            self.srcs += [as_bits(s) for _, s in small]
        self.pairs = len(self.memcpy) + len(small) + len(self.dsts)

    def run(self) -> None:
        for dst, src in self.memcpy:
            dst.copy_(src)
        if self.table is not None:
            self.table.run()
        if self.dsts:
            torch._foreach_copy_(self.dsts, self.srcs)


class PointerTable:
    """Many contiguous same-size-element copies in one Triton launch (see module doc)."""

    BLOCK = 4096  # 8-byte words per program

    def __init__(self, kernel, dsts: list, srcs: list, device: torch.device):
        words = [d.numel() * d.element_size() // 8 for d in dsts]
        self.kernel = kernel
        self.dst_ptrs = torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64, device=device)
        self.src_ptrs = torch.tensor([s.data_ptr() for s in srcs], dtype=torch.int64, device=device)
        self.words = torch.tensor(words, dtype=torch.int64, device=device)
        self.grid = (max(-(-w // self.BLOCK) for w in words), len(dsts))
        self._keep = (dsts, srcs)  # the views (and their mapped storages) outlive the table

    def run(self) -> None:
        self.kernel[self.grid](self.dst_ptrs, self.src_ptrs, self.words, BLOCK=self.BLOCK)


def pointer_table(dsts: list, srcs: list) -> Optional[PointerTable]:
    """A ``PointerTable`` for contiguous, 8-byte aligned pairs (``_aligned``) when Triton
    loads; else None (the caller keeps the foreach copy)."""
    if len(dsts) < 2:
        return None
    kernel = _triton_kernel()
    return None if kernel is None else PointerTable(kernel, dsts, srcs, dsts[0].device)


_KERNEL: list = []


def _triton_kernel():
    """The word-copy kernel (built once); None when Triton is absent."""
    if _KERNEL:
        return _KERNEL[0]
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - CPU builds of torch ship no Triton
        _KERNEL.append(None)
        return None

    @triton.jit
    def copy_words(dst_ptrs, src_ptrs, words, BLOCK: tl.constexpr):
        pair = tl.program_id(1)
        n = tl.load(words + pair)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        src = tl.load(src_ptrs + pair).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptrs + pair).to(tl.pointer_type(tl.int64))
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    _KERNEL.append(copy_words)
    return copy_words
