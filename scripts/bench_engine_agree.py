"""What the agreement step costs a warm ``xfer_batch`` on the host (CPU, 2-rank gloo).

    .venv/bin/python scripts/bench_engine_agree.py [--params 1000] [--iters 30]

Per case of ``bench_engine_host.py`` (same transfers): the median wall and main-thread
CPU time per call of warm calls with a reused Planner, with the agreement step
(``agree=True``, every call) and without it (``agree=False`` on a repeated call, which
the engine then runs without a vote, as the refit loop's from its second run on), each
the slowest rank's, in µs per call and per param.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import bench_engine_host as host


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_reshard.engine import Planner, xfer_batch

    group = dist.group.WORLD
    rows = []
    for case in args.cases:
        ts = host._transfers(case, args.params, rank)
        planner = Planner()
        xfer_batch(ts, group, planner=planner)  # cold: plans, schedule, programs
        gc.collect()
        out = []
        for agree in (True, False):
            samples = [host._timed(lambda: xfer_batch(ts, group, planner=planner, agree=agree),
                                   group) for _ in range(args.iters)]
            out.append(tuple(statistics.median(s[i] for s in samples) for i in (0, 1)))
        rows.append((case, out))
    if rank == 0:
        print(f"{args.params} params per warm xfer_batch, 2-rank gloo, median of {args.iters}")
        print(f"{'case':<10}{'agree':>6} {'wall µs/call':>13} {'CPU µs/call':>12} "
              f"{'wall µs/param':>14} {'CPU µs/param':>13}")
        for case, out in rows:
            for agree, (wall, cpu) in zip((True, False), out):
                print(f"{case:<10}{str(agree):>6} {wall * 1e6:>13.0f} {cpu * 1e6:>12.0f} "
                      f"{wall * 1e6 / args.params:>14.2f} {cpu * 1e6 / args.params:>13.2f}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cases", nargs="+", default=["rr_cross", "s0_s1", "mixed"])
    args = ap.parse_args(argv)
    from megatron_reshard.tools.worlds import free_ports

    tmp.spawn(_worker, args=(2, free_ports(1)[0], args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
