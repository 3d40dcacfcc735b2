"""Every demo preset under every training TP and generation TP from 1 to 4 that the demo
accepts: one verified refit each, and the share of bytes on the exact path.

Runs on CPU (gloo, spawned workers, one pool for all runs). Training: TP ranks only (PP1,
EP2 for the MoE presets at even TP, else EP1); generation: TP ranks only. Prints one row
per layout, then one summary line: layouts checked, bit-exact, refused by the demo's
checks, and the families below 100% exact path by design (Qwen3-Next / Qwen3.5's
gated norm, Qwen3-Next's per-key-head in_proj: ``presets.PACKED_BY_DESIGN_TYPES``).

Exit status 0 when every layout is bit-exact or refused, and every family outside those
moves every byte on the exact path; 1 otherwise (a mismatch, or a byte off the exact path
where none should be).

    python scripts/exact_path_sweep.py [--models moe,dense,qwen2] [--tp 1,2,3,4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.presets import PACKED_BY_DESIGN_TYPES
from megatron_reshard.tools.run_config import MODEL_PRESETS, RefitRunConfig


def _job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


def layouts(models: list[str], tps: list[int]) -> list[RefitRunConfig]:
    """The layouts of the sweep, those the demo refuses included (listed as refused)."""
    out = []
    for model in models:
        experts = MODEL_PRESETS[model].get("num_moe_experts") or 0
        for train_tp in tps:
            for gen_tp in tps:
                ep = 2 if experts and train_tp % 2 == 0 else 1
                out.append(RefitRunConfig(model=model, train_world=train_tp, train_tp=train_tp,
                                          train_pp=1, train_ep=ep, gen_world=gen_tp,
                                          gen_tp=gen_tp, refits=1, quiet=True, timeout_s=60,
                                          ports=(0, 0)))
    return out


def packed_by_design(model: str) -> bool:
    return MODEL_PRESETS[model].get("family") in PACKED_BY_DESIGN_TYPES


def sweep_summary(rows: list[dict]) -> dict:
    """Counts over the rows and whether the sweep passed (``ok``)."""
    ran = [r for r in rows if "refused" not in r]
    mismatched = [r for r in ran if not r["verified"]]
    off_path = [r for r in ran
                if r["exact_path_fraction"] < 1.0 and not packed_by_design(r["model"])]
    below: dict[str, float] = {}
    for r in ran:
        if r["exact_path_fraction"] < 1.0 and packed_by_design(r["model"]):
            below[r["model"]] = min(below.get(r["model"], 1.0), r["exact_path_fraction"])
    return {"layouts": len(rows), "bit_exact": len(ran) - len(mismatched),
            "refused": len(rows) - len(ran), "mismatched": len(mismatched),
            "off_exact_path_not_by_design": len(off_path),
            "below_100_by_design": below, "ok": not mismatched and not off_path}


def summary_line(s: dict) -> str:
    below = ", ".join(f"{m} (lowest {f:.1%})" for m, f in sorted(s["below_100_by_design"].items()))
    line = (f"exact_path_sweep: {s['layouts']} layouts checked: {s['bit_exact']} bit-exact, "
            f"{s['refused']} refused by the demo's checks; below 100% exact path by design: "
            f"{below or 'none'}")
    if not s["ok"]:
        line += (f"; FAILED: {s['mismatched']} not bit-exact, {s['off_exact_path_not_by_design']}"
                 f" with bytes off the exact path outside those families")
    return line


def _row(cfg: RefitRunConfig, pool) -> dict:
    problems = [p for p in cfg.problems() if not p.startswith("ports")]
    row = {"model": cfg.model, "train_tp": cfg.train_tp, "train_ep": cfg.train_ep,
           "gen_tp": cfg.gen_tp}
    if problems:
        row["refused"] = problems[0]
        return row
    summary = summarize(cfg, pool.run(_job, cfg.train_world + cfg.gen_world, cfg,
                                      timeout_s=240, num_ports=2))
    row.update(verified=summary["verified"], exact_path_fraction=summary["exact_path_fraction"],
               packed_params=max(r["other_params"] for r in summary["per_gen_rank"]))
    return row


def _row_text(row: dict) -> str:
    where = f"{row['model']:10} train TP{row['train_tp']}"
    if "refused" in row:
        return f"{where} -> gen TP{row['gen_tp']}: refused by the demo ({row['refused']})"
    below = row["exact_path_fraction"] < 1.0 and packed_by_design(row["model"])
    design = " (by design)" if below else ""
    return (f"{where} EP{row['train_ep']} -> gen TP{row['gen_tp']}: "
            f"{'bit-exact' if row['verified'] else 'MISMATCH'}, exact path "
            f"{row['exact_path_fraction']:.1%}{design}, {row['packed_params']} packed")


def main() -> int:
    parser = argparse.ArgumentParser(
        description="One verified CPU refit per demo preset x train TP x gen TP; the share of "
                    "bytes on the exact path (exit 0: all bit-exact or refused by design).")
    parser.add_argument("--models", default=",".join(sorted(MODEL_PRESETS)),
                        help="comma-separated demo presets (default: all)")
    parser.add_argument("--tp", default="1,2,3,4", help="TP sizes for both sides")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object: {rows, summary}")
    args = parser.parse_args()
    from megatron_reshard.tools.worlds import WorkerPool

    rows = []
    with WorkerPool(8) as pool:
        for cfg in layouts(args.models.split(","), [int(t) for t in args.tp.split(",")]):
            rows.append(_row(cfg, pool))
            if not args.json:
                print(_row_text(rows[-1]), flush=True)
    summary = sweep_summary(rows)
    print(json.dumps({"rows": rows, "summary": summary}) if args.json else summary_line(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
