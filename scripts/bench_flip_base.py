"""What the base check of a staged delta flip costs against a copy of the same bytes (issue
53; docs/DESIGN.md "Staged refits", the delta flip's base check).

One generation rank's share of a dense model (bf16, Llama-shaped linear layers: a fused
qkv and gate_up of two and two records, o and down of one), live params and their staging
tensors. Timed, median of ``--repeat`` after one warm-up, each ending in a device sync:

- ``check``: ``receiver.flip_base.check_flip_base`` over every param, nothing changed (what
  the apply flip of a delta refit runs first: one digest pass over the live bytes, one host
  read);
- ``copy``: the copy flip, ``torch._foreach_copy_`` staging into live (what
  ``staged_delta_flip="copy"`` and a full refit's flip run);
- ``memcpy``: one ``copy_`` of a buffer of the same bytes.

    python scripts/bench_flip_base.py                       # CPU, 2 layers of 4096
    python scripts/bench_flip_base.py --device cuda --layers 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_reshard.delta.base_digest import take_base
from megatron_reshard.receiver.flip_base import check_flip_base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeat: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(layers: int, hidden: int, ffn: int, device: torch.device):
    """(live, staging, held): the params by name, their staging copies, and the records a
    delta session holds in place, as views of the staging tensors."""
    shapes = {"qkv": (hidden * 3 // 2, hidden), "o": (hidden, hidden),
              "gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}
    live = {f"layers.{i}.{n}": torch.randn(s, device=device).to(torch.bfloat16)
            for i in range(layers) for n, s in shapes.items()}
    staging = {n: t.clone() for n, t in live.items()}
    held = []
    for i in range(layers):
        qkv, gate_up = staging[f"layers.{i}.qkv"], staging[f"layers.{i}.gate_up"]
        held += [(f"{i}.q", qkv[:hidden]), (f"{i}.kv", qkv[hidden:]),
                 (f"{i}.gate", gate_up[:ffn]), (f"{i}.up", gate_up[ffn:]),
                 (f"{i}.o", staging[f"layers.{i}.o"]), (f"{i}.down", staging[f"layers.{i}.down"])]
    return live, staging, held


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    live, staging, held = build(args.layers, args.hidden, args.ffn, device)
    base = take_base(held)
    names = list(live)
    found = check_flip_base(base, held, staging, live, names)
    assert found.changed == [] and found.checked == len(names), found  # nothing written
    nbytes = sum(t.numel() * t.element_size() for t in live.values())
    dst, src = list(live.values()), list(staging.values())
    check = _median_s(lambda: check_flip_base(base, held, staging, live, names), device,
                      args.repeat)
    copy = _median_s(lambda: torch._foreach_copy_(dst, src), device, args.repeat)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    memcpy = _median_s(lambda: b.copy_(a), device, args.repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: {len(names)} params, {len(held)} records, "
          f"{nbytes / 1e9:.3f} GB bf16")
    print(f"check  {check * 1e3:9.2f} ms  {nbytes / check / 1e9:7.1f} GB/s read")
    print(f"copy   {copy * 1e3:9.2f} ms  (foreach copy: the copy flip)")
    print(f"memcpy {memcpy * 1e3:9.2f} ms  (one buffer of the same bytes)")
    print(f"check / copy = {check / copy:.2f}, check / memcpy = {check / memcpy:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
