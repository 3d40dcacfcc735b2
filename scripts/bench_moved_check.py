"""What the per-refit "did the model's params move?" check costs (issue 50, item 1).

Every refit starts with ``megatron.live_views.BoundTensors.check()``: the model's tensors
read again by name and compared with those the sender's views were cut from. This script
builds a real megatron-core MoE model with many params (one process, gloo, TP1; experts
as one param per expert and projection) and times, in the same run:

- ``check()`` when nothing moved (every refit pays it): µs per refit and per param;
- after ``param.data = clone`` of every param: ``check()`` plus the re-cut of the views
  (``rebound`` + ``source.local_param_map``), what a refit after an offload/onload pays;
- the baseline: one copy of the rank's weights (``clone`` of every param), the least a
  refit that reads them all does; the ratio check / baseline.

    python scripts/bench_moved_check.py                # 24 layers x 64 experts
    python scripts/bench_moved_check.py --layers 4 --experts 8 --repeat 5   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from megatron_reshard.tools.bench.timing import median_timer


def _median_s(fn, repeat: int) -> float:
    return median_timer(torch.device("cpu"))(fn, repeat, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_reshard.megatron.live_views import BoundTensors
    from megatron_reshard.megatron.source import local_param_map
    from megatron_reshard.testing.moves import move_params_
    from megatron_reshard.tools.tiny_source import tiny_source
    from megatron_reshard.tools.worlds import free_ports

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}",
                            rank=0, world_size=1)
    model, source, _, _ = tiny_source("moe", 1, seed=0, num_layers=args.layers,
                                      num_moe_experts=args.experts)
    bound = BoundTensors(source.plan)
    params = len(source.plan.local.converted)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    local_param_map(source.plan)  # warm

    steady = _median_s(lambda: bound.check(), args.repeat)

    def moved_and_recut():
        move_params_(model, "data", 0)
        t0 = time.perf_counter()
        found = bound.check()
        assert found is not None and len(found.moved) == params and not found.refusals
        rebound = bound.rebound()
        local_param_map(rebound[0])
        bound.accept(rebound)
        return time.perf_counter() - t0

    recut = statistics.median(moved_and_recut() for _ in range(args.repeat))
    baseline = _median_s(lambda: [p.detach().clone() for p in model.parameters()], args.repeat)
    print(f"model: {args.layers} layers x {args.experts} experts, {params} params, "
          f"{nbytes / 2**20:.1f} MiB (bf16) on this rank")
    print(f"check, nothing moved:        {steady * 1e3:8.3f} ms per refit = "
          f"{steady / params * 1e6:.3f} us per param")
    print(f"check + re-cut, all moved:   {recut * 1e3:8.3f} ms per refit = "
          f"{recut / params * 1e6:.3f} us per param")
    print(f"baseline, one copy of the weights (same run): {baseline * 1e3:8.3f} ms")
    print(f"ratio check / baseline: {steady / baseline:.4f}; "
          f"re-cut / baseline: {recut / baseline:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
