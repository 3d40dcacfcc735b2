"""Refit benchmark: a whole-model refit against raw P2P and gather+broadcast, same run.

One torchrun launch of 4 processes: ranks 0,1 are the Megatron training world, ranks 2,3
the generation world (gen TP2), joined by a refit group (``megatron_reshard.tools.e2e``, the
same two-world run as the demo and ``scripts/refit_torchrun.py``)::

    torchrun --nproc-per-node 4 -m megatron_reshard.tools.bench.refit_main [--case moe|dense|all] \\
        [--layers 4] [--iters 5] [--out bench_out/refit] [--p2p-channels N]
    torchrun --nproc-per-node 4 -m megatron_reshard.tools.bench.refit_main \\
        --device cpu --backend gloo --small                           # CPU smoke (tiny shapes)
    megatron-reshard bench refit -- [options]                         # the CLI runs this module

Cases (bf16):

- ``moe``: a Qwen3-30B-A3B-proportioned slice: hidden 2048, 32 heads, 4 KV heads, head_dim
  128, 128 experts of FFN 768 (top-8), vocab 151936, ``--layers`` layers; train EP2 (experts
  Shard(0) over the two training ranks, attention replicated) → gen TP2 (experts sharded
  on the intermediate dim).
- ``dense``: a Qwen3-8B-proportioned slice: hidden 4096, 32 heads, 8 KV heads, head_dim 128,
  FFN 12288, vocab 151936; train TP2 → gen TP2.

Per case: the model is built (and initialised) on the device, then filled with a cheap
deterministic pattern keyed by each parameter's global identity (equal on
replicas; see ``fill_fast_``); setup and the first refit run through ``e2e.run_rank``, which
verifies that refit bit for bit against the reference (full HF tensors gathered on the
training side, digests compared on the generation side; ``--no-verify`` skips it: the reference
gathers the full model on each training rank and hashes it on the CPU, heavy for many
layers; verify a big run with the default layer count instead). Then, on the refit
group: ``--warmup`` untimed refits, ``--iters`` timed refits (each barrier-aligned, the
slowest rank's time; median), one refit under peak-memory tracking, the raw P2P figures
with the same bytes per generation GPU (one pair 0→2, and fan-in 0,1→2), and the naive
gather+broadcast refit of the bulk (FFN/expert) params.

Columns: refit ms (whole refit: other-param gather + bulk + packed broadcast of the other
params) and bulk ms (the exact engine path only); bytes into each generation GPU per
refit (max over gen ranks); GB/s per generation GPU for both; raw pair and fan-in GB/s;
refit/raw and bulk/raw against the better of the two raw figures (the link's ceiling);
g+b ms and GB/s (useful bulk bytes per gen GPU / time) and bulk/g+b; peak extra GPU memory
of one refit on the train and gen side (``max_memory_allocated`` after a reset, minus what
was allocated before; NCCL's own buffers are not counted) next to the staging budget.

The gather+broadcast baseline (kept simple, and favourable to itself): per layer and FFN
projection, the training ranks all-gather their shards over the training world (for
experts: the rank's local experts stacked into one tensor once, outside the timed loop),
training rank 0 broadcasts the full tensor over the refit group, and each generation rank
copies its ``torch.chunk`` part along the gen TP dim into a destination buffer (the
gate/up split of fc1 is not modelled: the copied bytes are the same). The vocab matrices,
which the refit also moves on its exact path, go the same way (the gen rank keeps the real
rows of vLLM's padded chunk), and so do attention (q/k/v as one column-parallel matrix:
same bytes), norms and router. Full and
destination buffers are allocated once per shape and reused.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .env_options import add_env_arguments, apply_env
from .refit_model import CASES
from .refit_run import COLUMNS, run_case
from .report import format_table, plot_bandwidth, write_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_refit",
        description=__doc__.split("\n\n")[0] + " Run under torchrun with 4 processes.",
        epilog="See megatron_reshard/tools/bench/refit_main.py for the cases and columns "
               "(the code: refit_model, refit_run, refit_baseline).")
    p.add_argument("--case", choices=["moe", "dense", "all"], default="all")
    p.add_argument("--layers", type=int, default=None,
                   help="transformer layers per case (default 4; 2 with --small)")
    p.add_argument("--iters", type=int, default=None, help="timed refits (default 5; 2 with --small)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed refits after the verified one (default 2; 1 with --small)")
    p.add_argument("--out", default="bench_out/refit", help="output folder (md, json, png)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when available")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke runs)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the bit-exact check of the first refit (heavy for many layers)")
    p.add_argument("--no-baseline", action="store_true", help="skip gather+broadcast")
    p.add_argument("--no-raw", action="store_true", help="skip the raw P2P figures")
    p.add_argument("--staging-mib", type=int, default=256, help="engine staging budget per rank")
    p.add_argument("--gen-precision", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: block-FP8 generation model (linear weights quantized on the "
                        "sending side where shards own whole 128x128 blocks); the row's "
                        "bytes_vs_unquantized compares with the same refit in bf16")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one refit per rank (torch.profiler) into DIR/profile_*.txt")
    p.add_argument("--streams", type=int, default=2, help="CUDA streams for PP stages")
    add_env_arguments(p)
    p.add_argument("--port-base", type=int, default=None,
                   help="first TCP port used (default MASTER_PORT + 200; 1 + 10 per case)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="timeout of every process group and store (default 600; 120 with --small)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    env = apply_env(args)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.iters is None:
        args.iters = 2 if args.small else 5
    if args.warmup is None:
        args.warmup = 1 if args.small else 2
    if args.timeout_s is None:
        args.timeout_s = 120.0 if args.small else 600.0
    if args.iters < 1 or args.warmup < 0:
        print("bench_refit: need --iters >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_refit: --device cuda but no CUDA device; use --device cpu --backend gloo",
              file=sys.stderr)
        return 2
    if args.device == "cpu" and args.backend == "nccl":
        print("bench_refit: nccl needs --device cuda", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("bench_refit: run under torchrun, e.g. torchrun --nproc-per-node 4 -m "
              "megatron_reshard.tools.bench.refit_main", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world not in (2, 4):
        if rank == 0:
            print(f"bench_refit: needs 4 processes (2 train + 2 gen) or 2 (1 + 1), got {world}",
                  file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < 1:
        return 2
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    base = args.port_base or int(os.environ.get("MASTER_PORT", "29500")) + 200
    store = dist.TCPStore(host, base, world, rank == 0, timeout=timedelta(seconds=args.timeout_s))
    cases = ["moe", "dense"] if args.case == "all" else [args.case]
    rows = []
    for i, case in enumerate(cases):
        ports = (base + 1 + 10 * i, base + 2 + 10 * i)
        if rank == 0:
            print(f"bench_refit: case {case} ({CASES[case]['label'].format(n=world // 2)}) on {args.device} "
                  f"({args.backend}), {'small shapes' if args.small else 'full shapes'}", flush=True)
        row = run_case(case, args, rank, ports, store)
        if row is not None:
            rows.append(row)
            print(f"bench_refit: case {case} done in {row['case_s']:.1f}s: {row['check']}",
                  flush=True)
    if rank == 0:
        dev = (torch.cuda.get_device_name(torch.cuda.current_device())
               if args.device == "cuda" else "cpu")
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev,
                "backend": args.backend, "torch": torch.__version__,
                "nccl": (".".join(map(str, torch.cuda.nccl.version()))
                         if args.device == "cuda" else None),
                "ranks": "train 0,1 / gen 2,3 (gen TP2)" if world == 4 else "train 0 / gen 1",
                "iters": args.iters,
                "warmup": args.warmup, "small": args.small, "verify": not args.no_verify,
                "staging_mib": args.staging_mib,
                "raw": "raw = better of pair (0→2) and fan-in (0,1→2), same bytes per gen GPU",
                "env": env, "argv": sys.argv}
        table = format_table(rows, COLUMNS)
        print(table, flush=True)
        for r in rows:
            if r.get("baseline_note"):
                print(f"{r['case']}: baseline: {r['baseline_note']}")
            if r.get("mismatched"):
                print(f"{r['case']}: MISMATCH in {r['mismatched']}")
        paths = write_report(
            args.out, rows, COLUMNS, meta=meta, stem="refit",
            title="Refit benchmark: whole-model refit vs raw P2P vs gather+broadcast",
            plot=lambda rs, path: plot_bandwidth(
                rs, path, title="GB/s into each generation GPU",
                series={"refit_gbps": "refit", "bulk_gbps": "refit (bulk only)",
                        "raw_pair_gbps": "raw P2P (pair)", "raw_fanin_gbps": "raw P2P (fan-in)",
                        "baseline_gbps": "gather+broadcast (bulk)"}))
        print(f"wrote {paths.markdown}, {paths.json}" + (f", {paths.png}" if paths.png else ""),
              flush=True)
        bad = any(r["check"] == "MISMATCH" for r in rows)
        verdict = "fail" if bad else "ok"
    from megatron_reshard.tools.e2e import share_verdict

    verdict = share_verdict(store, rank, world, verdict if rank == 0 else None)
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
