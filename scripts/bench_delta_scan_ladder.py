"""Where a delta cut's region scan spends its time on one GPU (issue 35): a ladder of
kernels over the same 1 GiB pair, each a step more of the cut's work, against a memcpy.

    python scripts/bench_delta_scan_ladder.py [--mib 1024] [--rates 0.01,0.018]
        [--configs 4096:4,2048:1] [--rungs read,count,skips,old,new,new-elem]

Rungs (per program ``BLOCK`` elements of new and old): ``read`` (both loaded, one sum
stored), ``mark`` (+ compare, packed into 16-bit words, the bitmask stored), ``count``
(+ the changed count), ``skips`` (+ the word-level scan for GAPS skips, first and last
change), ``old`` (the cut_mark before slots: + DIFF8 escapes per element), ``new``
(``delta.kernels``' cut_mark: + the block's non-zero words listed, its changes put in its
slot from them; elements compared two a 32-bit word), ``new-elem`` (the same, one element
at a time). Then the
apply's parts at the same rates. Medians of ``--iters`` CUDA-event timings.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from megatron_reshard.delta import kernels as dk

dk._kernels()  # builds the helpers into dk's globals
_lanes, _words_before, _popcount = dk._lanes, dk._words_before, dk._popcount


@triton.jit
def l_read(a, b, n, out, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    first = block * BLOCK
    loc = tl.arange(0, BLOCK)
    inside = loc < n - first
    va = tl.load(a + first + loc, mask=inside, other=0)
    vb = tl.load(b + first + loc, mask=inside, other=0)
    tl.store(out + block, tl.sum((va ^ vb).to(tl.int32)))


@triton.jit
def _marked_block(a, b, n, mask, BLOCK: tl.constexpr):
    # a program's block of new and old as [BLOCK // 16, 16] tiles, compared, its bitmask
    # words stored: (block, first element, new, old, changed, words)
    block = tl.program_id(0).to(tl.int64)
    first = block * BLOCK
    loc = _lanes(BLOCK)
    inside = loc < n - first
    va = tl.load(a + first + loc, mask=inside, other=0)
    vb = tl.load(b + first + loc, mask=inside, other=0)
    d = va != vb
    word = tl.sum(d.to(tl.int32) << tl.arange(0, 16)[None, :], axis=1)
    tl.store(mask + block * (BLOCK // 16) + tl.arange(0, BLOCK // 16), word.to(tl.int16))
    return block, first, va, vb, d, word


@triton.jit
def l_mark(a, b, n, mask, out, BLOCK: tl.constexpr, RUNG: tl.constexpr):
    block, first, va, vb, d, word = _marked_block(a, b, n, mask, BLOCK)
    if RUNG >= 1:
        tl.store(out + block, tl.sum(_popcount(word)))
    if RUNG >= 2:
        has, lo, last, prev = _words_before(word, BLOCK)
        skips = tl.sum(tl.where(has & (prev >= 0), (lo - prev - 1) // 255, 0))
        tl.store(out + 2 * block, skips.to(tl.int64))
        tl.store(out + 3 * block, first + tl.min(tl.where(has, lo, BLOCK)))
        tl.store(out + 4 * block, tl.max(last).to(tl.int64))


@triton.jit
def l_old(a, b, n, mask, stats, firsts, lasts, blocks, STEP: tl.constexpr, BLOCK: tl.constexpr):
    block, first, va, vb, d, word = _marked_block(a, b, n, mask, BLOCK)
    step = va.to(STEP) - vb.to(STEP)
    escaped = d & ((step < -127) | (step > 127))
    has, lo, last, prev = _words_before(word, BLOCK)
    skips = tl.where(has & (prev >= 0), (lo - prev - 1) // 255, 0)
    both = (_popcount(word) + (tl.sum(escaped.to(tl.int32), axis=1) << 16)).to(tl.int64)
    sums = tl.sum(both + (skips.to(tl.int64) << 32))
    tl.store(stats + block, sums & 0xFFFF)
    tl.store(stats + blocks + block, (sums >> 16) & 0xFFFF)
    tl.store(stats + 2 * blocks + block, sums >> 32)
    tl.store(firsts + block, first + tl.min(tl.where(has, lo, BLOCK)))
    top = tl.max(last)
    tl.store(lasts + block, tl.where(top >= 0, first + top, -1))


def _cut_mark(new, old, block, warps, pack):
    """The library's ``cut_mark`` over one region at ``block`` x ``warps``, its batch (table
    and scratch) made once; ``pack`` 0: an element at a time."""
    def sized(fn):
        saved = dk.BLOCK, dk.WARPS
        dk.BLOCK, dk.WARPS = block, warps
        try:
            return fn()
        finally:
            dk.BLOCK, dk.WARPS = saved
    a, b = new.view(torch.int16).reshape(-1), old.view(torch.int16).reshape(-1)
    totals = torch.empty(1, 6, dtype=torch.int64, device=a.device)
    batch = sized(lambda: dk._Batch([(0, a, b)], pack, 4, totals))
    return lambda: sized(batch.mark)


def _ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _wall_ms(fn, iters):
    import time
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rates", default="0.01,0.018")
    ap.add_argument("--configs", default="2048:1,2048:2,4096:2,4096:4,8192:4,8192:8",
                    help="BLOCK:warps of the scan")
    ap.add_argument("--rungs", default="read,count,skips,old,new,new-elem")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.mib * 2**20 // 2
    g = torch.Generator(device=dev).manual_seed(0)
    old = torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, device=dev, generator=g)
    src = torch.empty(2 * n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    mc = _ms(lambda: dst.copy_(src), args.iters)
    print(f"{torch.cuda.get_device_name(dev)} triton {triton.__version__}: memcpy of "
          f"{args.mib} MiB {mc:.3f} ms")
    null = torch.empty(1, device=dev)
    print(f"host: one empty torch op + sync {_wall_ms(lambda: null.zero_(), 50) * 1e3:.1f} us, "
          f".tolist() of 4 {_wall_ms(lambda: null.tolist(), 50) * 1e3:.1f} us")
    for rate in (float(r) for r in args.rates.split(",")):
        new = old.clone()
        new[torch.rand(n, device=dev, generator=g) < rate] ^= 1
        print(f"-- {100 * rate:.1f}% changed: ms (share of memcpy)")
        for block, warps in (map(int, c.split(":")) for c in args.configs.split(",")):
            blocks = -(-n // block)
            mask = torch.empty(blocks * block // 16, dtype=torch.int16, device=dev)
            out = torch.empty(5 * blocks, dtype=torch.int64, device=dev)
            stats = torch.empty(3, blocks, dtype=torch.int64, device=dev)
            fl = torch.empty(2, blocks, dtype=torch.int64, device=dev)
            k = dk._kernels()
            if True:
                rungs = {
                    "read": lambda: l_read[(blocks,)](new, old, n, out, BLOCK=block,
                                                      num_warps=warps),
                    "mark": lambda: l_mark[(blocks,)](new, old, n, mask, out, BLOCK=block,
                                                      RUNG=0, num_warps=warps),
                    "count": lambda: l_mark[(blocks,)](new, old, n, mask, out, BLOCK=block,
                                                       RUNG=1, num_warps=warps),
                    "skips": lambda: l_mark[(blocks,)](new, old, n, mask, out, BLOCK=block,
                                                       RUNG=2, num_warps=warps),
                    "old": lambda: l_old[(blocks,)](new, old, n, mask, stats, fl[0], fl[1],
                                                    blocks, STEP=tl.int32, BLOCK=block,
                                                    num_warps=warps),
                    "new": _cut_mark(new, old, block, warps, 2),
                    "new-elem": _cut_mark(new, old, block, warps, 0),
                }
                row = []
                wanted = args.rungs.split(",")
                for name, fn in ((k_, f) for k_, f in rungs.items() if k_ in wanted):
                    t = _ms(fn, args.iters)
                    row.append(f"{name} {t:.3f} ({100 * mc / t:.0f}%)")
                print(f"BLOCK {block:5d} warps {warps}: " + "  ".join(row), flush=True)
        # the apply's parts (default constants)
        from megatron_reshard.delta.encoding import apply, encode
        count, enc, payload = encode(new, old)
        view = old.clone()
        nbytes = payload.numel()
        k = dk._kernels()
        got = {}  # the batch-of-one table launch_gaps_many would send
        dk._gaps_groups([(view, count, True, payload)], lambda table, found, chunks, *_:
                        got.update(table=table, found=found, chunks=chunks))
        table, found, chunks = got["table"], got["found"], got["chunks"]
        sums = torch.zeros(3 * chunks, dtype=torch.int64, device=dev)
        ends = torch.cumsum(sums, 0)
        parts = {
            "apply (wall)": (_wall_ms, lambda: apply(view, count, enc, payload)),
            "encode (wall)": (_wall_ms, lambda: encode(new, old)),
            "Cut (wall)": (_wall_ms, lambda: dk.cut(new, old)),
            "gap_sums": (_ms, lambda: k.gap_sums[(chunks,)](table, 1, sums, found, chunks,
                                                            CHUNK=dk.CHUNK, num_warps=4)),
            "cumsum": (_ms, lambda: torch.cumsum(sums, 0)),
            "gap_locate": (_ms, lambda: k.gap_locate[(chunks,)](
                table, 1, ends, found, chunks, CHUNK=dk.CHUNK, num_warps=4)),
        }
        k.gap_sums[(chunks,)](table, 1, sums, found, chunks, CHUNK=dk.CHUNK, num_warps=4)
        torch.cumsum(sums, 0, out=ends)
        k.gap_locate[(chunks,)](table, 1, ends, found, chunks, CHUNK=dk.CHUNK, num_warps=4)
        parts["apply_gaps"] = (_ms, lambda: k.apply_gaps[(chunks,)](
            table, 1, ends, found, chunks, TY=tl.int16, DIFF8=True, STEP=tl.int32, ITEM=2,
            CHUNK=dk.CHUNK, num_warps=4))
        cut = dk.cut(new, old)
        parts["payload (wall)"] = (_wall_ms, lambda: cut.payload("gaps", True))
        print(f"   payload {nbytes / 2**20:.1f} MiB ({count} changed); " + "  ".join(
            f"{name} {how(fn, args.iters):.3f}" for name, (how, fn) in parts.items()))


if __name__ == "__main__":
    main()
