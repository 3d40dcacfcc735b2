"""Time plan construction for 10,000 parameters on one CPU core (no process group needed).

Wall and process CPU time are printed: on a loaded machine the CPU figure is the one that
means "on one core". Prints: cold planning with 10,000 distinct layouts (worst case: no cache hit), cold
planning of a model-like list (few distinct shapes, cache hits), the cached replan (plans
looked up again from validated layout keys), the batch schedule of one rank, and the warm
lookup a repeated ``xfer_batch`` call pays instead of all that (its light batch key and the
per-batch cache hit).

Then the planner at cluster scale (issue 16): DeepSeek-V3 under NeMo-RL's published layout,
training PP16 x EP16 (256 ranks) -> generation TP32 x DP8 (256 ranks), every parameter
planned (``--others sharded``): building the layouts from the model, one rank's own plan
(a generation rank: it takes part in every stage's group) with a cold planner, and the
whole-job simulation, for the default and the link-aware planner. Nothing here is a test
threshold; the figures are printed for docs/SCALE.md.

Usage: python scripts/bench_plan.py [--params N] [--scale-only | --no-scale]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.engine import Transfer
from megatron_reshard.engine.batch import light_key
from megatron_reshard.engine.plan import Planner, gc_paused, layout_key
from megatron_reshard.engine.schedule import build_schedule
from megatron_reshard.layout.placements import MeshInfo


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
    parser.add_argument("--scale-only", action="store_true", help="only the cluster-scale part")
    parser.add_argument("--no-scale", action="store_true", help="skip the cluster-scale part")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.scale_only:
        engine_batches(args)
    if not args.no_scale:
        cluster_scale()


def cluster_scale() -> None:
    """DeepSeek-V3 PP16 x EP16 -> TP32 x DP8: the planner's own cost at 256 + 256 ranks."""
    from megatron_reshard.tools.plan_inputs import RefitParallelism, stage_inputs
    from megatron_reshard.tools.presets import model_config
    from megatron_reshard.tools.simulate import LinkModel, link_costs, simulate

    cfg = model_config("deepseek-v3")
    lay = RefitParallelism(train_world=256, gen_world=256, train_tp=1, train_ep=16, train_pp=16,
                      pp_layers=(4,) * 15 + (1,), gen_tp=32, gen_ep=32)
    link = LinkModel()
    print(f"\ndeepseek-v3, {lay.describe()}, all params through the engine")
    t0, c0 = time.perf_counter(), time.process_time()
    stages = stage_inputs(lay, cfg, "sharded")
    t1, c1 = time.perf_counter(), time.process_time()
    print(f"layouts of {sum(len(s.params) for s in stages.values())} params: "
          f"{t1 - t0:.3f} s (CPU {c1 - c0:.3f} s)")
    mine = lay.stage_world  # group rank of generation rank 0
    for name, costs in (("default", None), ("link-aware", link_costs(lay, link, stages))):
        planner = Planner(costs)
        t0, c0 = time.perf_counter(), time.process_time()
        with gc_paused():
            n_ops = sum(len(planner.plan(p.key).ops_of(mine))
                        for st in stages.values() for p in st.params)
        t1, c1 = time.perf_counter(), time.process_time()
        print(f"{name} planner: one rank's own plan {t1 - t0:.3f} s (CPU {c1 - c0:.3f} s), "
              f"{len(planner)} distinct layouts, {n_ops} ops of that rank")
        t0, c0 = time.perf_counter(), time.process_time()
        sim = simulate("deepseek-v3", cfg, lay, link, "sharded", costs is not None)
        t1, c1 = time.perf_counter(), time.process_time()
        est = sim.to_plain()["estimate_s"]
        print(f"{name} planner: whole-job simulation {t1 - t0:.2f} s (CPU {c1 - c0:.2f} s), "
              f"{sim.ops} messages; refit estimate {est['refit']:.3f} s "
              f"({est['limited_by']})")


def engine_batches(args: argparse.Namespace) -> None:
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
        key = (4, 256 << 20, light_key(transfers, 6))
        planner.remember_batch(0, key, sched)
        t4 = time.perf_counter()
        with gc_paused():  # as xfer_batch runs it
            hit = planner.batch(0, (4, 256 << 20, light_key(transfers, 6)))
        t5 = time.perf_counter()
        assert hit is sched
        kind = "distinct layouts" if distinct else "model-like (repeated shapes)"
        print(f"{args.params} params, {kind}: {len(planner)} plans built in {t1 - t0:.3f} s "
              f"(CPU {c1 - c0:.3f} s); "
              f"cached replan {t2 - t1:.3f} s; schedule for rank 4 ({len(sched.rounds)} rounds) "
              f"{t3 - t2:.3f} s; warm batch lookup {1e3 * (t5 - t4):.1f} ms")


if __name__ == "__main__":
    main()
