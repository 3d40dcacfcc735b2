"""``scripts/exact_path_sweep.py`` exits 0 on a clean run and ends with one summary line
(issue 50, item 6: it exited 1 whenever a family that sends some params packed by design
was in the sweep, and printed no summary). A real sweep of two presets (one all on the
exact path, one below 100% by design) through the script, and its verdict on rows that
must fail."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "exact_path_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("exact_path_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_clean_sweep_with_a_family_packed_by_design_exits_0_with_a_summary():
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "dense,qwen3.5",
                           "--tp", "1,3"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last == ("exact_path_sweep: 8 layouts checked: 2 bit-exact, 6 refused by the demo's "
                    "checks; below 100% exact path by design: qwen3.5 (lowest "
                    + last.split("(lowest ")[1]), last
    assert "qwen3.5    train TP1 EP1 -> gen TP1: bit-exact" in proc.stdout, proc.stdout
    assert "(by design)" in proc.stdout


def _ran(model, verified=True, fraction=1.0):
    return {"model": model, "train_tp": 1, "train_ep": 1, "gen_tp": 1, "verified": verified,
            "exact_path_fraction": fraction, "packed_params": 0}


REFUSED = {"model": "dense", "train_tp": 3, "train_ep": 1, "gen_tp": 1, "refused": "--train-tp 3"}


def test_the_verdict(sweep):
    ok = sweep.sweep_summary([_ran("dense"), _ran("qwen3-next", fraction=0.7), REFUSED])
    assert ok["ok"] and (ok["layouts"], ok["bit_exact"], ok["refused"]) == (3, 2, 1)
    assert ok["below_100_by_design"] == {"qwen3-next": 0.7}
    mismatch = sweep.sweep_summary([_ran("gpt-oss", verified=False, fraction=0.2)])
    assert not mismatch["ok"] and mismatch["mismatched"] == 1
    assert "FAILED: 1 not bit-exact" in sweep.summary_line(mismatch)
    off_path = sweep.sweep_summary([_ran("moe", fraction=0.92)])  # moe sends all shard to shard
    assert not off_path["ok"] and off_path["off_exact_path_not_by_design"] == 1
    assert json.loads(json.dumps(ok)) == ok  # --json prints it
