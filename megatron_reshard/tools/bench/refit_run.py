"""One refit-benchmark case on one rank: the two worlds' verified refit (``e2e.run_rank``),
then on the refit group the timed refits, peak memory, raw P2P and the baseline; rank 0
turns every rank's figures into the case's row (``COLUMNS`` say how it is shown).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .baselines import raw_p2p
from .memory import measure_cpu_peak_extra, measure_peak_extra
from .refit_baseline import run_baseline
from .refit_model import CASES, SMALL_OVERRIDES, build_model_fast
from .report import Column, sig
from .timing import GroupOps, synchronize


def _profile_one_refit(refit, device: torch.device, out_dir: str, label: str) -> None:
    """Profile one refit (CPU + CUDA) and write the op table to ``out_dir/profile_<label>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        refit()
        synchronize(device)
    os.makedirs(out_dir, exist_ok=True)
    averages = prof.key_averages()
    with open(os.path.join(out_dir, f"profile_{label}.txt"), "w") as f:
        f.write(averages.table(sort_by="cuda_time_total", row_limit=25))
        f.write("\n")
        f.write(averages.table(sort_by="cpu_time_total", row_limit=25))


def _bench_side(ctx: dict, args: argparse.Namespace, case: str) -> dict:
    """Runs on every rank of the refit group after the verified refit; returns figures
    identical on every rank of the group."""
    role, cfg, device, group = ctx["role"], ctx["cfg"], ctx["device"], ctx["group"]
    ops = GroupOps(group, device)
    n_train, n_gen = cfg.stage_world, cfg.gen_world
    src_ranks, dst_ranks = list(range(n_train)), list(range(n_train, n_train + n_gen))
    refit = ctx["sender"].refit if role == "train" else ctx["worker"].refit
    me = ops.rank
    say = (lambda msg: print(f"[{case}] {msg}", file=sys.stderr, flush=True)) if me == 0 else (lambda msg: None)

    say(f"warm-up: {args.warmup} refits")
    for _ in range(args.warmup):
        ops.barrier()
        refit()
    synchronize(device)
    times, bulks = [], []
    last: dict = {}
    for _ in range(args.iters):
        ops.barrier()
        t0 = time.perf_counter()
        last = refit()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        bulks.append(last["bulk_s"])
    slow = ops.allreduce_max(torch.tensor(times + bulks, dtype=torch.float64)).tolist()
    times, bulks = slow[:args.iters], slow[args.iters:]
    # Bytes into each generation GPU (slot per gen rank; train ranks contribute zeros).
    vec = torch.zeros(2 * n_gen, dtype=torch.float64)
    if role == "gen":
        vec[me - n_train] = last.get("bulk_bytes", 0) + last.get("misc_bytes", 0)
        vec[n_gen + me - n_train] = last.get("bulk_bytes", 0)
    vec = ops.allreduce_max(vec).tolist()
    total_per_gen, bulk_per_gen = vec[:n_gen], vec[n_gen:]
    say(f"timed {args.iters} refits: median {1e3 * _median(times):.2f} ms")

    if args.profile and device.type == "cuda":
        _profile_one_refit(refit, device, args.profile, f"{case}_{role}{me}")

    # the staging slots kept since the last refit are given back, so that the measured
    # refit allocates (and counts) them again
    release = (ctx["sender"].release_staging if role == "train"
               else ctx["worker"].release_refit_staging)
    release()
    if device.type == "cuda":
        _, peak = measure_peak_extra(refit, device)
        extra, alloc = float(peak.extra_bytes), float(peak.allocated_extra_bytes)
    else:  # the CPU allocator's events (bench/memory.py), one figure for both
        _, cpu_peak = measure_cpu_peak_extra(refit)
        extra = alloc = float(cpu_peak)
    mine = [x if role == side else 0.0 for x in (extra, alloc) for side in ("train", "gen")]
    pk = ops.allreduce_max(torch.tensor(mine, dtype=torch.float64))  # [extra tr, gen, alloc tr, gen]
    out: dict[str, Any] = {
        "refit_times_s": times, "bulk_times_s": bulks,
        "bytes_per_gen": total_per_gen, "bulk_bytes_per_gen": bulk_per_gen,
        "peak_extra_train_bytes": float(pk[0]), "peak_extra_gen_bytes": float(pk[1]),
        # the allocated-bytes peak (bench/memory.py), what earlier reports showed
        "peak_allocated_extra_train_bytes": float(pk[2]),
        "peak_allocated_extra_gen_bytes": float(pk[3]),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()

    nbytes = int(max(total_per_gen))
    if not args.no_raw and nbytes > 0:
        say(f"raw P2P, {nbytes / 2**20:.1f} MiB per destination")
        for pattern in ("pair", "fanin"):
            m = raw_p2p(group, src_ranks, dst_ranks, nbytes, device, iters=args.iters,
                        warmup=max(1, args.warmup), pattern=pattern)
            out[f"raw_{pattern}_gbps"] = m.gbps
            out[f"raw_{pattern}_ms"] = 1e3 * m.median_s
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not args.no_baseline:
        say("gather+broadcast baseline")
        out.update(run_baseline(ctx, args, case, ops))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])) if n else float("nan")


