"""One-device engine benchmark: the engine's copy paths against the device's own memcpy,
and its host cost per param, in one process (one GPU, or the CPU for a smoke run).

    python scripts/bench_engine_1gpu.py                      # CUDA if present (one GPU)
    python scripts/bench_engine_1gpu.py --device cpu --small # CPU/gloo smoke (a test runs it)

Needs torch only (no megatron, no msgspec). A process group of one rank (NCCL on CUDA,
gloo on CPU) runs ``xfer_batch`` with both sides on that rank (self-transfer):

- ``local_*``: every byte is a local copy (contiguous: one memcpy; a transposed or
  column-block destination and experts given as a list of tensors: the Triton copy
  kernels on CUDA, ``engine/kernel_copies.py``, else torch's copies);
- ``pack_*`` / ``unpack_*``: the staging copies of a strided exchange (the program a
  rank of a 2-rank S(0) -> S(1) reshard runs), timed without the wire;
- ``host_*``: 1,000 small params in one batch, host time per param (CPU time of the
  calling thread per call) and the call's wall time.

The local cases also print the peak extra memory of one call (bench/memory.py): the
experts given as a list need none (no stacking buffer).

Each copy figure is printed with the raw reference measured in the same run, a plain
``dst.copy_(src)`` of the same bytes between contiguous tensors, and their ratio
(engine GB/s / memcpy GB/s; 100% = memcpy speed). Medians of ``--iters`` timed calls.
"engine/memcpy" times one call from an idle device, so the call's host time before its
first copy counts; "queued" times ``--queued`` calls back to back against as many
memcpys (a refit queues many params: the host runs ahead of the copies).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _queued(fn, measure, args) -> float:
    """Seconds per call of ``--queued`` calls issued back to back: the host's part of a
    call hidden behind the copies of the calls before it, as in a refit of many params."""
    def calls():
        for _ in range(args.queued):
            fn()
    return measure(calls, args.iters, args.warmup) / args.queued


def _row(name: str, nbytes: int, fn, device, measure, args) -> dict:
    """The case's figures, each against a plain ``copy_`` of the same bytes between
    contiguous tensors timed alike: one call from an idle device (its host time before
    the first copy included) and ``--queued`` calls back to back."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    engine_s = measure(fn, args.iters, args.warmup)
    raw_s = measure(lambda: b.copy_(a), args.iters, args.warmup)
    gbps, raw = nbytes / engine_s / 1e9, nbytes / raw_s / 1e9
    queued = _queued(lambda: b.copy_(a), measure, args) / _queued(fn, measure, args)
    return {"case": name, "mib": nbytes / 2**20, "engine_ms": 1e3 * engine_s,
            "engine_gbps": gbps, "memcpy_ms": 1e3 * raw_s, "memcpy_gbps": raw,
            "vs_memcpy": gbps / raw, "queued_vs_memcpy": queued}


def _peak_extra(fn, device) -> int:
    """Peak extra memory of one call in bytes (bench/memory.py: the CUDA allocator's
    peaks, or the CPU allocator's events)."""
    from megatron_reshard.tools.bench.memory import measure_cpu_peak_extra, measure_peak_extra

    if device.type == "cuda":
        return measure_peak_extra(fn, device)[1].extra_bytes
    return measure_cpu_peak_extra(fn)[1]


