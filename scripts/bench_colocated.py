"""Colocated refit benchmark: two processes on one device, TP1 -> TP1, against a memcpy.

    python scripts/bench_colocated.py                         # one GPU (CUDA IPC)
    python scripts/bench_colocated.py --device cpu --small    # CPU smoke (shared memory)

Needs torch only. Process 0 plays the training rank: Megatron's parameter buffers of a
Qwen3-shaped slice (per layer: interleaved ``linear_qkv`` [nkv, (q/kv + 2) * head_dim, H],
``linear_proj``, norms, router, and either the dense ``linear_fc1`` [2 * FFN, H] / ``fc2``
or 128 experts each with its own ``fc1`` [2 * 768, H] / ``fc2`` [H, 768]; embedding and
output layer). Process 1 plays the generation rank: vLLM's storage (``qkv_proj``,
``gate_up_proj``, stacked ``w13`` [E, 2 * 768, H] / ``w2`` [E, H, 768]). The
``gpt_oss_120b`` case has gpt-oss-120b's experts instead (128 of 2880, biased), sent in
vLLM's wire form (w13 seen as [E, I, 2, H]: gate and up interleaved). They form a
refit group with ``transport="colocated"`` and move the refit tensors as the refit loop
hands them over (wire forms: q/k/v per KV group, gate/up as the halves of fc1, experts as
lists of per-expert views), cut as the loop cuts a stage (``--batch-mib``, default its
``batch_bytes`` of 512 MiB; 0: one batch), each batch in fresh ``Transfer`` objects over
the same views with ``overlap=True``, then ``flush``. Reported per case (median of
``--iters``):

- ``refit``: a whole refit on the generation rank, from the first call to the return of
  ``flush`` (which returns once its copies are complete), GB/s beside ``dst.copy_(src)``
  of the same bytes in the same run, ratio. Both ranks enter each timed refit from a
  start barrier (``--no-align``: each when its last iteration is done);
- ``copies``: the refit's copies alone (every cached copy batch run once, back to back);
- ``experts``: one layer's expert params alone (w13 gate + up halves, w2), both ways;
- host µs per param of a refit on the generation rank and the training rank's host ms per
  refit: thread CPU time outside the waits (the barriers spin on ``sched_yield`` and a
  CUDA stream or event sync spins too, so their CPU time is waiting, not work;
  ``_WaitClock``);
- peak extra device memory of one refit on each side (allocator peaks).
Every case is checked bit for bit against the source values regenerated on the
generation side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

SLICES = {  # hidden, heads, kv heads, head_dim, dense FFN or (experts, expert FFN), vocab
    "qwen3_30b_a3b": dict(h=2048, heads=32, kv=4, hd=128, ffn=None, experts=128, effn=768,
                          vocab=151936),
    "qwen3_8b": dict(h=4096, heads=32, kv=8, hd=128, ffn=12288, experts=0, effn=0,
                     vocab=151936),
    # gpt-oss-120b's experts (openai/gpt-oss-120b: 128 of I = H = 2880 per layer, 6.4 GB a
    # layer: at most 2 layers, so both sides and the check fit one 80 GB GPU), in vLLM's
    # wire form: interleaved w13 / its bias, w2 / its bias; attention as the Qwen slices
    # (gpt-oss's q/k/v biases, o_proj bias and sinks, small, left out)
    "gpt_oss_120b": dict(h=2880, heads=64, kv=8, hd=64, ffn=None, experts=128, effn=2880,
                         vocab=201088, oss=True, max_layers=2),
}
SMALL = {"qwen3_30b_a3b": dict(h=64, heads=8, kv=2, hd=16, ffn=None, experts=8, effn=32, vocab=500),
         "qwen3_8b": dict(h=64, heads=8, kv=2, hd=16, ffn=160, experts=0, effn=0, vocab=500),
         "gpt_oss_120b": dict(h=64, heads=8, kv=2, hd=16, ffn=None, experts=8, effn=64, vocab=500,
                              oss=True, max_layers=2)}


def _fill(shape, seed: int, device, dtype) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def train_buffers(c: dict, layers: int, device, dtype) -> dict:
    """Megatron's local params of the slice (TP1), deterministic per name."""
    out, seed = {}, [0]

    def make(name, shape):
        seed[0] += 1
        out[name] = _fill(shape, seed[0], device, dtype)

    h, q_per = c["h"], c["heads"] // c["kv"]
    make("embedding", (c["vocab"], h))
    for i in range(layers):
        make(f"{i}.qkv", (c["kv"] * (q_per + 2) * c["hd"], h))
        make(f"{i}.proj", (h, c["heads"] * c["hd"]))
        make(f"{i}.ln1", (h,))
        make(f"{i}.ln2", (h,))
        if c["experts"]:
            make(f"{i}.router", (c["experts"], h))
            for e in range(c["experts"]):
                make(f"{i}.e{e}.fc1", (2 * c["effn"], h))
                make(f"{i}.e{e}.fc2", (h, c["effn"]))
                if c.get("oss"):  # gpt-oss: a bias on each
                    make(f"{i}.e{e}.fc1b", (2 * c["effn"],))
                    make(f"{i}.e{e}.fc2b", (h,))
        else:
            make(f"{i}.fc1", (2 * c["ffn"], h))
            make(f"{i}.fc2", (h, c["ffn"]))
    make("output", (c["vocab"], h))
    return out