def run_case(case: str, args: argparse.Namespace, rank: int, ports: tuple, bench_store) -> Optional[dict]:
    """Play ``rank`` in one case; returns the row on rank 0 (None elsewhere)."""
    from megatron_reshard.tools.e2e import run_rank, summarize
    from megatron_reshard.tools.run_config import RefitRunConfig

    spec = CASES[case]
    overrides = dict(SMALL_OVERRIDES[case] if args.small else spec["overrides"])
    fp8 = getattr(args, "gen_precision", "bf16") == "fp8"
    if fp8 and args.small:
        overrides = {}  # run_config.FP8_MODEL_OVERRIDES: tiny dims made of whole 128x128 blocks
    layers = args.layers if args.layers is not None else (2 if args.small else 4)
    overrides["num_layers"] = layers
    device_type = "cuda" if args.device == "cuda" else "cpu"
    half = int(os.environ["WORLD_SIZE"]) // 2  # N train ranks, N gen ranks (gen TP N)
    train = {k: (half if v == 2 else v) for k, v in spec["train"].items()}
    cfg = RefitRunConfig(model=spec["model"], model_overrides=overrides, train_world=half,
                         gen_world=half, gen_tp=half, gen_ep=1, refits=1, verify=not args.no_verify,
                         backend=args.backend, device=device_type, dtype="bfloat16",
                         host=os.environ.get("MASTER_ADDR", "127.0.0.1"), ports=ports,
                         timeout_s=args.timeout_s, num_streams=args.streams,
                         staging_mib=args.staging_mib, quiet=rank not in (0, half),
                         gen_precision="fp8" if fp8 else "bf16", **train)
    t0 = time.perf_counter()
    result = run_rank(rank, cfg, model_builder=build_model_fast,
                      after_refits=lambda ctx: _bench_side(ctx, args, case))
    bench_store.set(f"{case}/result/{rank}", json.dumps(result, default=str))
    _teardown(rank < cfg.train_world)
    if rank != 0:
        return None
    results = [json.loads(bench_store.get(f"{case}/result/{r}")) for r in range(2 * half)]
    summary = summarize(cfg, results)
    b = results[0]["bench"]
    refit_s, bulk_s = _median(b["refit_times_s"]), _median(b["bulk_times_s"])
    per_gen, bulk_gen = max(b["bytes_per_gen"]), max(b["bulk_bytes_per_gen"])
    row: dict[str, Any] = {
        "case": case, "layout": spec["label"].format(n=cfg.gen_tp), "layers": layers,
        "params_per_gen": summary["params"],
        "bytes_per_gen": per_gen, "mib_per_gen": per_gen / 2**20,
        "bulk_bytes_per_gen": bulk_gen,
        "exact_path_fraction": summary["exact_path_fraction"],
        "refit_ms": 1e3 * refit_s, "refit_min_ms": 1e3 * min(b["refit_times_s"]),
        "bulk_ms": 1e3 * bulk_s,
        "refit_gbps": per_gen / refit_s / 1e9 if refit_s > 0 else None,
        "bulk_gbps": bulk_gen / bulk_s / 1e9 if bulk_s > 0 else None,
        "raw_pair_gbps": b.get("raw_pair_gbps"), "raw_fanin_gbps": b.get("raw_fanin_gbps"),
        "baseline_ms": b.get("baseline_ms"), "baseline_gbps": b.get("baseline_gbps"),
        "baseline_bytes_per_gen": b.get("baseline_bytes_per_gen"),
        "baseline_note": b.get("baseline_note"),
        "peak_extra_train_mib": _mib(b.get("peak_extra_train_bytes")),
        "peak_extra_gen_mib": _mib(b.get("peak_extra_gen_bytes")),
        "peak_allocated_extra_train_mib": _mib(b.get("peak_allocated_extra_train_bytes")),
        "peak_allocated_extra_gen_mib": _mib(b.get("peak_allocated_extra_gen_bytes")),
        "staging_mib": args.staging_mib,
        # the target: either side's peak extra memory within the staging budget
        "extra_vs_staging": (max(b["peak_extra_train_bytes"], b["peak_extra_gen_bytes"])
                             / (args.staging_mib * 2**20) if args.staging_mib else None),
        "setup_s": summary["setup_s"], "case_s": time.perf_counter() - t0,
        "verified_refit_ms": 1e3 * summary["refit_s"][0] if summary["refit_s"] else None,
        "check": ("exact" if summary["verified"] else "MISMATCH") if cfg.verify else "not verified",
        "mismatched": sorted({n for g in summary["per_gen_rank"] for n in g["mismatched"]})[:20],
        "bytes_per_gen_rank": b["bytes_per_gen"],
        "gen_precision": summary["gen_precision"],
        "bytes_vs_unquantized": summary["bytes_vs_unquantized"],
    }
    raws = [x for x in (row["raw_pair_gbps"], row["raw_fanin_gbps"]) if x]
    if raws:
        row["raw_gbps"] = max(raws)
        row["refit_vs_raw"] = row["refit_gbps"] / row["raw_gbps"] if row["refit_gbps"] else None
        row["bulk_vs_raw"] = row["bulk_gbps"] / row["raw_gbps"] if row["bulk_gbps"] else None
    if row["baseline_gbps"] and row["bulk_gbps"]:
        row["bulk_vs_baseline"] = row["bulk_gbps"] / row["baseline_gbps"]
        if row["baseline_bytes_per_gen"] != bulk_gen:
            row["baseline_note"] = ((row["baseline_note"] or "") + f" baseline moves "
                                    f"{row['baseline_bytes_per_gen']:.0f} useful B/gen vs refit "
                                    f"bulk {bulk_gen:.0f}").strip()
    return row


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else x / 2**20


