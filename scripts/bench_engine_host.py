"""Host-side cost of the engine's ``xfer_batch`` for many small params (CPU, 2-rank gloo).

    .venv/bin/python scripts/bench_engine_host.py [--params 1000] [--iters 20] [--profile]
        [--cases members_local members_unpack --members 128 --skip-vote] [--ranks 1]

Small tensors make the byte movement negligible, so the time per call is the engine's
Python overhead: validation, planning, agreement, scheduling, views, packing. Cases:

- ``rr_cross``: [4096] bf16 Replicate on rank 0 -> Replicate on rank 1 (one message each);
- ``s0_s1``:    [64,64] bf16 Shard(0) on ranks [0,1] -> Shard(1) on [0,1] (a local copy
  and a strided, staged exchange per param);
- ``mixed``:    alternating the two above plus Replicate -> Shard(0) fp32 [256,16].
- ``members_local``:  one param per call, a rank's ``--members`` experts [4,8] bf16 given as
  a list, Shard(0) on [0,1] -> Shard(0) on [0,1] (one local copy per member);
- ``members_unpack``: one param per call, [E,4,8] bf16 Replicate on rank 0 -> Replicate on
  rank 1 given as a list of E members (one message, unpacked per member).
  These two print µs per call, not per param.

Per case: the first call with a fresh Planner (cold: plans + schedule built), then the
median of ``--iters`` calls reusing that Planner (warm; what the refit loop does), and the
median without a planner (every call plans from scratch). Each call is barrier-aligned;
wall time and main-thread CPU time are each the slowest rank's. ``--profile`` prints the
cProfile (CPU time) of one rank's warm calls (``--profile-rank``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def _transfers(case: str, n: int, rank: int, world: int = 2) -> list:
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Transfer
    from megatron_reshard.layout.placements import MeshInfo

    one0, one1 = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    both = MeshInfo(torch.tensor([0, 1]))
    # placements as a refit loop passes them: the same tuples on every call
    rep, s0, s1 = (Replicate(),), (Shard(0),), (Shard(1),)
    if case.startswith("members"):
        return [_members_transfer(case, n, rank, one0, one1, both, world)]
    kinds = {"rr_cross": ["rr"], "s0_s1": ["s01"], "mixed": ["rr", "s01", "rs"]}[case]
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "rr":
            shape, dtype = (4096,), torch.bfloat16
            sm, sp, dm, dp = one0, rep, one1, rep
            src = torch.randn(shape).to(dtype) if rank == 0 else None
            dst = torch.empty(shape, dtype=dtype) if rank == 1 else None
        elif kind == "s01":
            shape, dtype = (64, 64), torch.bfloat16
            sm, sp, dm, dp = both, s0, both, s1
            src = torch.randn(32, 64).to(dtype)
            dst = torch.empty(64, 32, dtype=dtype)
        else:
            shape, dtype = (256, 16), torch.float32
            sm, sp, dm, dp = one0, rep, both, s0
            src = torch.randn(shape) if rank == 0 else None
            dst = torch.empty(128, 16)
        out.append(Transfer(f"p{i}.{kind}", shape, dtype, sm, sp, dm, dp, src, dst))
    return out


def _members_transfer(case: str, e: int, rank: int, one0, one1, both, world: int):
    """One param of ``e`` experts [4, 8] bf16 per rank, a list of members on one side
    (``--ranks 1``: members_local on rank 0 alone, as bench_engine_1gpu's list case)."""
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.engine import Transfer

    bf16 = torch.bfloat16
    members = [torch.randn(4, 8).to(bf16) for _ in range(e)]
    if world == 1:
        return Transfer("experts", (e, 4, 8), bf16, one0, (Shard(0),), one0, (Replicate(),),
                        members, torch.empty(e, 4, 8, dtype=bf16))
    if case == "members_local":
        return Transfer("experts", (2 * e, 4, 8), bf16, both, (Shard(0),), both, (Shard(0),),
                        members, torch.empty(e, 4, 8, dtype=bf16))
    return Transfer("experts", (e, 4, 8), bf16, one0, (Replicate(),), one1, (Replicate(),),
                    torch.randn(e, 4, 8).to(bf16) if rank == 0 else None,
                    members if rank == 1 else None)


def _timed(fn, group) -> tuple[float, float]:
    """(wall seconds, main-thread CPU seconds) of one barrier-aligned call, each the max
    over ranks. CPU time is the host overhead proper: it leaves out waiting for the peer
    and gloo's own threads, so it is steadier than wall time on a busy 2-core machine."""
    dist.barrier(group)
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt[0]), float(dt[1])


def _median(samples) -> tuple[float, float]:
    return (statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples))


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_reshard.engine import Planner, xfer_batch

    group = dist.group.WORLD
    rows = []
    for case in args.cases:
        xfer_batch(_transfers(case, 1, rank, world), group)  # warm torch/gloo, not the caches
        per_call = case.startswith("members")  # one param of --members experts
        ts = _transfers(case, args.members if per_call else args.params, rank, world)
        # A full GC pass (~100 ms with these tensors alive) otherwise lands in a random call.
        gc.collect()
        planner = Planner()
        cold = _timed(lambda: xfer_batch(ts, group, planner=planner), group)
        prof = cProfile.Profile(time.thread_time) if (args.profile and rank == args.profile_rank) else None
        warm = []
        for _ in range(args.iters):
            if prof is not None:
                prof.enable()
            warm.append(_timed(lambda: xfer_batch(ts, group, planner=planner,
                                                  agree=not args.skip_vote), group))
            if prof is not None:
                prof.disable()
        fresh = [_timed(lambda: xfer_batch(ts, group), group)
                 for _ in range(max(1, args.iters // 4))]
        us = 1e6 / (1 if per_call else args.params)
        rows.append((case, *(x * us for x in (*cold, *_median(warm), *_median(fresh)))))
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(os.environ.get("PSORT", "tottime")).print_stats(args.top)
            print(f"---- cProfile, rank {rank}, warm calls of {case} ----\n{s.getvalue()}",
                  flush=True)
    if rank == 0:
        print(f"{args.params} params per xfer_batch, {world}-rank gloo, µs per param; members_*: "
              f"µs per call of one param of {args.members} experts (warm: median of "
              f"{args.iters})")
        print(f"{'':<15} {'---------- wall ----------':>32} {'---- main-thread CPU -----':>32}")
        print(f"{'case':<15}" + f"{'cold':>10} {'warm':>10} {'no planner':>10}  " * 2)
        for case, cw, cc, ww, wc, fw, fc in rows:
            print(f"{case:<15}{cw:>10.1f} {ww:>10.1f} {fw:>10.1f}  {cc:>10.1f} {wc:>10.1f} "
                  f"{fc:>10.1f}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", nargs="+", default=["rr_cross", "s0_s1", "mixed"],
                    help="also: members_local members_unpack")
    ap.add_argument("--skip-vote", action="store_true",
                    help="warm calls with agree=False (the refit loop's repeated calls)")
    ap.add_argument("--ranks", type=int, default=2, choices=(1, 2))
    ap.add_argument("--members", type=int, default=128, help="experts per members_* call")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-rank", type=int, default=0, choices=(0, 1))
    ap.add_argument("--top", type=int, default=25, help="profile rows to print")
    args = ap.parse_args(argv)
    from megatron_reshard.tools.worlds import free_ports

    if args.ranks == 1 and set(args.cases) != {"members_local"}:
        ap.error("--ranks 1 runs members_local only")
    tmp.spawn(_worker, args=(args.ranks, free_ports(1)[0], args), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