def local_cases(args, device, measure) -> list[dict]:
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo

    me = MeshInfo(torch.tensor([0]))
    n = 1024 if args.small else 16384
    e, r, c = (8, 64, 48) if args.small else (128, 2048, 768)
    bf16 = torch.bfloat16
    src = torch.randn(n, n, device=device).to(bf16)
    cases = {
        "local_contiguous": (src, torch.empty_like(src), (Shard(0),), (Shard(0),)),
        # the destination's storage transposed: element by element (no word fits; a
        # worst case: vLLM keeps no weight transposed)
        "local_strided_dst": (src, torch.empty(n, n, dtype=bf16, device=device).t(),
                              (Shard(0),), (Shard(1),)),
        # the destination a column block of a wider tensor (unit last stride): as words
        "local_column_block_dst": (src, torch.empty(n, 2 * n, dtype=bf16,
                                                    device=device)[:, n:],
                                   (Shard(0),), (Shard(1),)),
        # a rank's experts as separate tensors (the training side): one copy per expert
        "local_experts_list": ([torch.randn(r, c, device=device).to(bf16) for _ in range(e)],
                               torch.empty(e, r, c, dtype=bf16, device=device),
                               (Shard(0),), (Replicate(),)),
    }
    rows = []
    for name, (s, d, sp, dp) in cases.items():
        shape = (len(s), *s[0].shape) if isinstance(s, list) else tuple(s.shape)
        t = Transfer(name, shape, bf16, me, sp, me, dp, s, d)
        planner = Planner()
        nbytes = d.numel() * d.element_size()
        rows.append(_row(name, nbytes,
                         lambda: xfer_batch([t], None, planner=planner, agree=False),
                         device, measure, args))
        rows[-1]["peak_extra_mib"] = _peak_extra(
            lambda: xfer_batch([t], None, planner=planner, agree=False), device) / 2**20
        want = torch.stack(s) if isinstance(s, list) else s
        assert torch.equal(d, want.reshape(d.shape)), f"{name}: not exact"
        del t, s, d
    return rows


