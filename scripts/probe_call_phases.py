"""Where a per-call ``xfer_batch`` spends its time, phase by phase (a diagnostic, GPU or CPU).

    torchrun --nproc-per-node 2 scripts/probe_call_phases.py [--cases s0_s1 ...] [--iters 20]

For each case of the transfer benchmark (1 → 1, sources on rank 0), every iteration starts
after a barrier and a device sync; the call's phases are timed on the host by wrapping the
engine's own steps (describe, local checks, agreement, execution), and the whole call
until the device is done. The same is done with ``agree=False`` (the refit loop's path).
Prints the slowest rank's median per phase, in µs, and then, on rank 0, a profile of one
per-call iteration (the host calls that took the time). Nothing here changes the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.engine import Planner, Transfer, xfer_batch
from megatron_reshard.engine import execute as ex
from megatron_reshard.layout.geometry import rank_box
from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.tools.bench.patterns import pattern_values
from megatron_reshard.tools.bench.timing import synchronize
from megatron_reshard.tools.bench.transfer_cases import build_cases
from megatron_reshard.tools.launch_env import apply_nccl_defaults

PHASES = ("_describe", "local_ok", "start", "conclude", "_execute")
_spent: dict = defaultdict(float)


def _wrap(name: str) -> None:
    owner = ex.agreement if name in ("start", "conclude") else ex
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[name] += time.perf_counter() - t0

    setattr(owner, name, timed)


def _transfers(case, device, me, world):
    src_ranks = list(range(world)) if case.src_on == "all" else list(range(world // 2))
    dst_ranks = list(range(world)) if case.dst_on == "all" else list(range(world // 2, world))
    sm, dm = MeshInfo(torch.tensor(src_ranks)), MeshInfo(torch.tensor(dst_ranks))
    out = []
    for i, p in enumerate(case.params):
        sbox, dbox = rank_box(p.global_shape, sm, p.src, me), rank_box(p.global_shape, dm, p.dst, me)
        src = pattern_values(p.global_shape, sbox, p.dtype, device, i) if sbox else None
        dst = torch.empty([hi - lo for lo, hi in dbox], dtype=p.dtype, device=device) if dbox else None
        out.append(Transfer(p.name, p.global_shape, p.dtype, sm, list(p.src), dm, list(p.dst),
                            src, dst))
    return out


def _measure(call, device, iters: int) -> dict:
    rows = defaultdict(list)
    for _ in range(iters):
        dist.barrier()
        synchronize(device)
        _spent.clear()
        t0 = time.perf_counter()
        call()
        host = time.perf_counter() - t0
        synchronize(device)
        total = time.perf_counter() - t0
        rows["host_return"].append(host)
        rows["total"].append(total)
        for name in PHASES:
            rows[name].append(_spent.get(name, 0.0))
    med = {k: statistics.median(v) for k, v in rows.items()}
    keys = sorted(med)
    t = torch.tensor([med[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["s0_s1", "colocated", "experts_s0_s2",
                                                     "s0_dp2", "dense_s0_s0", "small_200"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--profile", default="s0_s1")
    args = ap.parse_args()
    apply_nccl_defaults(os.environ)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    me, world = dist.get_rank(), dist.get_world_size()
    for name in PHASES:
        _wrap(name)
    cases = [c for c in build_cases(args.small, world) if any(c.name.startswith(n) for n in args.cases)]
    for case in cases:
        ts = _transfers(case, device, me, world)
        planner = Planner()
        for _ in range(3):
            xfer_batch(ts, None, planner=planner)
        synchronize(device)
        per_call = _measure(lambda: xfer_batch(ts, None, planner=planner), device, args.iters)
        agreed = _measure(lambda: xfer_batch(ts, None, planner=planner, agree=False), device,
                          args.iters)
        if me == 0:
            print(f"\n[{case.name}] {case.layout}: slowest rank's median, µs")
            print(f"  {'phase':<12} {'per call':>10} {'agreed':>10}")
            for k in ("total", "host_return", *PHASES):
                print(f"  {k:<12} {1e6 * per_call[k]:>10.1f} {1e6 * agreed[k]:>10.1f}")
        if case.name.startswith(args.profile) and cuda:
            from torch.profiler import ProfilerActivity, profile

            dist.barrier()
            synchronize(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    xfer_batch(ts, None, planner=planner)
                    synchronize(device)
            if me == 0:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                max_name_column_width=48))
        del ts
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
