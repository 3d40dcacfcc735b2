"""Cutting and applying delta refits on CUDA tensors with Triton kernels (issue 35).

Torch + stdlib only: Triton, which the CUDA builds of torch ship, loads lazily, and
``refit.delta_transport`` keeps its torch path where it is absent (CPU tensors, CPU builds)
or switched off (``MEGATRON_RESHARD_DELTA_KERNELS=0``). The wire format is
``delta_transport``'s (positions + values, bitmask + values, dense), byte for byte.

Why kernels: the torch path builds a bool mask, a ``nonzero``, an int64 index and a gather
(or for the bitmask: bytes widened eight-fold and summed), several passes over the region
each. Here a cut is two launches: ``mark`` reads new and old once (bits as integers, so
NaN payloads and -0.0 compare exactly), writes the bitmask and one count per block of
``BLOCK`` elements; after one host read of the total (the header needs it), ``compact``
reads the bitmask and only the changed values (masked loads) and writes positions and
values at each block's offset (an exclusive cumsum of the counts) plus its rank inside the
block (``tl.cumsum``). An apply is one launch for positions (bad positions are counted,
never stored: the caller raises) and two for a bitmask (counts per block, then the
writes). Values that start on an odd byte (after an odd-sized bitmask) move as bytes.

A strided view is handled when it folds into rows of unit stride (``rows_form``: a TP
shard's column block); any other goes through the torch path.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from megatron_reshard.errors import MegatronReshardError

BLOCK = 4096  # elements per program (a multiple of 8: whole bitmask bytes)
WARPS = 4
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NONE, POSITIONS, BITMASK, DENSE = 0, 1, 2, 3  # refit.delta_transport's codes


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


def index_bytes(numel: int) -> int:
    return 4 if numel < (1 << 31) else 8


# -- cut ------------------------------------------------------------------------------

def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INTS[t.element_size()]).reshape(-1)


def mark(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmask bytes of the changed elements, changed count per block), one launch."""
    a, b = _flat_bits(new), _flat_bits(old.to(new.device))
    n = a.numel()
    blocks = max(1, -(-n // BLOCK))
    mask = torch.empty(blocks * BLOCK // 8, dtype=torch.uint8, device=a.device)
    counts = torch.empty(blocks, dtype=torch.int64, device=a.device)
    _kernels().mark[(blocks,)](a, b, n, mask, counts, BLOCK=BLOCK, num_warps=WARPS)
    return mask, counts


def encode(new: torch.Tensor, old: torch.Tensor, pick) -> tuple[int, int, Optional[torch.Tensor]]:
    """``delta_transport.encode`` on CUDA: ``(count, encoding, payload)``; ``pick`` is the
    transport's ``pick_encoding(numel, count, itemsize)``."""
    a = _flat_bits(new)
    n, item = a.numel(), new.element_size()
    mask, counts = mark(new, old)
    offsets = torch.cumsum(counts, 0)
    count = int(offsets[-1])  # the one host read: the header and the encoding need it
    enc = pick(n, count, item)
    if enc == NONE:
        return 0, NONE, None
    if enc == DENSE:
        return count, enc, a.view(torch.uint8)
    starts = offsets - counts
    if enc == POSITIONS:
        head = count * index_bytes(n)
        payload = torch.empty(head + count * item, dtype=torch.uint8, device=a.device)
        pos = payload[:head].view(torch.int32 if index_bytes(n) == 4 else torch.int64)
    else:
        head = (n + 7) // 8
        payload = torch.empty(head + count * item, dtype=torch.uint8, device=a.device)
        payload[:head].copy_(mask[:head])
        pos = payload[:0].view(torch.int32)  # unused
    _compact(a, mask, starts, payload, head, pos, enc == POSITIONS, item)
    return count, enc, payload


def _compact(a, mask, starts, payload, head: int, pos, write_pos: bool, item: int) -> None:
    n = a.numel()
    aligned = head % item == 0
    values = payload[head:].view(a.dtype) if aligned else payload[head:]
    _kernels().compact[(starts.numel(),)](a, n, mask, mask.numel(), starts, pos, values,
                                          WRITE_POS=write_pos, ALIGNED=aligned, ITEM=item,
                                          BLOCK=BLOCK, num_warps=WARPS)


# -- apply ----------------------------------------------------------------------------

class BadDelta(MegatronReshardError, ValueError):
    """A payload that does not fit the view: ``delta_transport`` turns it into its error."""


def apply(view: torch.Tensor, count: int, enc: int, payload: torch.Tensor) -> bool:
    """Write a delta into ``view`` in place; False when the view does not fold into rows
    (the caller takes the torch path). Raises ``BadDelta`` for positions outside the view
    or a bitmask whose set bits disagree with ``count`` (nothing written then for the
    bitmask; the positions inside the view are written)."""
    form = rows_form(view)
    if form is None:
        return False
    target = view.view(_INTS[view.element_size()])
    numel, item = view.numel(), view.element_size()
    if enc == DENSE:
        target.copy_(payload.view(target.dtype).reshape(view.shape))  # bits, never floats
        return True
    k = _kernels()
    if enc == POSITIONS:
        head = count * index_bytes(numel)
        pos = payload[:head].view(torch.int32 if index_bytes(numel) == 4 else torch.int64)
        aligned = head % item == 0
        values = payload[head:].view(target.dtype) if aligned else payload[head:]
        bad = torch.zeros(1, dtype=torch.int64, device=view.device)
        k.apply_positions[(max(1, -(-count // BLOCK)),)](
            target, pos, values, count, numel, form.cols, form.stride, bad,
            CONTIG=form.rows == 1, ALIGNED=aligned, ITEM=item, BLOCK=BLOCK, num_warps=WARPS)
        if int(bad):
            raise BadDelta(f"{int(bad)} of {count} positions fall outside the view's "
                           f"{numel} elements")
        return True
    head = (numel + 7) // 8
    blocks = max(1, -(-numel // BLOCK))
    counts = torch.empty(blocks, dtype=torch.int64, device=view.device)
    k.count_bits[(blocks,)](payload, numel, counts, BLOCK=BLOCK, num_warps=WARPS)
    offsets = torch.cumsum(counts, 0)
    got = int(offsets[-1])
    if got != count:
        raise BadDelta(f"a bitmask delta sets {got} bits but its header says {count}")
    aligned = head % item == 0
    values = payload[head:].view(target.dtype) if aligned else payload[head:]
    k.apply_bitmask[(blocks,)](target, payload, offsets - counts, values, numel, form.cols,
                               form.stride, CONTIG=form.rows == 1, ROW8=form.cols % 8 == 0,
                               ALIGNED=aligned, ITEM=item, BLOCK=BLOCK, num_warps=WARPS)
    return True


# -- the kernels ----------------------------------------------------------------------

class _Kernels(NamedTuple):
    mark: object
    compact: object
    count_bits: object
    apply_positions: object
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
    def mark(a, b, n, mask, counts, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        loc = _local(BLOCK)
        inside = loc < n - first
        d = (tl.load(a + first + loc, mask=inside, other=0)
             != tl.load(b + first + loc, mask=inside, other=0)).to(tl.int32)
        packed = tl.sum(d << tl.arange(0, 8)[None, :], axis=1)
        tl.store(mask + block * (BLOCK // 8) + tl.arange(0, BLOCK // 8), packed.to(tl.uint8))
        tl.store(counts + block, tl.sum(tl.sum(d, axis=1), axis=0).to(tl.int64))

    @triton.jit
    def compact(a, n, mask, limit, starts, pos, values, WRITE_POS: tl.constexpr,
                ALIGNED: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        bits, loc = _bits(mask, block, n - first, limit, BLOCK)
        keep = bits != 0
        start = tl.load(starts + block)
        o = _ranks(bits)
        v = tl.load(a + first + loc, mask=keep, other=0)
        if WRITE_POS:
            tl.store(pos + start + o, (first + loc).to(pos.dtype.element_ty), mask=keep)
        _put(values, start, o, v, keep, ALIGNED, ITEM)

    @triton.jit
    def count_bits(payload, n, counts, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        # the payload's bitmask is (n + 7) // 8 bytes: read no further
        bits, loc = _bits(payload, block, n - block * BLOCK, (n + 7) // 8, BLOCK)
        tl.store(counts + block, tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.int64))

    @triton.jit
    def apply_positions(target, pos, values, count, n, cols, stride, bad, CONTIG: tl.constexpr,
                        ALIGNED: tl.constexpr, ITEM: tl.constexpr, BLOCK: tl.constexpr):
        first = tl.program_id(0).to(tl.int64) * BLOCK
        k = tl.arange(0, BLOCK)
        live = k < count - first
        p = tl.load(pos + first + k, mask=live, other=0).to(tl.int64)
        fits = live & (p >= 0) & (p < n)
        tl.atomic_add(bad, tl.sum((live & ~fits).to(tl.int64), axis=0))
        like = tl.zeros((BLOCK,), dtype=target.dtype.element_ty)
        v = _get(values, first, k, live, like, ALIGNED, ITEM)
        if CONTIG:
            tl.store(target + p, v, mask=fits)
        else:
            tl.store(target + (p // cols) * stride + p % cols, v, mask=fits)

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

    _BUILT.append(_Kernels(mark, compact, count_bits, apply_positions, apply_bitmask))
    return _BUILT[0]


__all__ = ["BLOCK", "BadDelta", "Rows", "apply", "enabled", "encode", "mark", "rows_form",
           "usable"]
