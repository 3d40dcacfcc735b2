"""What the staged FP8 path costs per layer: vLLM's conversion after each refit (issue 34).

    .venv-vllm/bin/python scripts/bench_staged_conversion.py [--backends flashinfer_cutlass,...]

Builds vLLM 0.33's block-FP8 Qwen3-MoE on the CPU as the real-vLLM tests do
(``tests/real_vllm/test_fp8_staged_conversion.py``: hidden 128, 8 experts, expert
intermediate 256, train TP2 EP2 -> gen TP2; ``testing.vllm_models``' CPU shim builds the
kernel objects a GPU picks) and refits it, per FP8 MoE backend, through the real worker
extension (``tools.vllm_refit.vllm_refit_job``; each refit also checked bit for bit
against vLLM's own loading). For one generation rank it prints, per staged layer: the
bytes vLLM holds for the layer, the extra bytes its conversion held (the staging peak)
and the conversion's time per refit; then the totals and the conversions' share of the
refit (receive + conversion). The FP8 linear layers take the CUTLASS block kernel.

CPU figures: they show where staging happens and how large it is (bytes are the device's
too); times on a GPU differ. ``staged_table`` reads the figures off a generation rank's
result; the real-vLLM tests check them on their own refits.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BACKENDS = ("flashinfer_cutlass", "flashinfer_trtllm", "triton")


def staged_table(gen: dict) -> dict:
    """A generation rank's result of ``vllm_refit_job`` -> ``{"rows": [per staged layer],
    "totals": {...}}``; times per refit (the mean over the refits)."""
    report = gen["report"]["staged_conversion"]
    refits = len(gen["refits"])
    rows = []
    for name in report["layers"]:
        own = report["per_layer"].get(name)
        if own is None:  # a layer no refit converted: shown as such, never as zero cost
            rows.append({"layer": name, "backend": None, "layer_bytes": None,
                         "peak_staging_bytes": None, "convert_s": None, "conversions": 0})
            continue
        rows.append({"layer": name, "backend": own["backend"], "layer_bytes": own["layer_bytes"],
                     "peak_staging_bytes": own["peak_staging_bytes"],
                     "convert_s": own["total_convert_s"] / own["conversions"],
                     "conversions": own["conversions"]})
    receive_s = sum(stats["refit_s"] for stats in gen["refits"])
    convert_s = report["convert_s"]
    totals = {"layers": len(rows), "refits": refits,
              "layer_bytes": sum(r["layer_bytes"] or 0 for r in rows),
              "peak_staging_bytes": report["peak_staging_bytes"],
              "sum_staging_bytes": sum(r["peak_staging_bytes"] or 0 for r in rows),
              "convert_s_per_refit": convert_s / max(refits, 1),
              "receive_s_per_refit": receive_s / max(refits, 1),
              "convert_share": convert_s / (convert_s + receive_s) if convert_s + receive_s else 0.0}
    return {"rows": rows, "totals": totals}


def format_table(title: str, table: dict) -> str:
    lines = [title, f"{'layer':<48} {'method:backend':<46} {'layer B':>9} {'staging B':>10} "
                    f"{'ms/refit':>9}"]
    for r in table["rows"]:
        ms = "-" if r["convert_s"] is None else f"{r['convert_s'] * 1e3:.2f}"
        lines.append(f"{r['layer']:<48} {str(r['backend']):<46} {str(r['layer_bytes']):>9} "
                     f"{str(r['peak_staging_bytes']):>10} {ms:>9}")
    t = table["totals"]
    lines.append(f"totals: {t['layers']} layers, {t['layer_bytes']} B held, staging peak "
                 f"{t['peak_staging_bytes']} B (one layer at a time; {t['sum_staging_bytes']} B "
                 f"summed over layers), conversion {t['convert_s_per_refit'] * 1e3:.1f} ms per "
                 f"refit, receive {t['receive_s_per_refit'] * 1e3:.1f} ms per refit: conversion "
                 f"{t['convert_share'] * 100:.1f}% of the refit")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="vLLM --moe-backend values for the FP8 experts (comma-separated)")
    parser.add_argument("--rank", type=int, default=0, help="the generation rank printed")
    args = parser.parse_args(argv)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "real_vllm")]
    from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment

    set_vllm_cpu_environment()  # before vLLM is first imported
    from test_fp8_staged_conversion import _cfg, fp8_config_json
    from test_real_vllm import _build

    from megatron_reshard.tools.vllm_refit import vllm_refit_job
    from megatron_reshard.tools.worlds import WorkerPool

    cfg = _cfg()
    with WorkerPool(cfg.train_world + cfg.gen_world) as pool:
        for backend in args.backends.split(","):
            results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                               fp8_config_json(), model_builder=_build, moe_backend=backend,
                               num_ports=cfg.train_pp + 2, timeout_s=480)
            gens = [r for r in results if r["role"] == "gen"]
            bad = [(g["rank"], g["differences"]) for g in gens if any(g["differences"])]
            if bad:
                raise SystemExit(f"{backend}: the refit differs from vLLM's own loading: {bad}")
            gen = next(g for g in gens if g["rank"] == args.rank)
            print(format_table(f"\n--moe-backend {backend}: gen rank {args.rank} of "
                               f"{cfg.gen_world} (train TP{cfg.train_tp} EP{cfg.train_ep} -> gen "
                               f"TP{cfg.gen_tp}), {cfg.refits} refits, bit-equal to vLLM",
                               staged_table(gen)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