def profile_list_case(args, device) -> None:
    """Where one call of the experts-as-a-list local copy spends its host time: CPU time
    of the calling thread per call, then cProfile's top functions over 200 calls."""
    import cProfile
    import pstats

    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo

    me = MeshInfo(torch.tensor([0]))
    e, r, c = (8, 64, 48) if args.small else (128, 2048, 768)
    bf16 = torch.bfloat16
    s = [torch.randn(r, c, device=device).to(bf16) for _ in range(e)]
    d = torch.empty(e, r, c, dtype=bf16, device=device)
    t = Transfer("experts", (e, r, c), bf16, me, (Shard(0),), me, (Replicate(),), s, d)
    planner = Planner()

    def call():
        xfer_batch([t], None, planner=planner, agree=False)
    for _ in range(5):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host = []
    for _ in range(50):
        c0 = time.thread_time()
        call()
        host.append(time.thread_time() - c0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    print(f"experts as a list: host CPU time per call {1e6 * statistics.median(host):.1f} µs "
          f"(median of 50)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        call()
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


def _kept_copies(planner):
    """The kept local-copy batches (``copies.Copies``) of a planner's programs."""
    return [prog._local_batch[1] for batches in planner._batches.values()
            for batch in batches.values() for prog in batch.programs.values()
            if prog._local_batch is not None]


def _host_marks():
    """Wrap the steps of a warm call (bench only) so that each records when it starts and
    ends on the host: ``marks`` is cleared before a call and read after it."""
    from megatron_reshard.engine import copies, execute, kernel_copies

    marks = []

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **k):
            marks.append((label + ">", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((label + "<", time.perf_counter()))
        setattr(owner, name, timed)
        return owner, name, fn

    undo = [wrap(execute, "describe_batch", "describe"), wrap(execute, "local_ok", "checks"),
            wrap(execute, "stride_keys", "strides"), wrap(execute, "_execute", "execute"),
            wrap(copies.Copies, "run", "copies.run"),
            wrap(kernel_copies.Replayed, "__call__", "launch")]
    try:  # a repeated call's lane (engine/lane.py): its guard check, then its addresses
        from megatron_reshard.engine import lane
    except ImportError:
        return marks, undo
    undo += [wrap(lane.Lane, "flat", "lane.guard"), wrap(lane.Lane, "same_copies", "lane.addr")]
    return marks, undo


def _event_ms(fn, device, n: int) -> tuple[float, float]:
    """(median event ms, median host µs) of ``fn`` from an idle device."""
    ev, host = [], []
    cuda = device.type == "cuda"
    for _ in range(n):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            torch.cuda.synchronize(device)
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        if cuda:
            end.record()
            end.synchronize()
            ev.append(start.elapsed_time(end))
    return statistics.median(ev) if cuda else 1e3 * statistics.median(host), \
        1e6 * statistics.median(host)


def breakdown_cases(args, device) -> None:
    """Where one call's time goes on CUDA, per local case: the call (event ms from an idle
    device, host µs until it returns), its kept launch alone (the CUDA graph replay), the
    same kernels launched eagerly, and a memcpy of the same bytes; then when each step of
    the call starts and ends on the host (µs after the call starts, medians)."""
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo

    me = MeshInfo(torch.tensor([0]))
    n = 1024 if args.small else 16384
    e, r, c = (8, 64, 48) if args.small else (128, 2048, 768)
    bf16 = torch.bfloat16
    src = torch.randn(n, n, device=device).to(bf16)
    experts = [torch.randn(r, c, device=device).to(bf16) for _ in range(e)]
    order = _block_order(e, r, c, device)
    cases = {
        "contiguous": (src, torch.empty_like(src), (Shard(0),), (Shard(0),)),
        "strided_dst": (src, torch.empty(n, n, dtype=bf16, device=device).t(),
                        (Shard(0),), (Shard(1),)),
        "column_block": (src, torch.empty(n, 2 * n, dtype=bf16, device=device)[:, n:],
                         (Shard(0),), (Shard(1),)),
        "experts_list": (experts, torch.empty(e, r, c, dtype=bf16, device=device),
                         (Shard(0),), (Replicate(),)),
        "list_ordered": (experts, order.permuted_rows(
            torch.empty(e, r, c, dtype=bf16, device=device), ((0, e), (0, r), (0, c))),
            (Shard(0),), (Replicate(),)),
    }
    print(f"{'case':<14}{'call ms':>9}{'host µs':>9}{'replay ms':>10}{'host µs':>9}"
          f"{'eager ms':>10}{'host µs':>9}{'memcpy ms':>10}{'host µs':>9}  kernels")
    timelines = {}
    for name, (s, d, sp, dp) in cases.items():
        shape = (len(s), *s[0].shape) if isinstance(s, list) else tuple(s.shape)
        t = Transfer(name, shape, bf16, me, sp, me, dp, s, d)
        planner = Planner()

        def call(t=t, planner=planner):
            xfer_batch([t], None, planner=planner, agree=False)
        for _ in range(6):
            call()
        kept = _kept_copies(planner)
        nbytes = math.prod(shape) * 2
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        row = [*_event_ms(call, device, 30)]
        graph = kept and kept[0]._launch and kept[0]._launch.graph is not None
        row += [*_event_ms(kept[0]._launch, device, 30)] if graph else [math.nan, math.nan]
        row += ([*_event_ms(kept[0]._issue, device, 30)] if kept and kept[0]._launch is not None
                else [math.nan, math.nan])
        row += [*_event_ms(lambda: b.copy_(a), device, 30)]
        tables = ([type(x).__name__ for x in kept[0].kernels.tables]
                  + [type(x).__name__ for x in kept[0].row_tables]) if kept else []
        print(f"{name:<14}{row[0]:>9.3f}{row[1]:>9.1f}{row[2]:>10.3f}{row[3]:>9.1f}"
              f"{row[4]:>10.3f}{row[5]:>9.1f}{row[6]:>10.3f}{row[7]:>9.1f}  {tables} "
              f"graph={bool(graph)}"
              + (f" ({kept[0]._launch.error})" if kept and kept[0]._launch
                 and kept[0]._launch.error else ""), flush=True)
        marks, undo = _host_marks()
        got: dict = {}
        for _ in range(30):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks.clear()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            for label, at in marks:
                got.setdefault(label, []).append(1e6 * (at - t0))
            got.setdefault("return", []).append(1e6 * (t1 - t0))
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)
        timelines[name] = {k: statistics.median(v) for k, v in got.items()}
        del t, kept, a, b
    print("host timeline of a warm call, µs after it starts (medians of 30; '>' enters, "
          "'<' leaves)")
    for name, marks in timelines.items():
        print(f"  {name:<14}" + "  ".join(f"{k} {v:.1f}" for k, v in marks.items()))
    if args.trace and device.type == "cuda":
        _trace(cases, args, device)


def _trace(cases, args, device) -> None:
    """torch.profiler traces (Chrome JSON) of three warm calls of the column block and
    the experts list, each from an idle device."""
    import os

    from torch.profiler import ProfilerActivity, profile

    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo

    me = MeshInfo(torch.tensor([0]))
    os.makedirs(args.trace, exist_ok=True)
    for name in ("column_block", "experts_list", "contiguous"):
        s, d, sp, dp = cases[name]
        shape = (len(s), *s[0].shape) if isinstance(s, list) else tuple(s.shape)
        t = Transfer(name, shape, torch.bfloat16, me, sp, me, dp, s, d)
        planner = Planner()
        for _ in range(6):
            xfer_batch([t], None, planner=planner, agree=False)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.cuda.synchronize(device)
                xfer_batch([t], None, planner=planner, agree=False)
            torch.cuda.synchronize(device)
        prof.export_chrome_trace(os.path.join(args.trace, f"{name}.json"))
        print(f"---- {name}: torch.profiler, 3 calls ----")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))


