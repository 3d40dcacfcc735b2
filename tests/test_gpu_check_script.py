"""``scripts/gpu_check.sh`` answers ``--help`` and refuses a bad NPROC before it starts
anything (it failed with "unbound variable" on ``--help`` before)."""

from __future__ import annotations

import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_help_prints_the_usage_and_exits_0():
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "bash scripts/gpu_check.sh [NPROC] [OUT] [STEPS]" in proc.stdout


def test_a_bad_nproc_is_refused_by_name(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "four", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "NPROC: expected the number of GPUs" in proc.stderr and "'four'" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing started
