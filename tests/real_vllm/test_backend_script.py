"""scripts/vllm_backend_refit.py: refits through vLLM's weight-transfer API (the
``megatron_reshard`` backend) into vLLM's own model classes, bit-equal to vLLM's own
``load_weights``; a refit broken part-way leaves the weight state saying so."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "vllm_backend_refit.py")


@pytest.mark.slow
def test_the_example_refits_bit_exact_through_the_backend():
    done = subprocess.run([sys.executable, SCRIPT, "--refits", "2", "--fail-extra"],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("VLLM_BACKEND_SUMMARY "))
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["verified"] is True
    assert summary["versions"] == [[1, 2], [1, 2]]
    assert summary["differences"] == [[[], []], [[], []]]
    for w in summary["failed"]:
        assert w["state"] == "inconsistent" and w["started_from"] == 2 and w["failed_refits"] == 1
