"""Which reduction ``check_finite`` should run before the vote (torch only, any device).

A rank's weights as many tensors (default: 3,243 bf16 tensors of 64 x 48, the shape count
of ``bench_receiver_trust.py``'s MoE model; ``--rows`` / ``--cols`` / ``--count`` change
it). Timed in the same run, each ending in one host sync:

- one copy of the weights (``clone`` of each): the baseline;
- ``torch._foreach_norm(batch, inf)`` per batch of 256 (a fused multi-tensor kernel on
  CUDA; NaN and Inf propagate through a max);
- ``t.sum(dtype=float64)`` per tensor (NaN and Inf propagate; finite bf16/fp32 values
  cannot overflow a float64 sum);
- ``torch.isfinite(t).all()`` per tensor.

    python scripts/bench_finite_kernels.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_s(fn, repeat: int, device: torch.device) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--count", type=int, default=3243)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    device = torch.device(args.device)
    ts = [torch.randn(args.rows, args.cols, dtype=torch.bfloat16, device=device)
          for _ in range(args.count)]
    batch = 256

    def foreach_inf():
        flags = [torch.isfinite(torch.stack(torch._foreach_norm(ts[i:i + batch], float("inf"))))
                 for i in range(0, len(ts), batch)]
        return torch.cat(flags).all().item()

    cases = {
        "one copy (baseline)": lambda: [t.clone() for t in ts] and torch.zeros(1, device=device).item(),
        "foreach_norm inf per 256": foreach_inf,
        "sum float64 per tensor": lambda: torch.isfinite(torch.stack(
            [t.sum(dtype=torch.float64) for t in ts])).all().item(),
        "isfinite().all() per tensor": lambda: torch.stack(
            [torch.isfinite(t).all() for t in ts]).all().item(),
    }
    for fn in cases.values():  # warm
        fn()
    times = {name: _median_s(fn, args.repeat, device) for name, fn in cases.items()}
    base = times["one copy (baseline)"]
    mib = args.count * args.rows * args.cols * 2 / 2**20
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.count} bf16 tensors of {args.rows} x {args.cols} ({mib:.1f} MiB) on {name}, "
          f"torch {torch.__version__}")
    for what, s in times.items():
        print(f"  {what:<30} {s * 1e3:9.3f} ms  {s / args.count * 1e6:7.3f} us per tensor  "
              f"/ one copy {s / base:6.3f}")


if __name__ == "__main__":
    main()
