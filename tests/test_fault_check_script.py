"""scripts/fault_check.py (the GPU check's fault step) stays working: on CPU with gloo, the
generation survivor of a killed training launcher fails at once and reports its weights."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_fault_step_reports_a_fast_failure_on_gloo():
    out = subprocess.run([sys.executable, "scripts/fault_check.py", "--backend", "gloo", "--fault",
                          "kill", "--victim", "train", "--timeout-s", "8"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the gen survivor failed after" in out.stdout and "PeerFailure" in out.stdout
    assert "weights: inconsistent, version 2, started_from 2" in out.stdout