def gen_buffers(c: dict, layers: int, device, dtype) -> dict:
    h, e, f = c["h"], c["experts"], c["effn"]
    out = {"embed": torch.empty(c["vocab"], h, device=device, dtype=dtype),
           "lm_head": torch.empty(c["vocab"], h, device=device, dtype=dtype)}
    for i in range(layers):
        out[f"{i}.qkv_proj"] = torch.empty((c["heads"] + 2 * c["kv"]) * c["hd"], h,
                                           device=device, dtype=dtype)
        out[f"{i}.o_proj"] = torch.empty(h, c["heads"] * c["hd"], device=device, dtype=dtype)
        out[f"{i}.ln1"] = torch.empty(h, device=device, dtype=dtype)
        out[f"{i}.ln2"] = torch.empty(h, device=device, dtype=dtype)
        if e:
            out[f"{i}.gate"] = torch.empty(e, h, device=device, dtype=dtype)
            out[f"{i}.w13"] = torch.empty(e, 2 * f, h, device=device, dtype=dtype)
            out[f"{i}.w2"] = torch.empty(e, h, f, device=device, dtype=dtype)
            if c.get("oss"):
                out[f"{i}.w13b"] = torch.empty(e, 2 * f, device=device, dtype=dtype)
                out[f"{i}.w2b"] = torch.empty(e, h, device=device, dtype=dtype)
        else:
            out[f"{i}.gate_up"] = torch.empty(2 * c["ffn"], h, device=device, dtype=dtype)
            out[f"{i}.down"] = torch.empty(h, c["ffn"], device=device, dtype=dtype)
    return out


