"""Every demo preset under every training TP and generation TP from 1 to 4 that the demo
accepts: one verified refit each, and the share of bytes on the exact path.

Runs on CPU (gloo, spawned workers, one pool for all runs). Training: TP ranks only (PP1,
EP2 for the MoE preset when the world allows it, else EP1); generation: TP ranks only.
Prints one row per layout and exits 1 if any refit is not bit-exact or moves a byte off
the exact path.

    python scripts/exact_path_sweep.py [--models moe,dense,qwen2] [--tp 1,2,3,4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.run_config import MODEL_PRESETS, RefitRunConfig


def _job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


def layouts(models: list[str], tps: list[int]) -> list[RefitRunConfig]:
    """The layouts of the sweep that the demo accepts (the others are listed as refused)."""
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(sorted(MODEL_PRESETS)))
    parser.add_argument("--tp", default="1,2,3,4")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from megatron_reshard.tools.worlds import WorkerPool

    configs = layouts(args.models.split(","), [int(t) for t in args.tp.split(",")])
    rows, ok = [], True
    with WorkerPool(8) as pool:
        for cfg in configs:
            problems = [p for p in cfg.problems() if not p.startswith("ports")]
            row = {"model": cfg.model, "train_tp": cfg.train_tp, "train_ep": cfg.train_ep,
                   "gen_tp": cfg.gen_tp}
            if problems:
                row["refused"] = problems[0]
            else:
                summary = summarize(cfg, pool.run(_job, cfg.train_world + cfg.gen_world, cfg,
                                                  timeout_s=240, num_ports=2))
                row.update(verified=summary["verified"],
                           exact_path_fraction=summary["exact_path_fraction"],
                           packed_params=max(r["other_params"] for r in summary["per_gen_rank"]))
                ok &= summary["verified"] and summary["exact_path_fraction"] == 1.0
            rows.append(row)
            if not args.json:
                if "refused" in row:
                    print(f"{cfg.model:6} train TP{cfg.train_tp} -> gen TP{cfg.gen_tp}: refused by "
                          f"the demo ({row['refused']})", flush=True)
                else:
                    print(f"{cfg.model:6} train TP{cfg.train_tp} EP{cfg.train_ep} -> gen "
                          f"TP{cfg.gen_tp}: {'bit-exact' if row['verified'] else 'MISMATCH'}, "
                          f"exact path {row['exact_path_fraction']:.1%}, "
                          f"{row['packed_params']} packed", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
