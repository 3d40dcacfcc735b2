"""``megatron-reshard demo``: run it (what it does, its options: ``demo_options``).

Both worlds in a pool of spawned workers on this machine; the summary printed, or one
JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.run_config import config_from_args
from megatron_reshard.tools.worlds import WorkerPool, free_ports


def _job(job, cfg):
    return run_rank(job.rank, cfg)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# What the demo's one parameter count counts (the summary's "params" in --json as well).
TENSORS_MEANING = ("HF weights each generation rank gets its slice of per refit; an MoE layer's "
                   "experts travel as one tensor per projection (gate, up, down) for all experts")


def print_summary(summary: dict) -> None:
    lay = summary["layout"]
    t, g = lay["train"], lay["gen"]
    print(f"\nrefit: {lay['model']} model, train tp{t['tp']} pp{t['pp']} ep{t['ep']} "
          f"({t['world']} ranks) -> gen tp{g['tp']} ep{g['ep']} ({g['world']} ranks), "
          f"{lay['backend']} on {lay['device']}, {lay['dtype']}"
          f"{ {'fp8': ' -> block FP8', 'mxfp8': ' -> MXFP8'}.get(summary.get('gen_precision'), '')}")
    print("| gen rank | tensors received (exact path + packed) | bytes received | exact-path bytes "
          "| packed bytes | mismatched params |")
    print("|---|---|---|---|---|---|")
    for row in summary["per_gen_rank"]:
        print(f"| {row['gen_rank']} | {row['params']} ({row['bulk_params']} + {row['other_params']}) "
              f"| {_fmt_bytes(row['bytes'])} | {_fmt_bytes(row['bulk_bytes'])} "
              f"| {_fmt_bytes(row['misc_bytes'])} | {len(row['mismatched'])} |")
    print(f"tensors received: {TENSORS_MEANING}")
    refit_ms = ", ".join(f"{s * 1e3:.1f}" for s in summary["refit_s"])
    print(f"exact-path share of bytes: {summary['exact_path_fraction']:.1%}")
    if summary.get("gen_precision") in ("fp8", "mxfp8"):
        got = sum(row["bytes"] for row in summary["per_gen_rank"])
        base = sum(row["unquantized_bytes"] for row in summary["per_gen_rank"])
        fmt = "block FP8" if summary["gen_precision"] == "fp8" else "MXFP8 (quantized on the receiver)"
        print(f"{fmt}: {_fmt_bytes(got)} received over all generation ranks vs "
              f"{_fmt_bytes(base)} for the same refit in {lay['dtype']} "
              f"({summary['bytes_vs_unquantized']:.1%}; embeddings, lm_head, norms and router "
              f"stay in {lay['dtype']}; scales included)")
    print(f"setup: {summary['setup_s']:.2f} s   refits: {summary['refits']} "
          f"(ms each, slowest rank: {refit_ms})")
    verdict = "PASS: every generation parameter is bit-exact after every refit"
    if not summary["verified"]:
        bad = sorted({n for row in summary["per_gen_rank"] for n in row["mismatched"]})
        verdict = f"FAIL: {len(bad)} parameters differ from the reference: {bad[:8]}"
    print(verdict)


def run(args: argparse.Namespace) -> int:
    """Run the demo (its options checked first: ``demo_options.problems``); returns the exit status."""
    probe = config_from_args(args, ports=(0,) * (1 + max(args.train_pp, 0)))
    nprocs = probe.train_world + probe.gen_world
    if not args.json:
        print(f"[demo] starting {probe.train_world} training + {probe.gen_world} generation "
              f"processes (spawned, {probe.backend}, loopback)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with WorkerPool(nprocs) as pool:
        cfg = config_from_args(args, ports=free_ports(1 + args.train_pp))
        results = pool.run(_job, nprocs, cfg, timeout_s=cfg.timeout_s * 3, num_ports=1)
    summary = summarize(cfg, results)
    summary["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0 if summary["verified"] or not cfg.verify else 1