def synthetic_orders(c: dict, device) -> dict:
    """Expert orders shaped like FlashInfer's for the ``--small`` slice (the learned ones fit
    the real shapes only): ``flashinfer_trtllm``, rows permuted and 16-column blocks stored
    block-major; ``flashinfer_cutlass``, w13 as [up; gate]."""
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder, contiguous_terms

    def blocks(shape, seed):
        e, r, cols = shape
        slot = torch.randperm(r, generator=torch.Generator().manual_seed(seed))
        i = torch.arange(cols)
        return KernelOrder("trtllm-like", (torch.arange(e) * r * cols, slot * 16,
                                           (i // 16) * r * 16 + i % 16))

    w13 = (c["experts"], 2 * c["effn"], c["h"])
    w2 = (c["experts"], c["h"], c["effn"])
    e, r, cols = w13
    swap = contiguous_terms(w13)
    rows = ((torch.arange(r) + r // 2) % r) * cols
    out = {"flashinfer_trtllm": {"w13": blocks(w13, 1), "w2": blocks(w2, 2)},
           "flashinfer_cutlass": {"w13": KernelOrder("cutlass-like", (swap[0], rows, swap[2]))}}
    return {b: {k: o.to(device) for k, o in got.items()} for b, got in out.items()}


def learned_orders(path: str, device) -> dict:
    """``{backend: {"w13" | "w2": KernelOrder}}`` from ``scripts/bench_kernel_order.py learn``."""
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    out: dict = {}
    for key, item in torch.load(path, weights_only=False).items():
        backend, leaf = key.split("/")
        order = KernelOrder(item["backend"], tuple(item["terms"])).to(device)
        out.setdefault(backend, {})[leaf.split("_")[0]] = order
    return out


def ordered_dst(storage: torch.Tensor, order, box):
    """The destination of ``box`` of ``storage`` stored in ``order`` (None: checkpoint
    order): a strided view where the order keeps one, else its permuted rows."""
    if order is None:
        return storage[tuple(slice(a, b) for a, b in box)]
    view = order.view(storage, box)
    return view if view is not None else order.permuted_rows(storage, box)


def read_back(dst) -> torch.Tensor:
    """A destination's elements in checkpoint order (a view, or gathered through the order)."""
    from megatron_reshard.engine.kernel_copies import PermutedRows

    if isinstance(dst, PermutedRows):
        return dst.storage.view(-1)[dst.offsets().view(-1)].view(dst.shape)
    return dst


def wire(c: dict, layers: int, train: dict | None, gen: dict | None, dtype,
         orders: dict | None = None) -> tuple:
    """The refit tensors (name, global shape, src view, dst view): ``train``/``gen`` is
    None on the other process; ``orders``: the experts' storage orders (``{"w13": order,
    "w2": order}``, a kernel's; None: checkpoint order). Returns (all transfers, the
    expert transfers of layer 0)."""
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Transfer
    from megatron_reshard.layout.placements import MeshInfo

    src_mesh, dst_mesh = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    h, kv, hd, q_per = c["h"], c["kv"], c["hd"], c["heads"] // c["kv"]
    out, experts = [], []

    def add(name, shape, src, dst, shard=False, bucket=None):
        sp = [Shard(0)] if shard else [Replicate()]
        t = Transfer(name, tuple(shape), dtype, src_mesh, sp, dst_mesh, [Replicate()],
                     src() if train is not None else None, dst() if gen is not None else None)
        out.append(t)
        if bucket is not None:
            bucket.append(t)

    T, G = train or {}, gen or {}
    add("embed", (c["vocab"], h), lambda: T["embedding"], lambda: G["embed"])
    for i in range(layers):
        qkv3 = (lambda i=i: T[f"{i}.qkv"].view(kv, (q_per + 2) * hd, h))
        rows = [("q", 0, q_per * hd), ("k", q_per * hd, hd), ("v", (q_per + 1) * hd, hd)]
        at = 0
        for part, start, n in rows:
            glob = (kv, n, h)
            add(f"{i}.{part}", glob, lambda s=start, n=n, f=qkv3: f()[:, s:s + n, :],
                lambda i=i, at=at, n=n: G[f"{i}.qkv_proj"][at:at + kv * n].view(kv, n, h))
            at += kv * n
        add(f"{i}.o", (h, c["heads"] * hd), lambda i=i: T[f"{i}.proj"], lambda i=i: G[f"{i}.o_proj"])
        for ln in ("ln1", "ln2"):
            add(f"{i}.{ln}", (h,), lambda i=i, ln=ln: T[f"{i}.{ln}"], lambda i=i, ln=ln: G[f"{i}.{ln}"])
        if c["experts"]:
            e, f = c["experts"], c["effn"]
            add(f"{i}.router", (e, h), lambda i=i: T[f"{i}.router"], lambda i=i: G[f"{i}.gate"])
            bucket = experts if i == 0 else None
            if c.get("oss"):
                _oss_experts(add, T, G, i, e, f, h, bucket)
                continue
            o13, o2 = (orders or {}).get("w13"), (orders or {}).get("w2")
            for part, lo in (("gate", 0), ("up", f)):
                add(f"{i}.experts.{part}", (e, f, h),
                    lambda i=i, lo=lo: [T[f"{i}.e{k}.fc1"][lo:lo + f] for k in range(e)],
                    lambda i=i, lo=lo: ordered_dst(G[f"{i}.w13"], o13, ((0, e), (lo, lo + f), (0, h))),
                    shard=True, bucket=bucket)
            add(f"{i}.experts.down", (e, h, f),
                lambda i=i: [T[f"{i}.e{k}.fc2"] for k in range(e)],
                lambda i=i: ordered_dst(G[f"{i}.w2"], o2, ((0, e), (0, h), (0, f))),
                shard=True, bucket=bucket)
        else:
            n = c["ffn"]
            for part, lo in (("gate", 0), ("up", n)):
                add(f"{i}.{part}", (n, h), lambda i=i, lo=lo: T[f"{i}.fc1"][lo:lo + n],
                    lambda i=i, lo=lo: G[f"{i}.gate_up"][lo:lo + n])
            add(f"{i}.down", (h, n), lambda i=i: T[f"{i}.fc2"], lambda i=i: G[f"{i}.down"])
    add("lm_head", (c["vocab"], h), lambda: T["output"], lambda: G["lm_head"])
    return out, experts


def _oss_experts(add, T: dict, G: dict, i: int, e: int, f: int, h: int, bucket) -> None:
    """gpt-oss's experts as the refit sends them (``vllm_layout.gpt_oss``'s wire form): each
    Megatron expert tensor through the library's own view (``megatron.gpt_oss.wire_view``),
    vLLM's w13 seen as [E, I, 2, H] (gate and up interleaved), biases alike."""
    from megatron_reshard.megatron.gpt_oss import wire_view

    for leaf, shape, kind, src, dst, view in (
            ("w13", (e, f, 2, h), "oss_fc1", "fc1", "w13", (e, f, 2, h)),
            ("w13_bias", (e, f, 2), "oss_fc1_bias", "fc1b", "w13b", (e, f, 2)),
            ("w2", (e, h, f), "oss_fc2", "fc2", "w2", (e, h, f)),
            ("w2_bias", (e, h), "oss_fc2_bias", "fc2b", "w2b", (e, h))):
        add(f"{i}.experts.{leaf}", shape,
            lambda kind=kind, src=src: [wire_view(kind, T[f"{i}.e{k}.{src}"]) for k in range(e)],
            lambda dst=dst, view=view: G[f"{i}.{dst}"].view(view), shard=True, bucket=bucket)


def _nbytes(transfers) -> int:
    return sum(torch.Size(t.global_shape).numel() * t.dtype.itemsize for t in transfers)


def loop_batches(transfers: list, batch_mib: float) -> list:
    """The transfers in the refit loop's batches of ``batch_mib`` (0: one batch)."""
    from megatron_reshard.refit.order import byte_bounds

    if not batch_mib:
        return [transfers]
    sizes = [_nbytes([t]) for t in transfers]
    return [transfers[a:b] for a, b in byte_bounds(sizes, int(batch_mib * 2**20))]


def _run_all(transport) -> None:
    """Every cached copy batch of the refit once (its copies alone, no barrier)."""
    for copies in transport._batches.values():
        copies.run()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memcpy_s(nbytes: int, device, iters: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(iters + 2):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return statistics.median(times[2:])


def _peak(device, fn) -> int:
    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _profile(folder: str, tag: str, device, fn, iters: int) -> None:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(iters):
        _sync(device)
        prof.enable()
        fn()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{tag}.txt"), "w") as f:
        f.write(out.getvalue())


def _trace(folder: str, tag: str, device, fn) -> dict:
    """One call of ``fn`` under ``torch.profiler`` (CPU and CUDA): the chrome trace saved in
    ``folder``, and a summary of the device side: span of the copies from the first to the
    last, their busy time, and the largest idle gaps between two of them (with the names)."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{tag}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    if not gpu:
        return {"tag": tag, "gpu_ops": 0}
    gaps = sorted(((b["ts"] - (a["ts"] + a["dur"]), a["name"][:40], b["name"][:40])
                   for a, b in zip(gpu, gpu[1:])), reverse=True)[:5]
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    return {"tag": tag, "gpu_ops": len(gpu), "span_us": round(span, 1),
            "busy_us": round(sum(e["dur"] for e in gpu), 1),
            "gaps_us": [(round(g, 1), a, b) for g, a, b in gaps]}


class _WaitClock:
    """Thread CPU time spent inside the transport's waits (barriers, stream syncs), so that
    a refit's host time can be told without them; wraps the two methods in this process.
    With ``steps``, the transport's steps (describe, check, publish, copy-batch look-up,
    copy launches) are marked too (not counted as waits), for ``--timeline``."""

    spent = 0.0
    marks: list = []  # (what, clock at entry, at exit) of each wait and step, for --timeline
    events: list = []  # CUDA events around each run of the copies (with --timeline)

    @classmethod
    def install(cls, steps: bool = False) -> None:
        from megatron_reshard.engine import colocated, colocated_copies, colocated_views
        from megatron_reshard.engine.host_flags import HostFlags

        def timed(fn, what, wait=True):
            def wrapper(*a, **k):
                h0, t0 = time.thread_time(), time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if wait:
                        cls.spent += time.thread_time() - h0
                    cls.marks.append((what(a), t0, time.perf_counter()))
            return wrapper

        HostFlags.wait = timed(HostFlags.wait, lambda a: ("ready", "verdict", "copied")[a[1]])
        if torch.cuda.is_available():
            torch.cuda.Stream.synchronize = timed(torch.cuda.Stream.synchronize,
                                                  lambda a: "sync")
            torch.cuda.Event.synchronize = timed(torch.cuda.Event.synchronize,
                                                 lambda a: "sync")
        if steps and torch.cuda.is_available():  # the copies' device time, by CUDA events
            run = colocated_copies.CopyBatch.run

            def timed_run(self):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(self)
                b.record()
                cls.events.append((a, b))
            colocated_copies.CopyBatch.run = timed_run
        if steps:
            T = colocated.ColocatedTransport
            colocated.describe_batch = timed(colocated.describe_batch, lambda a: "describe", False)
            for owner, name in ((T, "_check"), (T, "_wait_written"),
                                (colocated_views.PublishedViews, "publish"),
                                (T, "_copy_batch"), (colocated_copies.CopyBatch, "run")):
                setattr(owner, name, timed(getattr(owner, name), lambda a, n=name: n.strip("_"),
                                           False))


def _timelines(rows: list) -> list:
    """Both ranks' steps of each timed refit on one clock (``perf_counter`` is the host's
    monotonic clock, shared by the two processes), in ms from the generation rank's start
    of the call: the median over the refits of each step's entry and exit, in entry order."""
    gen, train = rows[1], rows[0]
    steps: dict = {}
    for (g0, g1, gmarks), (_, _, tmarks) in zip(gen, train):
        for rank, marks in (("gen", gmarks), ("train", tmarks)):
            seen: dict = {}
            for what, a, b in marks:
                n = seen[what] = seen.get(what, 0) + 1
                key = f"{rank}.{what}" + (f"#{n}" if n > 1 else "")
                steps.setdefault(key, []).append(((a - g0) * 1e3, (b - g0) * 1e3))
        steps.setdefault("gen.end", []).append(((g1 - g0) * 1e3,) * 2)
    out = [(k, statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
           for k, v in steps.items()]
    return sorted(out, key=lambda x: x[1])


def run(rank: int, args, port: int, results) -> None:
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.engine import Planner
    from megatron_reshard.engine.host_flags import READY, HostFlags
    from megatron_reshard.engine.refit_transport import transport_of

    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    if args.permuted_tile_kib:  # an experiment: the permuted-row kernel's bytes a program
        from megatron_reshard.engine.kernel_copies import PermutedTable

        PermutedTable.TILE_BYTES = args.permuted_tile_kib << 10
    if args.permuted_rows:  # an experiment: the permuted-row kernel's rows per tile
        from megatron_reshard.engine.kernel_copies import PermutedTable

        PermutedTable.ROWS = args.permuted_rows
    _WaitClock.install(steps=args.timeline)
    if args.train_nap_s and rank == 0:  # an experiment: the training rank naps, never spins
        from megatron_reshard.engine import host_flags

        host_flags.SPIN_S, host_flags.LONGEST_NAP_S = 0.0, args.train_nap_s
    dtype = torch.bfloat16
    group = create_refit_group("127.0.0.1", port, rank, 2, "gloo", 120.0,
                               transport="colocated", who=("train", "gen")[rank])
    transport = transport_of(group)
    move = transport.move
    # a start barrier in shared host memory (ranks leave it within microseconds of each
    # other), so that a refit is timed from when both ranks call, as in a training step
    # where the generation side waits for the trainer; without it, whichever rank is late
    # from the last iteration's bookkeeping adds its lateness
    start = None if args.no_align else HostFlags(transport.store, rank, 2, None, 60.0,
                                                 key="bench/start")
    for name in args.cases:
        c = (SMALL if args.small else SLICES)[name]
        layers = min(args.layers, c.get("max_layers", args.layers))
        train = train_buffers(c, layers, device, dtype) if rank == 0 else None
        gen = gen_buffers(c, layers, device, dtype) if rank == 1 else None
        paths = []
        # gpt-oss's experts: checkpoint order only (the refit refuses a kernel's order there)
        for backend in (args.order_backends if c["experts"] and not c.get("oss") else ["checkpoint"]):
            orders = None
            if backend != "checkpoint":
                known = (synthetic_orders(c, device) if args.orders == "synthetic"
                         else learned_orders(args.orders, device))
                orders = known[backend]
            transfers, experts = wire(c, layers, train, gen, dtype, orders)
            tag = "" if backend == "checkpoint" else f"[{backend}]"
            paths += [(f"refit{tag}", transfers, orders), (f"experts{tag}", experts, orders)]
        for label, params, orders in paths:
            if not params:
                continue
            planner = Planner()
            batches = loop_batches(params, args.batch_mib)

            def refit(agree=False, batches=batches, planner=planner):
                # as the refit loop moves a stage: fresh Transfer objects per batch over the
                # same views, each batch with overlap, one flush after the last
                for batch in batches:
                    move([dataclasses.replace(t) for t in batch], group, planner=planner,
                         agree=agree, overlap=True)
                transport.flush()

            refit(agree=True)  # maps the training storages, votes, builds the copies
            times, host, lines, runs = [], [], [], []
            for _ in range(args.warmup + args.iters):
                _sync(device)
                if start is not None:  # both ranks start the refit together
                    start.next_batch()
                    start.arrive(READY)
                    start.wait(READY, "the benchmark's start barrier")
                _WaitClock.marks.clear()
                runs.append(len(_WaitClock.events))
                t0, h0, w0 = time.perf_counter(), time.thread_time(), _WaitClock.spent
                refit()
                times.append(time.perf_counter() - t0)  # flush waits for the copies
                _sync(device)
                host.append(time.thread_time() - h0 - (_WaitClock.spent - w0))
                lines.append((t0, t0 + times[-1], list(_WaitClock.marks)))
            runs.append(len(_WaitClock.events))
            if args.trace and rank == 1:  # the gen rank's copies: in a refit, then alone
                for i in range(2):
                    print(json.dumps(_trace(args.trace, f"{name}_{label}_refit{i}", device,
                                            refit)), flush=True)
                    print(json.dumps(_trace(args.trace, f"{name}_{label}_alone{i}", device,
                                            lambda: _run_all(transport))), flush=True)
            elif args.trace:
                for i in range(2):
                    _sync(device)
                    refit()
            if args.profile:  # where the host time of a refit goes, per rank (cProfile)
                _profile(args.profile, f"{name}_{label}_rank{rank}", device, refit, args.iters)
            peak = _peak(device, refit)
            if args.timeline:
                results.put((rank, name, label, {f"marks{rank}": lines[args.warmup:]}))
            if rank == 0:
                results.put((rank, name, label, {
                    "train_peak_extra_mib": peak / 2**20,
                    "train_host_ms": 1e3 * statistics.median(host[args.warmup:])}))
                continue
            nbytes = _nbytes(params)
            ref = train_buffers(c, layers, device, dtype)  # the same values, regenerated
            expect, _ = wire(c, layers, ref, None, dtype)
            by_name = {t.name: t.src for t in expect}
            for t in params:  # bit for bit, against the sources regenerated here
                want = by_name[t.name]
                want = torch.stack(want) if isinstance(want, list) else want
                got = read_back(t.dst).reshape(want.shape)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                    f"{name} {label}: {t.name} differs"
            del ref, expect, by_name
            pairs = sum(b.pairs for b in transport._batches.values())
            k = len(transport._batches)
            events = _WaitClock.events
            in_refits = [events[a][0].elapsed_time(events[b - 1][1])  # first copy to last
                         for a, b in zip(runs[args.warmup:-1], runs[args.warmup + 1:]) if b > a]
            _WaitClock.events = []
            ctimes = []
            for _ in range(args.iters + 2):
                _sync(device)
                t0 = time.perf_counter()
                _run_all(transport)
                _sync(device)
                ctimes.append(time.perf_counter() - t0)
            transport._batches.clear()
            refit_s, copy_s = statistics.median(times[args.warmup:]), statistics.median(ctimes[2:])
            if _WaitClock.events and in_refits:  # device time of the copies: refits, alone
                alone = [_WaitClock.events[i][0].elapsed_time(_WaitClock.events[i + k - 1][1])
                         for i in range(2 * k, len(_WaitClock.events) - k + 1, k)]
                print(f"copies' device time {name} {label}: in refits "
                      f"{statistics.median(in_refits):.3f} ms, alone "
                      f"{statistics.median(alone):.3f} ms", flush=True)
                _WaitClock.events = []
            raw_s = _memcpy_s(nbytes, device, args.iters)
            results.put((rank, name, label, {
                "expert_order": ",".join(sorted({o.backend for o in (orders or {}).values()}))
                or "checkpoint",
                "mib": nbytes / 2**20, "params": len(params), "batches": len(batches),
                "copy_pairs": pairs,
                "memcpy_gbps": nbytes / raw_s / 1e9,
                "refit_ms": refit_s * 1e3, "refit_gbps": nbytes / refit_s / 1e9,
                "refit_vs_memcpy": raw_s / refit_s,
                "copies_ms": copy_s * 1e3, "copies_gbps": nbytes / copy_s / 1e9,
                "copies_vs_memcpy": raw_s / copy_s,
                "host_us_per_param": 1e6 * statistics.median(host[args.warmup:]) / len(params),
                "gen_peak_extra_mib": peak / 2**20}))
        del train, gen, transfers, experts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    destroy_refit_group(group)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=list(SLICES))
    ap.add_argument("--batch-mib", type=float, default=512, help="cut the refit into batches "
                    "of this size, as the refit loop does (its default batch_bytes: 512 MiB); "
                    "0: one batch")
    ap.add_argument("--orders", default="", help="expert storage orders to refit into as "
                    "well, same run: a file of scripts/bench_kernel_order.py learn (the real "
                    "shapes), or 'synthetic' (FlashInfer-like orders for any shape)")
    ap.add_argument("--permuted-tile-kib", type=int, default=0, help="experiment: the "
                    "permuted-row kernel's bytes per program (0: its default)")
    ap.add_argument("--permuted-rows", type=int, default=0, help="experiment: the "
                    "permuted-row kernel's rows per tile (0: its default)")
    ap.add_argument("--order-backends", nargs="+",
                    default=["checkpoint", "flashinfer_trtllm", "flashinfer_cutlass"])
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-align", action="store_true", help="time each refit from the "
                    "generation rank's call without a start barrier (each rank starts when "
                    "its last iteration is done)")
    ap.add_argument("--timeline", action="store_true", help="print where each rank's refit time goes")
    ap.add_argument("--train-nap-s", type=float, default=0.0, help="experiment: the training "
                    "rank's barrier waits nap (up to this long) from the start instead of spinning")
    ap.add_argument("--trace", default="", help="folder for torch.profiler traces of the "
                    "generation rank's copies, in a refit and alone (summaries printed)")
    ap.add_argument("--profile", default="", help="folder for a cProfile of each rank's refits")
    args = ap.parse_args(argv)
    if not args.orders:
        args.order_backends = ["checkpoint"]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args, args.port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = []  # read while they run: a child exits only once its puts reached the pipe
    while any(p.is_alive() for p in procs) or not results.empty():
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            pass
    for p in procs:
        p.join()
    merged: dict = {}
    for rank, name, label, row in got:
        merged.setdefault((name, label), {"case": name, "path": label}).update(row)
    table = list(merged.values())
    for row in table:
        marks = [row.pop(f"marks{r}", None) for r in (0, 1)]
        if all(marks):
            print(f"timeline {row['case']} {row['path']} (ms from the generation rank's start "
                  f"of the call, median entry-exit):")
            for what, a, b in _timelines(marks):
                print(f"  {what:24s} {a:8.3f} {b:8.3f}")
    env = {"torch": torch.__version__, "device": args.device,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    print(json.dumps({"env": env, "rows": table}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": table}, f, indent=1)
    ok = all(p.exitcode == 0 for p in procs) and len(table) > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
