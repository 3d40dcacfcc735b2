"""scripts/vllm_backend_refit.py: refits through vLLM's weight-transfer API (the
``megatron_reshard`` backend) into vLLM's own model classes, bit-equal to vLLM's own
``load_weights``; a refit broken part-way leaves the weight state saying so."""

import importlib.util
import json
import os

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "vllm_backend_refit.py")


def _script():
    spec = importlib.util.spec_from_file_location("vllm_backend_refit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_example_refits_bit_exact_through_the_backend(pool, capsys):
    """The script's ``main`` as ``python scripts/vllm_backend_refit.py --refits 2
    --fail-extra --progress-s 0`` runs it, on the suite's shared pool (its workers have vLLM imported)."""
    assert _script().main(["--refits", "2", "--fail-extra", "--progress-s", "0"], pool=pool) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("VLLM_BACKEND_SUMMARY "))
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["verified"] is True
    assert summary["versions"] == [[1, 2], [1, 2]]
    assert summary["differences"] == [[[], []], [[], []]]
    # a long run is not silent: generation rank 0 said how far it got (here after each refit)
    assert summary["progress"] == [
        "[gen 0] refit 1/2 committed; 0 of 1 differed from vLLM's load_weights",
        "[gen 0] refit 2/2 committed; 0 of 2 differed from vLLM's load_weights"]
    for w in summary["failed"]:
        assert w["state"] == "inconsistent" and w["started_from"] == 2 and w["failed_refits"] == 1
