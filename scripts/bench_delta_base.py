"""What proving a delta's base costs, two ways, on CPU (issue 50, item 2; docs/DESIGN.md
"Delta base verification").

For one generation rank's share of the weights (bf16 tensors of the given total size):

- base digests (``refit.base_digest``, what the library does): the generation rank
  digests the storage a delta writes into twice per refit (the check before the vote, the
  new base after the commit); the training side does nothing;
- checksums forced on in delta mode (``refit.integrity.box_checksum``, the end-to-end
  checksums): the training side checksums what it sends and the generation side what it
  received, one pass each (the table's all-reduce left out), and a write behind the refit's
  back is only found after the delta landed (a failed refit, not a full one);
- baseline: one copy of the same bytes (same run).

Wall time and this process's CPU time (both threads) are printed: under load the CPU time is
the steadier of the two.

    python scripts/bench_delta_base.py            # 256 MiB in 64 tensors
    python scripts/bench_delta_base.py --mib 8 --repeat 3   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_reshard.refit.base_digest import digests
from megatron_reshard.refit.integrity import box_checksum


def _median_s(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = max(1, int(args.mib * 2**20 / 2 / 1024 / args.tensors))
    tensors = [torch.randn(rows, 1024).to(torch.bfloat16) for _ in range(args.tensors)]
    nbytes = sum(t.numel() * 2 for t in tensors)

    def checksums():
        return [box_checksum(t, ((0, t.shape[0]), (0, t.shape[1])), (0, 0)) for t in tensors]

    # CPU time of this process too: on a shared host the wall clock mostly measures the
    # neighbours (the figures to compare under load)
    cpu = {name: _median_s(fn, args.repeat, time.process_time) for name, fn in (
        ("digest", lambda: digests(tensors).tolist()),
        ("checksum", lambda: torch.stack(checksums()).tolist()),
        ("copy", lambda: [t.clone() for t in tensors]))}
    one_digest = _median_s(lambda: digests(tensors).tolist(), args.repeat)
    one_checksum = _median_s(lambda: torch.stack(checksums()).tolist(), args.repeat)
    copy = _median_s(lambda: [t.clone() for t in tensors], args.repeat)
    digest_way, checksum_way = 2 * one_digest, 2 * one_checksum
    print(f"{nbytes / 2**20:.0f} MiB bf16 in {len(tensors)} tensors, torch threads "
          f"{torch.get_num_threads()}")
    print(f"one digest pass:   {one_digest * 1e3:9.1f} ms ({nbytes / one_digest / 1e9:.2f} GB/s)")
    print(f"one checksum pass: {one_checksum * 1e3:9.1f} ms ({nbytes / one_checksum / 1e9:.2f} GB/s)")
    print(f"baseline copy:     {copy * 1e3:9.1f} ms ({nbytes / copy / 1e9:.2f} GB/s)")
    print(f"per delta refit: base digests (2 passes, generation side) {digest_way * 1e3:.1f} ms "
          f"= {digest_way / copy:.2f} copies; forced checksums (1 pass each side) "
          f"{checksum_way * 1e3:.1f} ms = {checksum_way / copy:.2f} copies; "
          f"checksums / digests = {checksum_way / digest_way:.2f}")
    print(f"CPU time of one pass (this process): digest {cpu['digest'] * 1e3:.1f} ms, checksum "
          f"{cpu['checksum'] * 1e3:.1f} ms, copy {cpu['copy'] * 1e3:.1f} ms; checksum / digest "
          f"{cpu['checksum'] / cpu['digest']:.2f}")


if __name__ == "__main__":
    main()
