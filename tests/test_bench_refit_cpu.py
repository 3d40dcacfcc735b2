"""The refit benchmark's CPU smoke: 4 processes under torchrun (gloo, tiny shapes).

Runs ``torchrun --nproc-per-node 4 -m megatron_reshard.tools.bench.refit_main --device cpu
--backend gloo --small`` and checks the table's columns, the report files and that both
cases verified bit-exact. No wall-clock thresholds (two shared cores): figures are only
checked to be positive and finite.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_reshard.tools.worlds import free_port_block
from megatron_reshard.tools.bench.refit_main import COLUMNS, build_parser
from megatron_reshard.tools.bench.refit_model import fill_pattern_

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    return free_port_block(1)


def test_parser_defaults():
    args = build_parser().parse_args([])
    assert args.case == "all" and args.layers is None and args.out == "bench_out/refit"
    args = build_parser().parse_args(["--case", "moe", "--layers", "8", "--p2p-channels", "32"])
    assert (args.case, args.layers, args.p2p_channels) == ("moe", 8, 32)


def test_fill_pattern_is_deterministic_and_keyed():
    import torch

    a, b, c = (torch.empty(1000, 3, dtype=torch.bfloat16) for _ in range(3))
    fill_pattern_(a, 17, chunk=256)
    fill_pattern_(b, 17)
    fill_pattern_(c, 18)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max() <= 2 and a.float().std() > 0.5


def test_refit_bench_cpu_smoke(tmp_path):
    port = _free_port()
    out = tmp_path / "refit"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "megatron_reshard.tools.bench.refit_main", "--device", "cpu", "--backend", "gloo",
           "--small", "--out", str(out), "--port-base", str(free_port_block(16))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    # no noise: torch's deprecation of the old all-gather name, the profiler's USDT lines
    assert "FutureWarning" not in proc.stderr, proc.stderr[-4000:]
    assert "USDT" not in proc.stdout + proc.stderr, proc.stderr[-4000:]
    header = "| " + " | ".join(c.header for c in COLUMNS) + " |"
    assert header in proc.stdout, proc.stdout
    for name in ("refit ms", "bulk ms", "refit GB/s/gen", "raw pair GB/s", "raw fan-in GB/s",
                 "refit/raw", "g+b GB/s/gen", "bulk/g+b", "peak extra train MiB",
                 "peak extra gen MiB", "check"):
        assert name in header
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("| moe ") or ln.startswith("| dense ")]
    assert len(lines) == 2 and all(ln.rstrip().endswith("| exact |") for ln in lines), proc.stdout
    assert (out / "refit.md").read_text().count("| exact |") == 2
    rows = json.loads((out / "refit.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["moe", "dense"]
    for r in rows:
        assert r["check"] == "exact" and not r["mismatched"]
        for key in ("refit_ms", "bulk_ms", "refit_gbps", "bulk_gbps", "raw_pair_gbps",
                    "raw_fanin_gbps", "baseline_ms", "baseline_gbps", "bulk_vs_baseline"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["bytes_per_gen"] >= r["bulk_bytes_per_gen"] > 0  # all exact: equal
        assert r["baseline_bytes_per_gen"] == r["bulk_bytes_per_gen"]  # same useful bytes
        # CPU: the allocator's events (bench/memory.py); reported against the budget
        assert r["peak_extra_train_mib"] > 0 and r["peak_extra_gen_mib"] > 0
        assert r["extra_vs_staging"] == pytest.approx(
            max(r["peak_extra_train_mib"], r["peak_extra_gen_mib"]) / r["staging_mib"])
