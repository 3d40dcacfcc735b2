"""The host's Python time per region of a batch's cut, launches left out (CPU).

    python scripts/bench_delta_host.py [--regions 16,256] [--elements 65536]

Runs ``delta_kernels.cut_many`` on CPU tensors with every Triton launch replaced by a
no-op: what is left is the host's own work per region (tables, allocations, views, the
``Cut`` objects), the part that the launches do not explain. Each Triton launch then
adds its own host cost (~16-25 µs on an H100's host, MEASUREMENTS) once per batch.
Compare figures of one machine: this counts Python and torch's CPU allocator.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_reshard.refit import delta_kernels


class _NoLaunch:
    def __getattr__(self, name):
        return self

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regions", default="16,256")
    ap.add_argument("--elements", type=int, default=1 << 16, help="bf16 elements a region")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # (two threads on a busy 2-core host: ms-long stalls in ops)
    delta_kernels._kernels = lambda: _NoLaunch()
    delta_kernels._step_type = lambda item: None
    for k in (int(x) for x in args.regions.split(",")):
        new = torch.zeros(k * args.elements, dtype=torch.int16)
        pairs = list(zip(new.chunk(k), torch.zeros_like(new).chunk(k)))
        walls = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            delta_kernels.cut_many(pairs, [4] * k)
            walls.append(time.perf_counter() - t0)
        print(f"K={k:5d} regions of {args.elements} elements: cut_many "
              f"{1e6 * statistics.median(walls) / k:7.1f} µs a region (host, no launches)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
