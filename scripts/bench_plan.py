"""Time plan construction for 10,000 parameters on one CPU core (no process group needed).

Wall and process CPU time are printed: on a loaded machine the CPU figure is the one that
means "on one core". Prints: cold planning with 10,000 distinct layouts (worst case: no cache hit), cold
planning of a model-like list (few distinct shapes, cache hits), the cached replan (plans
looked up again from validated layout keys), the batch schedule of one rank, and the warm
lookup a repeated ``xfer_batch`` call pays instead of all that (its light batch key and the
per-batch cache hit). Usage: python scripts/bench_plan.py [--params N]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.engine import Transfer
from megatron_reshard.engine.execute import _light_key, build_schedule
from megatron_reshard.engine.plan import Planner, gc_paused, layout_key
from megatron_reshard.layout import MeshInfo


def _layouts(n: int, distinct: bool):
    """Train TP2 x EP-like meshes on ranks 0-3 -> generation TP2 on ranks 4-5, mixed rules."""
    train = MeshInfo(torch.arange(4).reshape(2, 2))
    gen = MeshInfo(torch.tensor([4, 5]))
    rules = [
        ([Replicate(), Shard(0)], [Shard(0)]),   # column parallel, DP2 replicas on train
        ([Replicate(), Shard(1)], [Shard(1)]),   # row parallel
        ([Shard(0), Shard(1)], [Shard(2)]),       # expert-like 3-D
        ([Replicate(), Replicate()], [Replicate()]),
    ]
    out = []
    for i in range(n):
        src_pl, dst_pl = rules[i % len(rules)]
        grow = i if distinct else i % 7
        shape = (64 + grow, 128 + grow % 13, 32) if len(dst_pl) and dst_pl[0] == Shard(2) \
            else (4096 + grow, 1024 + grow % 5)
        out.append((shape, train, src_pl, gen, dst_pl))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=10_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for distinct in (True, False):
        layouts = _layouts(args.params, distinct)
        planner = Planner()
        t0, c0 = time.perf_counter(), time.process_time()
        plans = planner.plan_all([layout_key(*lay) for lay in layouts])
        t1, c1 = time.perf_counter(), time.process_time()
        again = planner.plan_all([layout_key(*lay) for lay in layouts])
        t2 = time.perf_counter()
        sched = build_schedule(plans, [2] * len(plans), 4, 256 << 20, set())  # contiguous
        t3 = time.perf_counter()
        assert all(a is b for a, b in zip(plans, again))
        transfers = [Transfer(f"p{i}", shape, torch.bfloat16, sm, list(sp), dm, list(dp))
                     for i, (shape, sm, sp, dm, dp) in enumerate(layouts)]
        key = (4, 256 << 20, _light_key(transfers, 6))
        planner.remember_batch(0, key, sched)
        t4 = time.perf_counter()
        with gc_paused():  # as xfer_batch runs it
            hit = planner.batch(0, (4, 256 << 20, _light_key(transfers, 6)))
        t5 = time.perf_counter()
        assert hit is sched
        kind = "distinct layouts" if distinct else "model-like (repeated shapes)"
        print(f"{args.params} params, {kind}: {len(planner)} plans built in {t1 - t0:.3f} s "
              f"(CPU {c1 - c0:.3f} s); "
              f"cached replan {t2 - t1:.3f} s; schedule for rank 4 ({len(sched.rounds)} rounds) "
              f"{t3 - t2:.3f} s; warm batch lookup {1e3 * (t5 - t4):.1f} ms")


if __name__ == "__main__":
    main()