def pack_cases(args, device, measure) -> list[dict]:
    """The staging copies of rank 0 of 2-rank reshards, without the wire: the strided
    pack of S(0) -> S(1) (its source's column block for the peer) and the strided
    unpack of S(1) -> S(0) (the peer's column block into its destination)."""
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import Planner, Transfer
    from megatron_reshard.engine.plan import layout_key
    from megatron_reshard.engine.program import Program
    from megatron_reshard.engine.schedule import build_schedule
    from megatron_reshard.layout.placements import MeshInfo

    n = 1024 if args.small else 16384
    both = MeshInfo(torch.tensor([0, 1]))
    bf16 = torch.bfloat16
    budget = args.staging_mib << 20
    rows = []
    for what, sp, dp in (("packs", Shard(0), Shard(1)), ("unpacks", Shard(1), Shard(0))):
        src = torch.randn(*((n // 2, n) if sp == Shard(0) else (n, n // 2)),
                          device=device).to(bf16)
        dst = torch.empty(*((n, n // 2) if dp == Shard(1) else (n // 2, n)), dtype=bf16,
                          device=device)
        t = Transfer("w", (n, n), bf16, both, (sp,), both, (dp,), src, dst)
        plan = Planner().plan(layout_key((n, n), both, (sp,), both, (dp,)))
        prog = Program(build_schedule([plan], [2], 0, budget, set()), [t], [plan], 0)
        tensors = [src, dst]
        rounds = [r for r in prog.rounds if getattr(r, what)]
        buf = torch.empty(max(r.nbytes for r in rounds), dtype=torch.uint8, device=device)
        plans = [getattr(r, what) for r in rounds if getattr(r, what)]
        nbytes = sum(nb for p in plans for _, _, nb in p.flat) + sum(
            math.prod(shape) * dtype.itemsize for p in plans for _, dtype, shape, *_ in p.typed)

        def run(plans=plans, pack=what == "packs"):
            for p in plans:
                prog.stage(buf, p, tensors, pack=pack)

        rows.append(_row(f"{what[:-1]}_strided_{len(plans)}_rounds", nbytes, run, device,
                         measure, args))
    return rows


def _block_order(e: int, r: int, c: int, device):
    """A FlashInfer-TRTLLM-like order of an ``[e, r, c]`` expert tensor: each group of 32
    rows interleaved (row j to slot (j % 4) * 8 + j // 4, as TRTLLM's w2), columns in
    blocks of 64 elements (16 for the small shapes) stored block-major."""
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    width = 64 if c % 64 == 0 else 16
    j = torch.arange(r)
    slot = (j // 32) * 32 + (j % 32 % 4) * 8 + j % 32 // 4
    cols = torch.arange(c)
    terms = (torch.arange(e) * r * c, slot * width, (cols // width) * r * width + cols % width)
    return KernelOrder("trtllm-like", terms).to(device)


def ordered_cases(args, device, measure) -> list[dict]:
    """The process-group path into a kernel's permuted-row order (issue 34): a rank's
    experts as a list copied locally into a TRTLLM-like order, and the staged unpack of
    the peer's half of each expert's rows (rank 0 of S(1) -> S(0) on two ranks, without
    the wire), each beside the same into checkpoint order; bit-checked through the order."""
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.engine.plan import layout_key
    from megatron_reshard.engine.program import Program
    from megatron_reshard.engine.schedule import build_schedule
    from megatron_reshard.layout.placements import MeshInfo

    e, r, c = (8, 64, 48) if args.small else (128, 2048, 768)
    bf16 = torch.bfloat16
    order = _block_order(e, r, c, device)
    box = ((0, e), (0, r), (0, c))
    me = MeshInfo(torch.tensor([0]))
    rows = []
    src = [torch.randn(r, c, device=device).to(bf16) for _ in range(e)]
    for name, ordered in (("local_list_checkpoint", False), ("local_list_ordered", True)):
        storage = torch.zeros(e, r, c, dtype=bf16, device=device)
        dst = order.permuted_rows(storage, box) if ordered else storage
        t = Transfer(name, (e, r, c), bf16, me, (Shard(0),), me, (Replicate(),), src, dst)
        planner = Planner()
        rows.append(_row(name, storage.numel() * 2,
                         lambda: xfer_batch([t], None, planner=planner, agree=False),
                         device, measure, args))
        got = dst.read() if ordered else storage
        assert torch.equal(got.view(torch.int16), torch.stack(src).view(torch.int16)), name
    both = MeshInfo(torch.tensor([0, 1]))
    whole = torch.randn(e, r, c, device=device).to(bf16)
    budget = args.staging_mib << 20
    got = []
    for name, ordered in (("unpack_rows_checkpoint", False), ("unpack_rows_ordered", True)):
        storage = torch.zeros(e // 2, r, c, dtype=bf16, device=device)
        dst = (order.permuted_rows(storage, ((0, e // 2), (0, r), (0, c))) if ordered
               else storage)
        t = Transfer("w", (e, r, c), bf16, both, (Shard(1),), both, (Shard(0),),
                     whole[:, : r // 2].contiguous(), dst)
        plan = Planner().plan(layout_key((e, r, c), both, (Shard(1),), both, (Shard(0),)))
        prog = Program(build_schedule([plan], [2], 0, budget, {(0, 1)}), [t], [plan], 0)
        tensors = [t.src, dst]
        plans = [rd.unpacks for rd in prog.rounds if rd.unpacks]
        buf = torch.empty(max(rd.nbytes for rd in prog.rounds), dtype=torch.uint8,
                          device=device)
        nbytes = sum(nb for p in plans for _, _, nb in p.flat) + sum(
            math.prod(shape) * dtype.itemsize for p in plans for _, dtype, shape, *_ in p.typed)
        # the same bytes in the buffer for both cases: as if the peer's rows had arrived
        g = torch.Generator(device=device).manual_seed(7)
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=device,
                                generator=g))

        def run(plans=plans, prog=prog, tensors=tensors, buf=buf):
            for p in plans:
                prog.stage(buf, p, tensors, pack=False)

        rows.append(_row(name, nbytes, run, device, measure, args))
        got.append(dst.read() if ordered else storage)
    # the same unpack into two layouts: equal element for element (bits)
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), "unpack differs"
    return rows


def host_cases(args, device) -> list[dict]:
    """1,000 small params in one batch on this rank: host µs per param."""
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo

    me = MeshInfo(torch.tensor([0]))
    rep, s0, s1 = (Replicate(),), (Shard(0),), (Shard(1),)
    bf16 = torch.bfloat16
    kinds = {
        "host_1d_4096": lambda: ((4096,), rep, rep, torch.randn(4096, device=device).to(bf16),
                                 torch.empty(4096, dtype=bf16, device=device)),
        "host_2d_64x64": lambda: ((64, 64), s0, s1, torch.randn(64, 64, device=device).to(bf16),
                                  torch.empty(64, 64, dtype=bf16, device=device)),
        # destinations in transposed storage: each written by its own strided copy
        "host_transposed_dst_64x64": lambda: ((64, 64), s0, s1,
                                              torch.randn(64, 64, device=device).to(bf16),
                                              torch.empty(64, 64, dtype=bf16,
                                                          device=device).t()),
    }
    rows = []
    for name, make in kinds.items():
        ts = []
        for i in range(args.params):
            shape, sp, dp, s, d = make()
            ts.append(Transfer(f"p{i}", shape, bf16, me, sp, me, dp, s, d))
        planner = Planner()
        for _ in range(args.warmup + 1):
            xfer_batch(ts, None, planner=planner)
        cpu, wall = [], []
        for _ in range(args.iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            c0, t0 = time.thread_time(), time.perf_counter()
            xfer_batch(ts, None, planner=planner)  # agreed every call, as a plain caller
            cpu.append(time.thread_time() - c0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall.append(time.perf_counter() - t0)
        for t in ts:
            assert torch.equal(t.dst, t.src), f"{name}: not exact"
        rows.append({"case": name, "params": args.params,
                     "host_us_per_param": 1e6 * statistics.median(cpu) / args.params,
                     "wall_us_per_param": 1e6 * statistics.median(wall) / args.params})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--params", type=int, default=1000)
    ap.add_argument("--staging-mib", type=int, default=256)
    ap.add_argument("--queued", type=int, default=8,
                    help="calls back to back for the queued figure")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--profile", action="store_true",
                    help="first profile the host time of the experts-as-a-list call")
    ap.add_argument("--breakdown", action="store_true",
                    help="first break one call of each local case down (host steps, "
                    "graph replay, eager launch, memcpy)")
    ap.add_argument("--trace", default=None,
                    help="with --breakdown: torch.profiler traces into this folder")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)
    from megatron_reshard.tools.worlds import free_ports

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}", rank=0,
                            world_size=1)
    from megatron_reshard.tools.bench.timing import median_timer

    measure = median_timer(device)
    from megatron_reshard.engine.kernel_copies import kernels_for

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kernels = "on" if kernels_for(device) is not None else "off"
    print(f"engine, one process on {name}, torch {torch.__version__}, copy kernels {kernels}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}",
          flush=True)
    if args.profile:
        profile_list_case(args, device)
    if args.breakdown:
        breakdown_cases(args, device)
    copies = (local_cases(args, device, measure) + pack_cases(args, device, measure)
              + ordered_cases(args, device, measure))
    print(f"{'case':<28}{'MiB':>9}{'engine ms':>11}{'GB/s':>9}{'memcpy ms':>11}{'GB/s':>9}"
          f"{'engine/memcpy':>15}{'queued':>8}")
    for r in copies:
        extra = (f"   peak extra {r['peak_extra_mib']:.2f} MiB (staging budget "
                 f"{args.staging_mib} MiB)" if "peak_extra_mib" in r else "")
        print(f"{r['case']:<28}{r['mib']:>9.1f}{r['engine_ms']:>11.3f}{r['engine_gbps']:>9.1f}"
              f"{r['memcpy_ms']:>11.3f}{r['memcpy_gbps']:>9.1f}{r['vs_memcpy']:>15.0%}"
              f"{r['queued_vs_memcpy']:>8.0%}{extra}")
    host = host_cases(args, device)
    print(f"{'case':<28}{'params':>9}{'host µs/param':>15}{'wall µs/param':>15}")
    for r in host:
        print(f"{r['case']:<28}{r['params']:>9}{r['host_us_per_param']:>15.2f}"
              f"{r['wall_us_per_param']:>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "kernels": kernels, "copies": copies, "host": host}, f,
                      indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