def _teardown(train: bool) -> None:
    """Leave no world behind: the next case builds its own."""
    if train:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


COLUMNS = [
    Column("case", "case"),
    Column("layout", "layout"),
    Column("layers", "layers"),
    Column("params_per_gen", "params/gen"),
    Column("mib_per_gen", "MiB into each gen GPU", "{:.1f}"),
    Column("refit_ms", "refit ms", sig),
    Column("bulk_ms", "bulk ms", sig),
    Column("refit_gbps", "refit GB/s/gen", sig),
    Column("bulk_gbps", "bulk GB/s/gen", sig),
    Column("raw_pair_gbps", "raw pair GB/s", sig),
    Column("raw_fanin_gbps", "raw fan-in GB/s", sig),
    Column("refit_vs_raw", "refit/raw", "{:.0%}"),
    Column("bulk_vs_raw", "bulk/raw", "{:.0%}"),
    Column("baseline_ms", "g+b ms", sig),
    Column("baseline_gbps", "g+b GB/s/gen", sig),
    Column("bulk_vs_baseline", "bulk/g+b", "{:.2f}×"),
    Column("peak_extra_train_mib", "peak extra train MiB", "{:.0f}"),
    Column("peak_extra_gen_mib", "peak extra gen MiB", "{:.0f}"),
    Column("staging_mib", "staging MiB"),
    Column("extra_vs_staging", "max extra/staging", "{:.0%}"),
    Column("check", "check"),
]
