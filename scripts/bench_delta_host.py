"""The host's Python time per region of a batch's cut and apply, launches left out (CPU).

    python scripts/bench_delta_host.py [--regions 16,256] [--elements 65536]

Runs ``delta.kernels.cut_many``, ``delta.encoding.encode_many`` and
``delta.encoding.apply_many`` on CPU tensors with every Triton launch replaced by a
no-op: what is left is the host's own work per region (tables, allocations, views, the
``Cut`` objects, the encoding's choice, the apply's rows and checks), the part that the
launches do not explain. The totals a cut would read are set to 1% of each region changed
(a GAPS + DIFF8 payload, written before the read), and the apply's checks pass: the
figures are of the host's path, not of any result. Each Triton launch then adds its own
host cost (~16-90 µs on the GPU machines' hosts, MEASUREMENTS) once per batch.
Compare figures of one machine: this counts Python and torch's CPU allocator.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_reshard.delta import encoding, kernel_apply
from megatron_reshard.delta import kernels as delta_kernels
from megatron_reshard.delta.wire_format import DIFF8, GAPS


class _NoLaunch:
    def __getattr__(self, name):
        return self

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _per_region_us(fn, regions: int, iters: int) -> float:
    fn()
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(walls) / regions


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regions", default="16,256")
    ap.add_argument("--elements", type=int, default=1 << 16, help="bf16 elements a region")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # (two threads on a busy 2-core host: ms-long stalls in ops)
    delta_kernels._kernels = lambda: _NoLaunch()
    for module in (delta_kernels, kernel_apply):  # the apply's host side imports them by name
        module._step_type = module._tl_type = lambda item: None
    delta_kernels.usable = lambda t: True  # CPU tensors take the kernels' path
    kernel_apply._gaps_check = lambda *a: (lambda figures: None)
    count = max(1, args.elements // 100)
    finish = delta_kernels.Cut.finish
    delta_kernels.Cut.finish = lambda cut, totals: finish(
        cut, [count, 0, count, 0, GAPS | DIFF8, 2 * count])
    for k in (int(x) for x in args.regions.split(",")):
        new = torch.zeros(k * args.elements, dtype=torch.bfloat16)
        pairs = list(zip(new.chunk(k), torch.zeros_like(new).chunk(k)))
        items = [(view, count, GAPS | DIFF8,
                  torch.ones(2 * count, dtype=torch.uint8)) for view in new.chunk(k)]
        bits = [(a.view(torch.int16), b.view(torch.int16)) for a, b in pairs]  # as encode_many's
        figures = {
            "cut_many": _per_region_us(lambda: delta_kernels.cut_many(bits, [4] * k), k,
                                       args.iters),
            "encode_many": _per_region_us(lambda: encoding.encode_many(pairs), k,
                                          args.iters),
            "apply_many": _per_region_us(lambda: encoding.apply_many(items), k,
                                         args.iters)}
        print(f"K={k:5d} regions of {args.elements} elements, µs a region (host, no launches): "
              + ", ".join(f"{name} {us:.1f}" for name, us in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
