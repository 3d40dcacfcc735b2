"""The apply's Triton kernels (``gap_sums``, ``gap_locate``, ``pos_sums``, ``apply_gaps``,
``apply_index``, ``compact``, ``count_bits``, ``apply_bitmask``) and the helpers they call.

What they do and in which order the host launches them: ``delta.kernel_apply``.
Triton only inside ``build`` (called where Triton is present).
"""

from __future__ import annotations


def build(triton, tl) -> dict:
    """The kernels by name, compiled on first launch (``delta.kernels`` builds them once)."""

    # The cut's blocks are [BLOCK // 8, 8] tiles: row k holds elements 8k..8k+7, the bits
    # of bitmask byte k, so packing stays inside a thread and whatever depends on the
    # order of changes (ranks, gaps) is worked out per byte (a row), the changes inside a
    # byte by bit tricks. Offsets inside a block are int32 from pointers moved to the
    # block once (64-bit arithmetic per element costs more than the bytes).

    @triton.jit
    def _local(BLOCK: tl.constexpr):
        return tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]

    @triton.jit
    def _row_before(ends, K: tl.constexpr, chunks, first, j):
        # row K of per-chunk figures summed by one flat cumsum: its sum over chunks
        # [first, j) (a delta's, from its first chunk: the scan segmented by subtraction)
        hi = K * chunks + j
        lo = K * chunks + first
        return (tl.where(hi > 0, tl.load(ends + tl.maximum(hi - 1, 0)), 0)
                - tl.where(lo > 0, tl.load(ends + tl.maximum(lo - 1, 0)), 0))

    @triton.jit
    def _delta_of(table, deltas, j):
        # the delta whose chunks hold chunk j: the last row of a GAPS or POSITIONS table
        # (_table_groups) whose first chunk is not after j (a binary search; no load for a
        # batch of one)
        lo = j * 0
        hi = lo + deltas
        while hi - lo > 1:
            mid = (lo + hi) // 2
            after = tl.load(table + mid * 9 + 8) > j
            lo = tl.where(after, lo, mid)
            hi = tl.where(after, mid, hi)
        return lo

    @triton.jit
    def _delta_row(table, d):
        # delta d's row of a table: GAPS (_gaps_groups) payload address, bytes, count,
        # numel, target address, cols, stride, vend, first chunk; POSITIONS
        # (_launch_positions) index address, values address, count, numel, target
        # address, cols, stride, escaped values' bytes, first chunk
        row = table + d * 9
        return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
                tl.load(row + 4), tl.load(row + 5), tl.load(row + 6), tl.load(row + 7),
                tl.load(row + 8))

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
    def _get(src, start, o, keep, like, ALIGNED: tl.constexpr, ITEM: tl.constexpr):
        # the value at element start + o of src (bits of like's type); bytes when unaligned
        if ALIGNED:
            v = tl.load(src + start + o, mask=keep, other=0).to(like.dtype)
        else:
            w = tl.zeros_like(like).to(tl.int64)
            for k in tl.static_range(ITEM):
                byte = tl.load(src + start * ITEM + o * ITEM + k, mask=keep, other=0)
                w = w | (byte.to(tl.int64) << (8 * k))
            v = w.to(like.dtype)
        return v

    @triton.jit
    def _get_at(addr, o, keep, like, TY: tl.constexpr, ITEM: tl.constexpr):
        # element o (TY, ITEM bytes) of the section at byte address ``addr`` (a table's:
        # its alignment known on the device only), as like's type: a load of TY each where
        # the section starts on an element boundary, bytes otherwise
        if addr % ITEM == 0:
            v = _get(addr.to(tl.pointer_type(TY)), 0, o, keep, like, True, ITEM)
        else:
            v = _get(addr.to(tl.pointer_type(tl.uint8)), 0, o, keep, like, False, ITEM)
        return v

    @triton.jit
    def _write_at(target, at, keep, v, small, esc, cols, stride, CONTIG: tl.constexpr,
                  DIFF8: tl.constexpr, STEP: tl.constexpr):
        # a chunk's changes in place at element positions ``at`` of a view folded into rows
        # (CONTIG: one row): the values ``v``, or (DIFF8) old + ``small`` where not
        # ``esc``, the escapes' whole values ``v`` where it is
        if CONTIG:
            addr = at
        else:
            addr = (at // cols) * stride + at % cols
        if DIFF8:
            old = tl.load(target + addr, mask=keep & ~esc, other=0)
            stepped = (old.to(STEP) + small.to(STEP)).to(target.dtype.element_ty)
            v = tl.where(esc, v, stepped)
        tl.store(target + addr, v, mask=keep)

    @triton.jit
    def _count_before(p, ends, chunks, first, x, CHUNK: tl.constexpr, ESCAPES: tl.constexpr):
        # bytes of p[0:x) that are not 0 (or, ESCAPES, that are 0x80: a DIFF8 escape),
        # from the per-chunk counts (``ends`` row 0, or row 2; p's from ``first``) and the
        # partial chunk
        c = x // CHUNK
        base = _row_before(ends, 2 if ESCAPES else 0, chunks, first, first + c)
        i = c * CHUNK + tl.arange(0, CHUNK)
        y = tl.load(p + i, mask=i < x, other=0).to(tl.int32)
        hit = (y == 128) if ESCAPES else (y != 0)
        return base + tl.sum((hit & (i < x)).to(tl.int64))

    # the kernels find the helpers they call among the module's globals, not in closures
    globals().update(_local=_local, _row_before=_row_before, _delta_of=_delta_of,
                     _delta_row=_delta_row, _bits=_bits, _ranks=_ranks, _get=_get,
                     _get_at=_get_at, _write_at=_write_at, _count_before=_count_before)
    @triton.jit
    def gap_sums(table, deltas, sums, figures, chunks, CHUNK: tl.constexpr):
        # per chunk of a delta's payload bytes (chunks numbered across the batch): non-zero
        # bytes (values), the distance they advance (a 0 byte: 255), 0x80 bytes (escapes,
        # where they are differences); a delta's first chunk zeroes its ``figures`` row
        # for gap_locate
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pa, nbytes, _, _, _, _, _, _, first = _delta_row(table, d)
        if j == first:
            tl.store(figures + d * 6 + tl.arange(0, 8), tl.zeros((8,), tl.int64),
                     mask=tl.arange(0, 8) < 6)
        i = (j - first) * CHUNK + tl.arange(0, CHUNK)
        live = i < nbytes
        y = tl.load(pa.to(tl.pointer_type(tl.uint8)) + i, mask=live, other=0).to(tl.int32)
        tl.store(sums + j, tl.sum(((y != 0) & live).to(tl.int32)).to(tl.int64))
        tl.store(sums + chunks + j, tl.sum(tl.where(live, tl.where(y == 0, 255, y), 0)).to(tl.int64))
        tl.store(sums + 2 * chunks + j, tl.sum((y == 128).to(tl.int32)).to(tl.int64))

    @triton.jit
    def gap_locate(table, deltas, ends, figures, chunks, CHUNK: tl.constexpr):
        # a delta's figures (zeroed before): [found, the byte of the count-th value, its
        # position, the escapes among the count bytes after it, the values named before
        # ``vend``, 0x80 bytes before the differences]; the chunk holding the count-th
        # value writes them
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pa, nbytes, count, _, _, _, _, vend, first = _delta_row(table, d)
        p = pa.to(tl.pointer_type(tl.uint8))
        out = figures + d * 6
        if j == first:
            tl.store(out + 4, _count_before(p, ends, chunks, first, tl.maximum(vend, 0), CHUNK,
                                            False))
        seen0 = _row_before(ends, 0, chunks, first, j)
        if (seen0 < count) & (_row_before(ends, 0, chunks, first, j + 1) >= count):
            i = (j - first) * CHUNK + tl.arange(0, CHUNK)
            live = i < nbytes
            y = tl.load(p + i, mask=live, other=0).to(tl.int32)
            nz = (y != 0) & live
            hit = nz & (seen0 + tl.cumsum(nz.to(tl.int64), 0) == count)
            q = tl.sum(tl.where(hit, i, 0))
            walked = _row_before(ends, 1, chunks, first, j)
            last = walked + tl.sum(tl.where(live & (i <= q), tl.where(y == 0, 255, y), 0)) - 1
            g = q + 1
            e0 = _count_before(p, ends, chunks, first, g, CHUNK, True)
            e1 = _count_before(p, ends, chunks, first, tl.minimum(g + count, nbytes), CHUNK,
                               True)
            tl.store(out, (tl.sum(hit.to(tl.int32)) == 1).to(tl.int64))
            tl.store(out + 1, q)
            tl.store(out + 2, last)
            tl.store(out + 3, e1 - e0)
            tl.store(out + 5, e0)

    @triton.jit
    def pos_sums(table, deltas, sums, chunks, DIFF8: tl.constexpr, IT: tl.constexpr,
                 IDX: tl.constexpr, CHUNK: tl.constexpr):
        # per chunk of a delta's positions (chunks numbered across the batch): those
        # outside its box, and (DIFF8) the escapes
        j = tl.program_id(0).to(tl.int64)
        pi, pv, count, numel, _, _, _, _, first = _delta_row(table, _delta_of(table, deltas, j))
        i = (j - first) * CHUNK + tl.arange(0, CHUNK)
        live = i < count
        pos = _get_at(pi, i, live, tl.zeros((CHUNK,), tl.int64), IT, IDX)
        tl.store(sums + j, tl.sum((live & ((pos < 0) | (pos >= numel))).to(tl.int32)).to(tl.int64))
        esc = tl.zeros((CHUNK,), tl.int32)
        if DIFF8:
            y = tl.load(pv.to(tl.pointer_type(tl.uint8)) + i, mask=live, other=0)
            esc = (y.to(tl.int32) == 128).to(tl.int32)
        tl.store(sums + chunks + j, tl.sum(esc).to(tl.int64))

    @triton.jit
    def apply_gaps(table, deltas, ends, figures, chunks, TY: tl.constexpr, DIFF8: tl.constexpr,
                   STEP: tl.constexpr, ITEM: tl.constexpr, CHUNK: tl.constexpr):
        # one chunk of a delta's gap bytes: its positions, the values' ranks, the escapes'
        # ranks, then in place. Its delta's figures (gap_locate's) are checked here, by
        # every program, as the host checks them after: a delta that does not fit writes
        # nothing. DIFF8: the differences follow the gaps (at ``scan``), the escapes' whole
        # values them (bytes: no alignment known); else whole values from ``vend``
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pa, nbytes, count, numel, ta, cols, stride, vend, first = _delta_row(table, d)
        p = pa.to(tl.pointer_type(tl.uint8))
        found = figures + d * 6
        scan = tl.load(found + 1) + 1
        good = (tl.load(found) != 0) & (tl.load(found + 2) < numel)
        if DIFF8:
            good = good & (scan + count <= nbytes) & (
                nbytes - scan - count == tl.load(found + 3) * ITEM)
        else:
            good = good & (vend >= 0) & (tl.load(found + 4) == count)
        c = j - first
        if good & (c * CHUNK < scan):
            i = c * CHUNK + tl.arange(0, CHUNK)
            live = i < scan
            y = tl.load(p + i, mask=live, other=0).to(tl.int32)
            keep = (y != 0) & live
            r0 = _row_before(ends, 0, chunks, first, j)
            walked = _row_before(ends, 1, chunks, first, j)
            at = walked + tl.cumsum(tl.where(live, tl.where(y == 0, 255, y), 0), 0) - 1
            r = r0 + tl.cumsum(keep.to(tl.int32), 0) - 1
            like = tl.zeros((CHUNK,), TY)
            small = keep  # DIFF8 sets both, below
            esc = keep
            if DIFF8:
                small = tl.load(p + scan + r, mask=keep, other=0).to(tl.int8, bitcast=True)
                esc = keep & (small == -128)
                # escapes among the differences before this chunk's first
                e0 = (_count_before(p, ends, chunks, first, scan + r0, CHUNK, True)
                      - tl.load(found + 5))
                er = e0 + tl.cumsum(esc.to(tl.int32), 0) - 1
                v = _get(p + scan + count, 0, er, esc, like, False, ITEM)
            else:
                v = _get_at(pa + vend, r, keep, like, TY, ITEM)
            target = ta.to(tl.pointer_type(TY))
            if numel <= cols:  # one row (no division per element)
                _write_at(target, at, keep, v, small, esc, cols, stride, True, DIFF8, STEP)
            else:
                _write_at(target, at, keep, v, small, esc, cols, stride, False, DIFF8, STEP)

    @triton.jit
    def apply_index(table, deltas, ends, figures, chunks, TY: tl.constexpr, IT: tl.constexpr,
                    DIFF8: tl.constexpr, STEP: tl.constexpr, ITEM: tl.constexpr,
                    IDX: tl.constexpr, CHUNK: tl.constexpr):
        # one chunk of a delta's positions: the escapes' ranks, then in place. pos_sums'
        # sums over the delta's chunks (positions outside the box, escapes) are checked
        # here, by every program, as the host checks them after (its first chunk writes
        # them in the delta's ``figures`` row): a delta that does not fit its box or its
        # ``whole`` bytes of escaped values writes nothing
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pi, pv, count, numel, ta, cols, stride, whole, first = _delta_row(table, d)
        last = first + tl.maximum((count + CHUNK - 1) // CHUNK, 1)
        bad = _row_before(ends, 0, chunks, first, last)
        escapes = _row_before(ends, 1, chunks, first, last)
        if j == first:
            tl.store(figures + d * 2, bad)
            tl.store(figures + d * 2 + 1, escapes)
        good = bad == 0
        if DIFF8:
            good = good & (whole == escapes * ITEM)
        i = (j - first) * CHUNK + tl.arange(0, CHUNK)
        keep = (i < count) & good
        at = _get_at(pi, i, keep, tl.zeros((CHUNK,), tl.int64), IT, IDX)
        like = tl.zeros((CHUNK,), TY)
        small = keep  # DIFF8 sets both, below
        esc = keep
        if DIFF8:
            small = tl.load(pv.to(tl.pointer_type(tl.int8)) + i, mask=keep, other=0)
            esc = keep & (small == -128)
            er = _row_before(ends, 1, chunks, first, j) + tl.cumsum(esc.to(tl.int32), 0) - 1
            v = _get_at(pv + count, er, esc, like, TY, ITEM)
        else:
            v = _get_at(pv, i, keep, like, TY, ITEM)
        target = ta.to(tl.pointer_type(TY))
        if numel <= cols:  # one row (no division per element)
            _write_at(target, at, keep, v, small, esc, cols, stride, True, DIFF8, STEP)
        else:
            _write_at(target, at, keep, v, small, esc, cols, stride, False, DIFF8, STEP)

    @triton.jit
    def compact(mask, n, limit, starts, pos, BLOCK: tl.constexpr):
        # the positions of a bitmask's set bits, each block's at its offset
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        bits, loc = _bits(mask, block, n - first, limit, BLOCK)
        o = _ranks(bits)
        tl.store(pos + tl.load(starts + block) + o, first + loc, mask=bits != 0)

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

    return {"gap_sums": gap_sums, "gap_locate": gap_locate, "pos_sums": pos_sums,
            "apply_gaps": apply_gaps, "apply_index": apply_index, "compact": compact,
            "count_bits": count_bits, "apply_bitmask": apply_bitmask}


__all__ = ["build"]
