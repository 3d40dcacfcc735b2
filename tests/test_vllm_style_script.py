"""scripts/vllm_style_refit.py: the generation side driven as vLLM drives its workers
(collective_rpc, same plain-data arguments to every worker), in a launcher separate from
the training side; every refit committed and bit-exact."""

import json
import os
import subprocess
import sys

import pytest

from ahead import Ahead

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "vllm_style_refit.py")
TWO_LAUNCHERS = ["--model", "dense", "--train-world", "2", "--train-tp", "2", "--gen-world", "2",
                 "--gen-tp", "2", "--refits", "2", "--timeout-s", "60"]
BAD_LAYOUT = ["--gen-world", "2", "--gen-tp", "3"]


def _launch(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout)


AHEAD = _run = Ahead(_launch)  # both launches start with the module (tests/ahead.py)


def _summaries(stdout: str) -> dict:
    rows = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines()
            if line.startswith("VLLM_STYLE_SUMMARY ")]
    return {row["launcher"]: row for row in rows}


@pytest.mark.slow
@pytest.mark.ahead(TWO_LAUNCHERS)
def test_two_launchers_refit_bit_exact_through_collective_rpc():
    done = _run(*TWO_LAUNCHERS)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _summaries(done.stdout)
    assert set(rows) == {"train", "gen"}
    gen = rows["gen"]
    assert gen["verified"] is True
    assert gen["versions"] == [[1], [2]]
    assert gen["mismatched"] == [[], []]
    assert gen["weights"] == ["consistent", "consistent"]
    # the driver is its own process; each worker another one
    assert len(set(gen["worker_pids"]) | {gen["driver_pid"]}) == 3
    assert rows["train"]["refits"] == 2


@pytest.mark.ahead(BAD_LAYOUT, timeout=60)
def test_bad_layout_is_one_line_and_exit_2():
    done = _run(*BAD_LAYOUT, timeout=60)
    assert done.returncode == 2
    assert "--gen-world 2" in done.stderr and "Traceback" not in done.stderr
