"""The region-wide scans of delta refits on CUDA tensors, as Triton kernels (issue 35).

Torch + stdlib only: Triton, which the CUDA builds of torch ship, loads lazily, and
``refit.delta_transport`` keeps its torch path where it is absent (CPU tensors, CPU builds)
or switched off (``MEGATRON_RESHARD_DELTA_KERNELS=0``). ``delta_transport.encode`` /
``apply`` call these for CUDA tensors and do the rest (GAPS bytes, DIFF8 steps, escapes)
with torch ops on the changed elements only, so the payload is the torch path's, byte for
byte.

Cut: ``mark`` reads new and old once (bits as integers, so NaN payloads and -0.0 compare
exactly), writes the bitmask (the wire's BITMASK index as it is) and one count per block
of ``BLOCK`` elements; after one host read of the total (the header needs it),
``changed`` writes the int64 positions and the values of the changed elements, each block
at its offset (an exclusive cumsum of the counts) plus its rank inside the block
(``tl.cumsum``): ``compact`` reads the bitmask again and only the changed values (masked
loads). ``FUSED``: ``mark`` packs each block's changes into scratch itself and ``gather``
moves only those (measured slower on H200: the scratch writes cost ``mark`` a third).

Apply of a BITMASK delta: ``bitmask_counts`` (checked against the header before any
write), then ``apply_bitmask`` writes whole values into the view, or ``bitmask_positions``
gives the positions for DIFF8's steps. A strided view is handled when it folds into rows
of unit stride (``rows_form``: a TP shard's column block).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch


BLOCK = 4096  # elements per program (a multiple of 8: whole bitmask bytes)
FUSED = False  # True: mark packs each block's changes itself (measured slower on H200)
WARPS = 4
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def enabled() -> bool:
    """Whether the kernels may be used (``MEGATRON_RESHARD_DELTA_KERNELS=0``: no)."""
    return os.environ.get("MEGATRON_RESHARD_DELTA_KERNELS", "1") != "0"


def usable(t: torch.Tensor) -> bool:
    """Whether ``t``'s deltas go through the kernels: a CUDA tensor of 1, 2, 4 or 8 bytes
    an element, with Triton present and the kernels switched on."""
    return (t.is_cuda and t.element_size() in _INTS and enabled()
            and _kernels() is not None)


class Rows(NamedTuple):
    """A view as ``rows`` x ``cols`` elements, unit stride along cols, ``stride`` between
    rows (a contiguous view: one row)."""

    rows: int
    cols: int
    stride: int


def rows_form(view: torch.Tensor) -> Optional[Rows]:
    """The view as rows of unit stride, or None when its dims do not fold so."""
    dims = []
    for n, s in zip(view.shape, view.stride()):
        if n == 1:
            continue
        if dims and dims[-1][1] == s * n:
            dims[-1] = (dims[-1][0] * n, s)
        else:
            dims.append((n, s))
    if not dims:
        return Rows(1, max(1, view.numel()), 0)
    if dims[-1][1] != 1 or len(dims) > 2:
        return None
    if len(dims) == 1:
        return Rows(1, dims[0][0], 0)
    return Rows(dims[0][0], dims[1][0], dims[0][1])


# -- cut ------------------------------------------------------------------------------

def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INTS[t.element_size()]).reshape(-1)


class Marked(NamedTuple):
    """What ``mark`` found: the bitmask (whole blocks of bytes; bits past the region 0),
    the changed count per block, and, when ``FUSED``, each block's changed positions (in
    the block, int32) and values packed at the block's own start (scratch)."""

    mask: torch.Tensor
    counts: torch.Tensor
    spos: Optional[torch.Tensor]
    svals: Optional[torch.Tensor]


