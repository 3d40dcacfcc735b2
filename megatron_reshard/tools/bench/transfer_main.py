"""Transfer benchmark: the engine's ``xfer_batch`` against raw P2P and gather+broadcast.

Run under torchrun; the first half of the ranks are the source (training) side, the second
half the destination (generation) side: 4 GPUs → sources {0,1}, destinations {2,3};
2 GPUs → 0 → 1. Every figure of a row is measured in the same run::

    torchrun --nproc-per-node 4 scripts/bench_transfer.py [--iters 10] [--out bench_out/transfer]
    torchrun --nproc-per-node 4 scripts/bench_transfer.py --device cpu --small   # gloo smoke
    megatron-reshard bench transfer -- [options]          # the CLI runs this module

Layouts (global shapes; ``--small`` shrinks them for CPU smoke runs):

- ``s0_s1``: [16384,16384] bf16 Shard(0) on the sources → Shard(1) on the destinations
  (512 MiB; 256 MiB into each destination with 2+2 ranks).
- ``colocated_s0_s1``: the same tensor, Shard(0) → Shard(1) with every rank on both sides:
  each rank keeps one block locally and exchanges the others (on 2 GPUs, the one case
  where both directions of a link and the local copies run at once).
- ``tp2_tp4``: [8192,8192] bf16 Shard(0) on the sources (TP2) → Shard(0) over *all* ranks
  (TP4). With only two destination GPUs a true TP4 needs the source ranks on the
  destination side too, so this is the colocated refit: each source keeps one chunk
  locally and sends one to a destination rank. Needs 4+ ranks.
- ``dense_s0_s0``: [12288,4096] bf16 Shard(0) → Shard(0) (TP2 → TP2 on disjoint ranks:
  pairs only; the reference's "dense" row).
- ``experts_s0_s1``: [128,768,2048] Shard(0) (EP) → Shard(1) (TP);
  ``experts_s0_s2``: [128,2048,768] Shard(0) → Shard(2).
- ``rep_s0``: [16384,8192] Replicate on the sources → Shard(0) on the destinations.
- ``s0_dp2``: [16384,8192] Shard(0) → Replicate (one full replica per destination).
- ``small_200``: 200 × [4096] bf16 Replicate → Replicate, one ``xfer_batch`` call.
- ``mixed_1000``: 1000 small parameters of mixed shapes/layouts/dtypes (norms, column and
  row shards, transposed shards, biases, experts), one ``xfer_batch`` call.
- ``sweep_<size>``: square bf16 Shard(0) → Shard(1) tensors of the ``--sizes`` given.

Meshes are 1-D: the exchanges above are the ones 2+2 GPUs can make; 2-D meshes are
exercised by the engine's own tests.

Per row: bytes into each destination rank; engine time (median of ``--iters`` after
``--warmup``, each iteration barrier-aligned and timed on the slowest rank), the first
(cold, planning) call, GB/s per destination; raw NCCL P2P GB/s with the same bytes per
destination — one pair, fan-in of all sources into one destination, and all sources to
all destinations in one batch; engine/raw (against one pair: the per-GPU ceiling); the
same engine call with ``agree=False`` ("agreed once": the call repeats, so the engine
skips the agreement all-reduce and its host sync, as for every call its group's history
predicts; what the refit loop runs from its second refit on) and its ratio;
gather+broadcast (all-gather on the sources, broadcast of the full tensor, slice) and
engine/baseline; µs per parameter; peak extra GPU memory of one engine call (max over
source ranks / destination ranks); and whether the destination shards came out exact.

Without an importable engine, the baselines still run and the engine columns are n/a.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .env_options import add_env_arguments, apply_env
from .report import format_table, plot_bandwidth, write_report
from .timing import synchronize
from .transfer_cases import build_cases, parse_size
from .transfer_run import COLUMNS, Context, run_case


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_transfer",
        description=__doc__.split("\n\n")[0] + " Run under torchrun (2+ ranks, even count).",
        epilog="See megatron_reshard/tools/bench/transfer_main.py for the layouts and columns.")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (NCCL) or cpu (gloo); default: cuda when available")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke runs)")
    p.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                   help="only these cases (names as in the table; prefix match)")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[], metavar="SIZE",
                   help="extra S(0)→S(1) sweep rows of these global sizes (e.g. 64M 256M 1G)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 10; 3 with --small)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 3; 1 with --small)")
    p.add_argument("--timer", choices=["auto", "wall", "event"], default="auto",
                   help="wall: perf_counter + device sync (default); event: CUDA events")
    p.add_argument("--staging-mib", type=int, default=256, help="engine staging budget per rank")
    p.add_argument("--out", default="bench_out/transfer", help="output folder (md, json, png)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the exactness check of the destination shards")
    p.add_argument("--no-baseline", dest="baselines", action="store_false",
                   help="skip gather+broadcast")
    p.add_argument("--no-engine", action="store_true", help="baselines only")
    add_env_arguments(p)
    p.add_argument("--cross-world", action="store_true",
                   help="move the engine and raw P2P traffic over a refit group built by "
                        "megatron_reshard.groups.comm.create_refit_group (unregistered), not the "
                        "torchrun world")
    p.add_argument("--refit-port", type=int, default=None,
                   help="TCPStore port for --cross-world (default MASTER_PORT + 17)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process group timeouts")
    return p


def _load_engine(args: argparse.Namespace) -> tuple[Any, str]:
    if args.no_engine:
        return None, "disabled (--no-engine)"
    try:
        import megatron_reshard.engine as eng

        eng.Transfer, eng.xfer_batch  # noqa: B018 - the contract's names must exist
        return eng, "megatron_reshard.engine"
    except (ImportError, AttributeError) as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})"


def _refit_group(args: argparse.Namespace, backend: str,
                 device: torch.device) -> Optional[dist.ProcessGroup]:
    if not args.cross_world:
        return None
    from megatron_reshard.groups.comm import create_refit_group

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = args.refit_port or int(os.environ.get("MASTER_PORT", "29500")) + 17
    return create_refit_group(host=host, port=port, rank=dist.get_rank(),
                              world_size=dist.get_world_size(), backend=backend,
                              timeout_s=args.timeout_s,
                              device=device if device.type == "cuda" else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    env = apply_env(args)
    if args.iters is None:
        args.iters = 3 if args.small else 10
    if args.warmup is None:
        args.warmup = 1 if args.small else 3
    want_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        print("bench_transfer: --device cuda but no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("bench_transfer: run under torchrun, e.g. "
              "torchrun --nproc-per-node 4 scripts/bench_transfer.py", file=sys.stderr)
        return 2
    timeout = timedelta(seconds=args.timeout_s)
    if want_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        backend = "gloo"
    try:
        return _run(args, device, backend, env)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device, backend: str, env: dict) -> int:
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world < 2 or world % 2:
        if rank == 0:
            print(f"bench_transfer: needs an even number of ranks >= 2, got {world}",
                  file=sys.stderr)
        return 2
    engine, engine_note = _load_engine(args)
    group = _refit_group(args, backend, device)
    try:
        return _run_cases(args, device, backend, env, engine, engine_note, group)
    finally:
        if group is not None:
            from megatron_reshard.groups.comm import destroy_refit_group

            destroy_refit_group(group)


def _run_cases(args: argparse.Namespace, device: torch.device, backend: str, env: dict,
               engine, engine_note: str, group: Optional[dist.ProcessGroup]) -> int:
    world = dist.get_world_size()
    rank = dist.get_rank()
    ctx = Context(group=group, device=device, src_ranks=list(range(world // 2)),
                  dst_ranks=list(range(world // 2, world)), world_size=world,
                  iters=args.iters, warmup=args.warmup, timer=args.timer,
                  staging_bytes=args.staging_mib << 20, check=args.check, engine=engine,
                  baselines=args.baselines)
    cases = build_cases(args.small, world, args.sizes)
    if args.cases:
        cases = [c for c in cases if any(c.name.startswith(n) for n in args.cases)]
        if not cases:
            ctx.log(f"bench_transfer: no case matches {args.cases}")
            return 2
    ctx.log(f"bench_transfer: {world} ranks on {device.type} ({backend}), sources "
            f"{ctx.src_ranks} → destinations {ctx.dst_ranks}; engine: {engine_note}; "
            f"{len(cases)} cases, median of {args.iters} after {args.warmup} warmup")
    rows = [run_case(ctx, case) for case in cases]
    synchronize(device)
    if rank == 0:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "world_size": world, "src_ranks": ctx.src_ranks, "dst_ranks": ctx.dst_ranks,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": backend, "torch": torch.__version__,
            "nccl": (".".join(map(str, torch.cuda.nccl.version()))
                     if device.type == "cuda" else None),
            "group": "refit group (create_refit_group)" if args.cross_world
                     else "torchrun default world",
            "engine": engine_note, "iters": args.iters, "warmup": args.warmup,
            "timer": args.timer, "staging_mib": args.staging_mib, "small": args.small,
            "env": env, "argv": sys.argv,
        }
        table = format_table(rows, COLUMNS)
        print(table, flush=True)
        for r in rows:
            if "error" in r:
                print(f"{r['case']}: {r['error']}")
        paths = write_report(
            args.out, rows, COLUMNS, meta=meta, stem="transfer",
            title="Transfer benchmark: engine vs raw P2P vs gather+broadcast",
            plot=lambda rs, path: plot_bandwidth(rs, path, title="GB/s per destination rank"))
        print(f"wrote {paths.markdown}, {paths.json}" + (f", {paths.png}" if paths.png else ""))
    bad = any(r.get("check") == "MISMATCH" or "error" in r for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
