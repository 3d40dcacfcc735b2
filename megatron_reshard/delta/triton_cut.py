"""The cut's Triton kernels (``cut_spots``, ``cut_mark``, ``cut_tiles``, ``cut_offsets``,
``cut_write``, ``slot_write``) and the helpers they call.

What they do and in which order the host launches them: ``delta.kernels`` (the cut).
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
    def _lanes(BLOCK: tl.constexpr):
        return tl.arange(0, BLOCK // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]

    @triton.jit
    def _popcount(x):  # set bits of a 16-bit word (int32)
        x = x - ((x >> 1) & 0x5555)
        x = (x & 0x3333) + ((x >> 2) & 0x3333)
        x = (x + (x >> 4)) & 0x0F0F
        return (x + (x >> 8)) & 0x1F

    @triton.jit
    def _bit_index(one):  # which bit a word's single set bit is (0 for none)
        return (((one & 0xFF00) != 0).to(tl.int32) * 8 + ((one & 0xF0F0) != 0).to(tl.int32) * 4
                + ((one & 0xCCCC) != 0).to(tl.int32) * 2 + ((one & 0xAAAA) != 0).to(tl.int32))

    @triton.jit
    def _top_bit(x):  # a word's highest set bit alone
        x = x | (x >> 1)
        x = x | (x >> 2)
        x = x | (x >> 4)
        x = x | (x >> 8)
        return x ^ (x >> 1)

    @triton.jit
    def _sum_max_min_max(a0, a1, a2, a3, b0, b1, b2, b3):
        return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2), tl.maximum(a3, b3)

    @triton.jit
    def _max_before(av, ap, bv, bp):
        # scan of (max, max before the last): the second half is an exclusive running max
        return tl.maximum(av, bv), tl.maximum(av, bp)

    @triton.jit
    def _words_before(word, BLOCK: tl.constexpr):
        # per 16-element word of a block: its first changed element (block-local), and
        # the last changed element of the words before it (-1: none in this block)
        w = tl.arange(0, BLOCK // 16)
        has = word != 0
        lo = w * 16 + _bit_index(word & -word)
        last = tl.where(has, w * 16 + _bit_index(_top_bit(word)), -1)
        _, prev = tl.associative_scan((last, tl.full((BLOCK // 16,), -1, tl.int32)), 0,
                                      _max_before)
        return has, lo, last, prev

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
    def _cheaper(best, enc, index, count, escapes, CODE: tl.constexpr, ITEM: tl.constexpr):
        # (bytes, encoding) of the cheaper of best and an index of ``index`` bytes with
        # whole values, then with DIFF8 (none for 1-byte elements); ties keep the first
        whole = index + count * ITEM
        enc = tl.where(whole < best, CODE, enc)
        best = tl.minimum(whole, best)
        if ITEM > 1:
            small = index + count + escapes * ITEM
            enc = tl.where(small < best, CODE + 8, enc)
            best = tl.minimum(small, best)
        return best, enc

    @triton.jit
    def _choose(n, count, escapes, gap_bytes, ITEM: tl.constexpr, IDX: tl.constexpr):
        # ``encoding.pick_encoding`` on the device: (encoding, payload bytes) of the
        # cheapest, ties to the one it lists first (dense 3, bitmask 2, positions 1, gaps
        # 4; whole values before DIFF8, +8); dense also where the host's encode() takes it
        # before asking (count * (ITEM + 1) >= n * ITEM); none (0) for no change
        best = n * ITEM
        enc = best * 0 + 3
        best, enc = _cheaper(best, enc, (n + 7) // 8, count, escapes, 2, ITEM)
        best, enc = _cheaper(best, enc, count * IDX, count, escapes, 1, ITEM)
        best, enc = _cheaper(best, enc, gap_bytes, count, escapes, 4, ITEM)
        dense = count * (ITEM + 1) >= n * ITEM
        enc = tl.where(count == 0, 0, tl.where(dense, 3, enc))
        best = tl.where(count == 0, 0, tl.where(dense, n * ITEM, best))
        return enc, best

    @triton.jit
    def _region(anchor, row, col, AL: tl.constexpr):
        # a region of a cut batch: ``anchor`` (a kernel argument) moved by the offset at
        # ``col`` of its table row (``_ROW``). AL > 1: every offset is a multiple of AL (16
        # bytes): with the anchor's own alignment the compiler then keeps the addresses of
        # a block's loads in far fewer registers (cut_mark for sm_90: 96 against 140, as
        # few as with the region's own tensor as the argument)
        off = tl.load(row + col)
        if AL > 1:
            off = tl.multiple_of(off, AL)
        return anchor + off

    @triton.jit
    def _tile_blocks(table, ids, blocks, t, TILE: tl.constexpr):
        # the blocks of tile t of a cut batch (its region's, in the batch's numbering)
        row = table + tl.load(ids + blocks + t) * 11
        b0 = tl.load(row + 3)
        i = b0 + (t - tl.load(row + 5)) * TILE + tl.arange(0, TILE)
        return i, i < b0 + tl.load(row + 4)


    # the kernels find the helpers they call among the module's globals, not in closures
    globals().update(_lanes=_lanes, _popcount=_popcount, _bit_index=_bit_index,
                     _top_bit=_top_bit, _sum_max_min_max=_sum_max_min_max,
                     _max_before=_max_before, _words_before=_words_before, _put=_put,
                     _cheaper=_cheaper, _choose=_choose, _region=_region,
                     _tile_blocks=_tile_blocks)
    @triton.jit
    def cut_mark(anchor, anchor32, spots, n1, old1, mask, stats, firsts, lasts, words,
                 slot_pos, slot_byte, blocks, STEP: tl.constexpr, BLOCK: tl.constexpr,
                 CAP: tl.constexpr, PACK: tl.constexpr, ITEM: tl.constexpr, AL: tl.constexpr,
                 ONE: tl.constexpr):
        # mask: the bitmask as int16 words (16 elements each, little-endian: the wire's
        # bytes). Per element only the compare and the packing into words. A block of at
        # most CAP changes (so at most CAP non-zero words) then lists its non-zero words
        # (``words``: index << 16 | bits, in order), and one lane per listed word puts its
        # changes in the block's slot (in-block position, DIFF8 byte) from the copies of
        # new and old the loads just brought into the caches: the payload is written from
        # the slots alone. A block over CAP (dense changes) takes the per-element path.
        # A block of the batch (``_Batch``): where its new and old start (offsets from the
        # anchor), the elements left in its region from there, its first element in the
        # region. ONE (a batch of one region, the anchor its new): from the arguments, no
        # load before the scan's; else from ``spots`` (cut_spots): one round of loads
        # (the table through the block's region id took two: ~20% of the scan's time)
        block = tl.program_id(0).to(tl.int64)
        if ONE:
            first = block * BLOCK
            oa = first
            ob = old1 + first
            left = n1 - first
        else:
            spot = spots + block * 4
            oa = tl.load(spot)
            ob = tl.load(spot + 1)
            left = tl.load(spot + 2)
            first = tl.load(spot + 3)
        if AL > 1:  # see _region
            oa = tl.multiple_of(oa, AL)
            ob = tl.multiple_of(ob, AL)
        pa = anchor + oa
        pb = anchor + ob
        loc = _lanes(BLOCK)
        inside = loc < left
        if PACK > 0:
            # PACK elements a 32-bit word (n a multiple of PACK, both 4-byte aligned): one
            # xor for PACK elements, each element's bit from its bits of the xor (the
            # compare and the packing are the whole per-element cost of the scan)
            UNITS: tl.constexpr = 16 // PACK
            u = tl.arange(0, BLOCK // 16)[:, None] * UNITS + tl.arange(0, UNITS)[None, :]
            there = u < left // PACK
            oa32 = oa * ITEM // 4
            ob32 = ob * ITEM // 4
            if AL > 1:
                oa32 = tl.multiple_of(oa32, AL * ITEM // 4)
                ob32 = tl.multiple_of(ob32, AL * ITEM // 4)
            a32 = anchor32 + oa32
            b32 = anchor32 + ob32
            xor = (tl.load(a32 + u, mask=there, other=0)
                   ^ tl.load(b32 + u, mask=there, other=0))
            if PACK == 1:
                flags = (xor != 0).to(tl.int32)
            else:
                flags = ((xor & ((1 << (32 // PACK)) - 1)) != 0).to(tl.int32)
                for i in tl.static_range(1, PACK):
                    flags |= (((xor >> (i * (32 // PACK))) & ((1 << (32 // PACK)) - 1)) != 0
                              ).to(tl.int32) << i
            word = tl.sum(flags << (tl.arange(0, UNITS)[None, :] * PACK), axis=1)
        else:
            va = tl.load(pa + loc, mask=inside, other=0)
            vb = tl.load(pb + loc, mask=inside, other=0)
            word = tl.sum((va != vb).to(tl.int32) << tl.arange(0, 16)[None, :], axis=1)
        w = tl.arange(0, BLOCK // 16)
        tl.store(mask + block * (BLOCK // 16) + w, word.to(tl.int16))
        pop = _popcount(word)
        # few reductions across the warps (each a round through shared memory and two
        # barriers): changes and non-zero words packed in one sum, with the most changes
        # of a word (the loop below) in the same pass
        both = pop + ((word != 0).to(tl.int32) << 16)
        # the block's first and last change in the same pass (block-local; none: BLOCK, -1)
        low = tl.where(word != 0, w * 16 + _bit_index(word & -word), BLOCK)
        top = tl.where(word != 0, w * 16 + _bit_index(_top_bit(word)), -1)
        total, most, low, top = tl.reduce((both, pop, low, top), 0, _sum_max_min_max)
        count = total & 0xFFFF
        if count <= CAP:
            # list the non-zero words: rank of their first change << 32 | index << 16 | bits
            ahead = tl.cumsum(both, 0) - both
            listed = words + block * CAP
            tl.store(listed + (ahead >> 16), ((ahead & 0xFFFF).to(tl.int64) << 32)
                     | ((w << 16) | word).to(tl.int64), mask=word != 0)
            tl.debug_barrier()  # the list, written by all the block's threads, read back
            nnz = total >> 16
            lane = tl.arange(0, CAP)
            on = lane < nnz
            e = tl.load(listed + lane, mask=on, other=0, cache_modifier=".cg")
            pe = tl.load(listed + lane - 1, mask=on & (lane > 0), other=0,
                         cache_modifier=".cg").to(tl.int32)
            rank = (e >> 32).to(tl.int32)
            bits = e.to(tl.int32) & 0xFFFF
            base = (e.to(tl.int32) >> 16) * 16
            prior = (pe >> 16) * 16 + _bit_index(_top_bit(pe & 0xFFFF))
            skip = tl.where(on & (lane > 0), (base + _bit_index(bits & -bits) - prior - 1) // 255,
                            0)
            sp = slot_pos + block * CAP
            sb = slot_byte + block * CAP
            rem = bits
            escaped = tl.zeros((CAP,), tl.int32)
            for k in tl.static_range(16):
                if k < most:
                    live = rem != 0
                    one = base + _bit_index(rem & -rem)
                    got = tl.load(pa + one, mask=live, other=0)
                    was = tl.load(pb + one, mask=live, other=0)
                    step = got.to(STEP) - was.to(STEP)
                    esc = live & ((step < -127) | (step > 127))
                    small = tl.where(esc, -128, step).to(tl.int8)
                    tl.store(sp + rank + k, one.to(tl.int16), mask=live)
                    tl.store(sb + rank + k, small.to(tl.uint8, bitcast=True), mask=live)
                    escaped += esc.to(tl.int32)
                    rem = rem & (rem - 1)
            # skips (< 2**16 in a block) and escapes in one sum; the first and last change
            # from the list's ends
            packed = tl.sum(skip + (escaped << 16))
            skips = packed & 0xFFFF
            escapes = packed >> 16
        else:  # over CAP: cut_write reads new and old again; escapes and skips per element
            # (names apart from the other branch's: Triton types a name once per if)
            xa = tl.load(pa + loc, mask=inside, other=0)
            xb = tl.load(pb + loc, mask=inside, other=0)
            steps = xa.to(STEP) - xb.to(STEP)
            escapes = tl.sum(tl.sum(((xa != xb) & ((steps < -127) | (steps > 127))).to(tl.int32),
                                    axis=1))
            has, wlo, _, prev = _words_before(word, BLOCK)
            skips = tl.sum(tl.where(has & (prev >= 0), (wlo - prev - 1) // 255, 0))
        tl.store(stats + block, count.to(tl.int64))
        tl.store(stats + blocks + block, escapes.to(tl.int64))
        tl.store(stats + 2 * blocks + block, skips.to(tl.int64))
        tl.store(firsts + block, first + low)
        tl.store(lasts + block, tl.where(top >= 0, first + top, -1))

    @triton.jit
    def cut_spots(table, ids, spots, blocks, BLOCK: tl.constexpr, N: tl.constexpr):
        # for cut_mark, per block of a batch of several regions (N a program): where its
        # new and old start (offsets from the anchor), the elements left in its region
        # from its first, and that first (region-local)
        i = tl.program_id(0).to(tl.int64) * N + tl.arange(0, N)
        live = i < blocks
        row = table + tl.load(ids + i, mask=live, other=0) * 11
        first = (i - tl.load(row + 3, mask=live, other=0)) * BLOCK
        spot = spots + i * 4
        tl.store(spot, tl.load(row, mask=live, other=0) + first, mask=live)
        tl.store(spot + 1, tl.load(row + 1, mask=live, other=0) + first, mask=live)
        tl.store(spot + 2, tl.load(row + 2, mask=live, other=0) - first, mask=live)
        tl.store(spot + 3, first, mask=live)

    @triton.jit
    def cut_tiles(table, ids, stats, firsts, lasts, before, tiles, blocks, ntiles,
                  TILE: tl.constexpr, CAP: tl.constexpr):
        # per tile of TILE blocks of a region: each block's last change before it inside
        # the tile (-1: none), its gap bytes but for the skips from the tiles before, and
        # the tile's sums, first and last change
        t = tl.program_id(0).to(tl.int64)
        i, live = _tile_blocks(table, ids, blocks, t, TILE)
        count = tl.load(stats + i, mask=live, other=0)
        first = tl.load(firsts + i, mask=live, other=0)
        last = tl.load(lasts + i, mask=live, other=-1)
        _, prev = tl.associative_scan((last, tl.full((TILE,), -1, tl.int64)), 0, _max_before)
        gaps = count + tl.load(stats + 2 * blocks + i, mask=live, other=0) + tl.where(
            (count > 0) & (prev >= 0), (first - prev - 1) // 255, 0)
        tl.store(stats + 2 * blocks + i, gaps, mask=live)
        tl.store(before + i, prev, mask=live)
        tl.store(tiles + t, tl.sum(count))
        tl.store(tiles + ntiles + t, tl.sum(tl.load(stats + blocks + i, mask=live, other=0)))
        tl.store(tiles + 2 * ntiles + t, tl.sum(gaps))
        tl.store(tiles + 3 * ntiles + t, tl.min(tl.where(count > 0, first, 1 << 62)))
        tl.store(tiles + 4 * ntiles + t, tl.max(last))
        tl.store(tiles + 5 * ntiles + t, tl.sum((count > CAP).to(tl.int64)))

    @triton.jit
    def cut_offsets(table, ids, stats, before, tiles, starts, totals, blocks, ntiles,
                    TILE: tl.constexpr, MAXT: tl.constexpr, ITEM: tl.constexpr,
                    IDX: tl.constexpr):
        # each block's offsets in its region's payload (exclusive: values, escapes, gap
        # bytes) and the last change before it; a region's tiles' figures are few, each
        # of its programs scans them all. Its first writes its totals and the encoding
        # ``pick_encoding`` would choose from them
        t = tl.program_id(0).to(tl.int64)
        row = table + tl.load(ids + blocks + t) * 11
        t0 = tl.load(row + 5)
        j = tl.arange(0, MAXT)
        there = j < tl.load(row + 6)
        tc = tl.load(tiles + t0 + j, mask=there, other=0)
        te = tl.load(tiles + ntiles + t0 + j, mask=there, other=0)
        tlast = tl.load(tiles + 4 * ntiles + t0 + j, mask=there, other=-1)
        _, tprev = tl.associative_scan((tlast, tl.full((MAXT,), -1, tl.int64)), 0, _max_before)
        tskip = tl.where(tc > 0, (tl.load(tiles + 3 * ntiles + t0 + j, mask=there, other=0)
                                  - tprev - 1) // 255, 0)
        tg = tl.load(tiles + 2 * ntiles + t0 + j, mask=there, other=0) + tskip
        if t == t0:
            out = totals + tl.load(row + 10) * 6
            tl.store(out, tl.sum(tc))
            tl.store(out + 1, tl.sum(te))
            tl.store(out + 2, tl.sum(tg))
            tl.store(out + 3, tl.sum(tl.load(tiles + 5 * ntiles + t0 + j, mask=there, other=0)))
            enc, size = _choose(tl.load(row + 2), tl.sum(tc), tl.sum(te), tl.sum(tg), ITEM, IDX)
            tl.store(out + 4, enc)
            tl.store(out + 5, size)
        earlier = j < t - t0
        mine = j == t - t0
        i, live = _tile_blocks(table, ids, blocks, t, TILE)
        count = tl.load(stats + i, mask=live, other=0)
        esc = tl.load(stats + blocks + i, mask=live, other=0)
        gaps = tl.load(stats + 2 * blocks + i, mask=live, other=0)
        prev = tl.load(before + i, mask=live, other=0)
        gaps += tl.where((count > 0) & (prev < 0), tl.sum(tl.where(mine, tskip, 0)), 0)
        prev = tl.where(prev < 0, tl.sum(tl.where(mine, tprev, 0)), prev)
        tl.store(before + i, prev, mask=live)
        tl.store(starts + i, tl.sum(tl.where(earlier, tc, 0)) + tl.cumsum(count, 0) - count,
                 mask=live)
        tl.store(starts + blocks + i, tl.sum(tl.where(earlier, te, 0)) + tl.cumsum(esc, 0) - esc,
                 mask=live)
        tl.store(starts + 2 * blocks + i, tl.sum(tl.where(earlier, tg, 0)) + tl.cumsum(gaps, 0)
                 - gaps, mask=live)

    @triton.jit
    def cut_write(a, b, mask, stats, starts, before, blocks, block0, index, values, escapes,
                  INDEX: tl.constexpr, DIFF8: tl.constexpr, ALIGNED: tl.constexpr,
                  ESC_ALIGNED: tl.constexpr, STEP: tl.constexpr, ITEM: tl.constexpr,
                  BLOCK: tl.constexpr, CAP: tl.constexpr):
        # the blocks over CAP changes (slot_write writes the others). INDEX: 0 none (a
        # bitmask, copied apart), 1 positions, 2 gaps. A lane is a word of the bitmask (16
        # elements); step k handles the k-th change of every word. One region's blocks
        # (from ``block0`` of its batch's, ``_Batch``).
        block = tl.program_id(0).to(tl.int64) + block0
        count = tl.load(stats + block)
        if count > CAP:
            first = (block - block0) * BLOCK
            w = tl.arange(0, BLOCK // 16)
            word = tl.load(mask + block * (BLOCK // 16) + w).to(tl.int32) & 0xFFFF
            pop = _popcount(word)
            most = tl.max(pop)
            prevk = w
            skipped = w
            gstart = block
            byte0 = block
            if INDEX == 2:
                has, lo, last, prevk = _words_before(word, BLOCK)
                # one scan for the ranks and the skips (each < 2**16 in a block)
                skip = tl.where(has & (prevk >= 0), (lo - prevk - 1) // 255, 0)
                both = tl.cumsum(pop + (skip << 16), 0)
                rank = tl.load(starts + block) + ((both & 0xFFFF) - pop)
                skipped = both >> 16
                gap0 = first + tl.min(tl.where(has, lo, BLOCK)) - tl.load(before + block)
                skip0 = (gap0 - 1) // 255
                byte0 = gap0 - 255 * skip0
                gstart = tl.load(starts + 2 * blocks + block) + skip0 - tl.load(starts + block)
            else:
                rank = tl.load(starts + block) + (tl.cumsum(pop, 0) - pop)  # int64
            flags = tl.zeros((BLOCK // 16,), tl.int32)  # DIFF8: which changes of a word escaped
            rem = word
            for k in tl.static_range(16):
                if k < most:
                    live = rem != 0
                    loc = w * 16 + _bit_index(rem & -rem)
                    at = first + loc
                    va = tl.load(a + at, mask=live, other=0)
                    o = rank + k
                    if INDEX == 1:
                        tl.store(index + o, at.to(index.dtype.element_ty), mask=live)
                    if INDEX == 2:
                        gap = loc - prevk
                        if k == 0:
                            gap = tl.where(prevk >= 0, gap - 255 * ((gap - 1) // 255), byte0)
                        tl.store(index + gstart + o + skipped, gap.to(tl.uint8), mask=live)
                        prevk = tl.where(live, loc, prevk)
                    if DIFF8:
                        vb = tl.load(b + at, mask=live, other=0)
                        step = va.to(STEP) - vb.to(STEP)
                        esc = live & ((step < -127) | (step > 127))
                        small = tl.where(esc, -128, step).to(tl.int8)
                        tl.store(values + o, small.to(tl.uint8, bitcast=True), mask=live)
                        flags = flags | (esc.to(tl.int32) << k)
                    else:
                        _put(values, 0, o, va, live, ALIGNED, ITEM)
                    rem = rem & (rem - 1)
            if DIFF8:
                if tl.load(stats + blocks + block) > 0:  # whole values of the escapes, in order
                    epop = _popcount(flags)
                    erank = tl.load(starts + blocks + block) + (tl.cumsum(epop, 0) - epop)
                    rem = word
                    for k in tl.static_range(16):
                        if k < most:
                            loc = w * 16 + _bit_index(rem & -rem)
                            hit = (rem != 0) & (((flags >> k) & 1) != 0)
                            va = tl.load(a + first + loc, mask=hit, other=0)
                            er = erank + _popcount(flags & ((1 << k) - 1))
                            _put(escapes, 0, er, va, hit, ESC_ALIGNED, ITEM)
                            rem = rem & (rem - 1)

    @triton.jit
    def slot_write(anchor, table, ids, stats, starts, before, blocks, ntiles, program0, slot_pos,
                   slot_byte, index, values, escapes, totals, INDEX: tl.constexpr,
                   DIFF8: tl.constexpr, ALIGNED: tl.constexpr, ESC_ALIGNED: tl.constexpr,
                   ITEM: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                   GROUP: tl.constexpr, SUB: tl.constexpr, SPEC: tl.constexpr,
                   ENC: tl.constexpr, IDX: tl.constexpr, ZB: tl.constexpr, AL: tl.constexpr):
        # GROUP blocks of at most CAP changes a program: the payload from their slots
        # (gaps from consecutive positions, ranks by cumsums), SUB slot entries of each
        # block a step, as many steps as the most changes among them (not CAP: lanes
        # cost, masked or not); new is read only for whole values (escapes, or no DIFF8).
        # SPEC: every region of the batch, launched before the host knows the totals;
        # writes a region's payload only where the device's choice (its ``totals`` row,
        # cut_offsets) is this encoding, no block overflowed and the payload fits its
        # room, at its offset in the batch's buffer (``index``, ``values`` and
        # ``escapes``); the sections' offsets come from the totals (``values`` and
        # ``escapes`` are then the payload's first byte, written bytewise). Else one
        # region's programs from ``program0``, into its payload's sections.
        p = tl.program_id(0).to(tl.int64) + program0
        row = table + tl.load(ids + blocks + ntiles + p) * 11
        a = _region(anchor, row, 0, AL)
        b0 = tl.load(row + 3)
        end = b0 + tl.load(row + 4)
        g0 = b0 + (p - tl.load(row + 7)) * GROUP
        g = g0 + tl.arange(0, GROUP)
        there = g < end
        if SPEC:
            totals += tl.load(row + 10) * 6
            go = ((tl.load(totals + 4) == ENC) & (tl.load(totals + 3) == 0)
                  & (tl.load(totals + 5) <= tl.load(row + 9)))
            there = there & go
            put_at = tl.load(row + 8)
            values += put_at
            if INDEX == 1:
                index += put_at // IDX
            else:
                index += put_at
            total = tl.load(totals)
            nindex = total * IDX
            if INDEX == 2:
                nindex = tl.load(totals + 2)
            values += nindex
            escapes = values + total
            if INDEX == 2:
                # the group's share of the gap section, [its first block's offset, the next
                # group's), zeroed first: its skip bytes are 0s, its value bytes come below
                lo = tl.load(starts + 2 * blocks + g0)
                hi = tl.load(starts + 2 * blocks + tl.minimum(g0 + GROUP, end - 1))
                hi = tl.where(go, tl.where(g0 + GROUP < end, hi, tl.load(totals + 2)), lo)
                z = lo
                while z < hi:
                    zj = z + tl.arange(0, ZB)
                    tl.store(index + zj, tl.zeros((ZB,), tl.uint8), mask=zj < hi)
                    z += ZB
                tl.debug_barrier()  # the zeros before any value byte of the group
        count = tl.load(stats + g, mask=there, other=0).to(tl.int32)
        count = tl.where(there & (count <= CAP), count, 0)  # over CAP: cut_write's
        rank0 = tl.load(starts + g, mask=there, other=0)
        esc0 = tl.load(starts + blocks + g, mask=there, other=0)
        if INDEX == 2:
            # the first change's gap (from the change before the block, maybe blocks away)
            first = tl.load(slot_pos + g * CAP, mask=count > 0, other=0).to(tl.int32) & 0xFFFF
            gap0 = (g - b0) * BLOCK + first - tl.load(before + g, mask=there, other=0)
            skip0 = (gap0 - 1) // 255
            byte0 = (gap0 - 255 * skip0).to(tl.int32)
            spot0 = tl.load(starts + 2 * blocks + g, mask=there, other=0) + skip0
        most = tl.max(count, axis=0)
        c = most * 0
        while c < most:  # (a while: the interpreter takes no tensor as a range's bound)
            r = c + tl.arange(0, SUB)[None, :]
            live = r < count[:, None]
            o = g[:, None] * CAP + r
            pos = tl.load(slot_pos + o, mask=live, other=0).to(tl.int32) & 0xFFFF
            rank = rank0[:, None] + r
            if INDEX == 1:
                tl.store(index + rank, ((g[:, None] - b0) * BLOCK + pos).to(
                    index.dtype.element_ty), mask=live)
            if INDEX == 2:  # in-block gaps in int32
                prior = tl.load(slot_pos + o - 1, mask=live & (r > 0), other=0).to(
                    tl.int32) & 0xFFFF
                gap = pos - prior
                skip = tl.where(live & (r > 0), (gap - 1) // 255, 0)
                byte = tl.where(r > 0, gap - 255 * skip, byte0[:, None])
                tl.store(index + spot0[:, None] + r + tl.cumsum(skip, 1), byte.to(tl.uint8),
                         mask=live)
                spot0 += tl.sum(skip, 1)
            if DIFF8:
                small = tl.load(slot_byte + o, mask=live, other=0)
                tl.store(values + rank, small, mask=live)
                esc = live & (small == 128)
                e = esc.to(tl.int32)
                if tl.sum(tl.sum(e, axis=1), axis=0) > 0:  # escapes' whole values
                    er = esc0[:, None] + tl.cumsum(e, 1) - e
                    at = (g[:, None] - b0) * BLOCK + pos
                    _put(escapes, 0, er, tl.load(a + at, mask=esc, other=0), esc, ESC_ALIGNED,
                         ITEM)
                esc0 += tl.sum(e, 1)
            else:
                at = (g[:, None] - b0) * BLOCK + pos
                _put(values, 0, rank, tl.load(a + at, mask=live, other=0), live, ALIGNED, ITEM)
            c += SUB

    return {"cut_mark": cut_mark, "cut_spots": cut_spots, "cut_tiles": cut_tiles,
            "cut_offsets": cut_offsets, "cut_write": cut_write, "slot_write": slot_write}


__all__ = ["build"]