def mark(new: torch.Tensor, old: torch.Tensor) -> Marked:
    """Compare the bits of ``new`` and ``old`` (one launch, each read once)."""
    a, b = _flat_bits(new), _flat_bits(old.to(new.device))
    n = a.numel()
    blocks = max(1, -(-n // BLOCK))
    mask = torch.empty(blocks * BLOCK // 8, dtype=torch.uint8, device=a.device)
    counts = torch.empty(blocks, dtype=torch.int64, device=a.device)
    spos = torch.empty(n if FUSED else 0, dtype=torch.int32, device=a.device)
    svals = torch.empty(n if FUSED else 0, dtype=a.dtype, device=a.device)
    _kernels().mark[(blocks,)](a, b, n, mask, counts, spos, svals, FUSED=FUSED, BLOCK=BLOCK,
                               num_warps=WARPS)
    return Marked(mask, counts, spos if FUSED else None, svals if FUSED else None)


def changed(a: torch.Tensor, marked: Marked, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 positions, values) of the ``count`` changed elements of the flat bits ``a``
    that ``marked`` found: one launch, each block's at its offset (an exclusive cumsum of
    the counts). Fused: the blocks' scratch moved into place (only changed elements read);
    else the bitmask read again and the changed values loaded from ``a``."""
    counts = marked.counts
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty(count, dtype=torch.int64, device=a.device)
    values = torch.empty(count, dtype=a.dtype, device=a.device)
    k = _kernels()
    if marked.spos is not None:
        k.gather[(counts.numel(),)](marked.spos, marked.svals, counts, starts, pos, values,
                                    BLOCK=BLOCK, num_warps=WARPS)
        return pos, values
    k.compact[(counts.numel(),)](a, a.numel(), marked.mask, marked.mask.numel(), starts, pos,
                                 values, WRITE_VALUES=True, ALIGNED=True, ITEM=a.element_size(),
                                 BLOCK=BLOCK, num_warps=WARPS)
    return pos, values


# -- apply ----------------------------------------------------------------------------

def bitmask_counts(index: torch.Tensor, numel: int) -> torch.Tensor:
    """Set bits per block of a bitmask of ``numel`` elements (bits past them ignored)."""
    blocks = max(1, -(-numel // BLOCK))
    counts = torch.empty(blocks, dtype=torch.int64, device=index.device)
    _kernels().count_bits[(blocks,)](index, numel, counts, BLOCK=BLOCK, num_warps=WARPS)
    return counts


def bitmask_positions(index: torch.Tensor, numel: int, counts: torch.Tensor,
                      count: int) -> torch.Tensor:
    """The int64 positions of a bitmask's set bits (``count``: their checked total)."""
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty(count, dtype=torch.int64, device=index.device)
    _kernels().compact[(counts.numel(),)](index, numel, index, index.numel(), starts, pos, pos,
                                          WRITE_VALUES=False, ALIGNED=True, ITEM=8,
                                          BLOCK=BLOCK, num_warps=WARPS)
    return pos


def apply_bitmask(view: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                  counts: torch.Tensor) -> bool:
    """Write whole values (bytes) at a bitmask's set bits into ``view`` in place; False
    when the view does not fold into rows (the caller takes the torch path)."""
    form = rows_form(view)
    if form is None:
        return False
    item = view.element_size()
    target = view.view(_INTS[item])
    aligned = values.storage_offset() % item == 0
    vals = values.view(target.dtype) if aligned else values
    _kernels().apply_bitmask[(counts.numel(),)](
        target, index, torch.cumsum(counts, 0) - counts, vals, view.numel(), form.cols,
        form.stride, CONTIG=form.rows == 1, ROW8=form.cols % 8 == 0, ALIGNED=aligned,
        ITEM=item, BLOCK=BLOCK, num_warps=WARPS)
    return True


# -- the kernels ----------------------------------------------------------------------

class _Kernels(NamedTuple):
    mark: object
    gather: object
    compact: object
    count_bits: object
    apply_bitmask: object


_BUILT: list = []


def _kernels() -> Optional[_Kernels]:
    if _BUILT:
        return _BUILT[0]
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - CPU builds of torch ship no Triton
        _BUILT.append(None)
        return None

    # Every block is a [BLOCK // 8, 8] tile: row k holds elements 8k..8k+7, the bits of
    # bitmask byte k, so packing and unpacking stay inside a thread (no reshape across
    # threads), and a rank in the block is a cumsum along the 8 plus one along the rows.
    # Offsets inside a block are int32 from pointers moved to the block once (64-bit
    # arithmetic and division per element cost more than the bytes).

    @triton.jit
    def _local(BLOCK: tl.constexpr):
        return tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]

    @triton.jit
    def _bits(mask, block, left, limit, BLOCK: tl.constexpr):
        # the block's bits as one int32 per element (0 past the region: ``left`` elements
        # remain from the block's first), and their offsets in the block
        j = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(mask + j, mask=j < limit, other=0).to(tl.int32)
        loc = _local(BLOCK)
        bits = tl.where(loc < left, (byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, 0)
        return bits, loc

    @triton.jit
    def _ranks(bits):
        # each element's 0-based rank among the set bits of its block, row-major
        row = tl.sum(bits, axis=1)
        return (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(bits, axis=1) - 1

    @triton.jit
    def _put(out, start, o, v, keep, ALIGNED: tl.constexpr, ITEM: tl.constexpr):
        # store value v (integer bits) at element start + o of out; bytes when unaligned
        if ALIGNED:
            tl.store(out + start + o, v, mask=keep)
        else:
            for k in tl.static_range(ITEM):
                tl.store(out + start * ITEM + o * ITEM + k, ((v >> (8 * k)) & 0xFF).to(tl.uint8),
                         mask=keep)

    @triton.jit
    def _get(src, start, o, keep, like, ALIGNED: tl.constexpr, ITEM: tl.constexpr):
        # the value at element start + o of src (bits of like's type); bytes when unaligned
        if ALIGNED:
            v = tl.load(src + start + o, mask=keep, other=0)
        else:
            w = tl.zeros_like(like).to(tl.int64)
            for k in tl.static_range(ITEM):
                byte = tl.load(src + start * ITEM + o * ITEM + k, mask=keep, other=0)
                w = w | (byte.to(tl.int64) << (8 * k))
            v = w.to(like.dtype)
        return v

    # the kernels find the helpers they call among the module's globals, not in closures
    globals().update(_local=_local, _bits=_bits, _ranks=_ranks, _put=_put, _get=_get)

    @triton.jit
    def mark(a, b, n, mask, counts, spos, svals, FUSED: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        loc = _local(BLOCK)
        inside = loc < n - first
        va = tl.load(a + first + loc, mask=inside, other=0)
        d = (va != tl.load(b + first + loc, mask=inside, other=0)).to(tl.int32)
        packed = tl.sum(d << tl.arange(0, 8)[None, :], axis=1)
        tl.store(mask + block * (BLOCK // 8) + tl.arange(0, BLOCK // 8), packed.to(tl.uint8))
        tl.store(counts + block, tl.sum(tl.sum(d, axis=1), axis=0).to(tl.int64))
        if FUSED:  # the block's changes, packed at its own start: rank o among them
            keep = d != 0
            o = _ranks(d)
            tl.store(spos + first + o, loc, mask=keep)
            tl.store(svals + first + o, va, mask=keep)

    @triton.jit
    def gather(spos, svals, counts, starts, pos, values, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        k = tl.arange(0, BLOCK)
        live = k < tl.load(counts + block)
        start = tl.load(starts + block)
        p = tl.load(spos + first + k, mask=live, other=0)
        tl.store(pos + start + k, first + p.to(tl.int64), mask=live)
        tl.store(values + start + k, tl.load(svals + first + k, mask=live, other=0), mask=live)

    @triton.jit
    def compact(a, n, mask, limit, starts, pos, values, WRITE_VALUES: tl.constexpr,
                ALIGNED: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        bits, loc = _bits(mask, block, n - first, limit, BLOCK)
        keep = bits != 0
        start = tl.load(starts + block)
        o = _ranks(bits)
        tl.store(pos + start + o, (first + loc).to(pos.dtype.element_ty), mask=keep)
        if WRITE_VALUES:
            v = tl.load(a + first + loc, mask=keep, other=0)
            _put(values, start, o, v, keep, ALIGNED, ITEM)

    @triton.jit
    def count_bits(payload, n, counts, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        # the payload's bitmask is (n + 7) // 8 bytes: read no further
        bits, loc = _bits(payload, block, n - block * BLOCK, (n + 7) // 8, BLOCK)
        tl.store(counts + block, tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.int64))

    @triton.jit
    def apply_bitmask(target, payload, starts, values, n, cols, stride, CONTIG: tl.constexpr,
                      ROW8: tl.constexpr, ALIGNED: tl.constexpr, ITEM: tl.constexpr,
                      BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        bits, loc = _bits(payload, block, n - first, (n + 7) // 8, BLOCK)
        keep = bits != 0
        o = _ranks(bits)
        like = tl.zeros((BLOCK // 8, 8), dtype=target.dtype.element_ty)
        v = _get(values, tl.load(starts + block), o, keep, like, ALIGNED, ITEM)
        if CONTIG:
            tl.store(target + first + loc, v, mask=keep)
        elif ROW8:  # cols % 8 == 0: the 8 elements of a tile row share a row of the view
            g = first + tl.arange(0, BLOCK // 8) * 8
            at = (g // cols) * stride + g % cols
            tl.store(target + at[:, None] + tl.arange(0, 8)[None, :], v, mask=keep)
        else:
            i = first + loc
            tl.store(target + (i // cols) * stride + i % cols, v, mask=keep)

    _BUILT.append(_Kernels(mark, gather, compact, count_bits, apply_bitmask))
    return _BUILT[0]


__all__ = ["BLOCK", "FUSED", "Marked", "Rows", "apply_bitmask", "bitmask_counts",
           "bitmask_positions", "changed", "enabled", "mark", "rows_form", "usable"]
