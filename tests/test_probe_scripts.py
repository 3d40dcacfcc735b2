"""The diagnostic probes behind docs/MEASUREMENTS.md figures still run (CPU smoke modes)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _run(args, timeout=180):
    proc = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_copy_kernel_probe_prints_every_variant():
    out = _run([sys.executable, "scripts/probe_copy_kernels.py", "--small"])
    for name in ("experts: _foreach_copy_ int64", "column block: int64 words pack",
                 "transposed destination: copy_"):
        assert name in out


def test_call_phase_probe_times_every_phase_per_call_and_agreed(tmp_path):
    from megatron_reshard.tools.worlds import free_ports

    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(free_ports(1)[0]), "scripts/probe_call_phases.py",
                "--small", "--iters", "2", "--cases", "s0_s1"])
    assert "[s0_s1]" in out
    for phase in ("total", "start", "conclude", "_execute"):
        assert any(line.split()[:1] == [phase] for line in out.splitlines()), phase


def test_change_rate_measurement_counts_changed_bf16_elements(tmp_path):
    import json

    out_json = tmp_path / "rates.json"
    out = _run([sys.executable, "scripts/measure_change_rate.py", "--small", "--steps", "2",
                "--models", "dense", "--lrs", "1e-5", "--json", str(out_json)])
    assert "| dense | 1e-05 |" in out
    (row,) = json.loads(out_json.read_text())
    # Adam's first step moves every element by ~lr: some BF16 values flip, not all of them
    assert [r["step"] for r in row["per_step"]] == [1, 2]
    for r in row["per_step"]:
        assert 0.0 < r["all"] < 1.0, r
