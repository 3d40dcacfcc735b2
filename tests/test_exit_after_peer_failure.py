"""Every process of a launch whose generation rank fails in ``prepare_refit`` exits with the
library's error and a plain status (1: an uncaught exception), never SIGABRT, over both
transports, within the group's timeout plus 5 s of the fault.

Real processes, each its own interpreter (``tests/prepare_failure_ranks.py``): the crash
this guards against happened at interpreter exit (an abandoned gloo wait returning during
finalization; ``groups.at_exit``), which pool workers that never exit cannot show.
Training TP2 on a real megatron-core dense model, generation TP2 over gloo. A stopped training
rank is named, as the cause, by every survivor.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 20.0   # the refit groups' timeout
MARGIN_S = 5.0     # the bound: timeout + 5 s
# what generation rank 1's own error says for each fault
OWN_ERROR = {"float32": "dtype mismatch on gen rank 1",
             "shape": "gen rank 1",
             "rename": "gen rank 1"}


def _launch(fault: str, transport: str) -> dict:
    out = subprocess.run([sys.executable, "tests/prepare_failure_ranks.py", "launch", "--fault",
                          fault, "--transport", transport, "--timeout-s", str(TIMEOUT_S)],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# (a renamed param, ``--fault rename``, fails the same way; the script runs it by hand)
@pytest.mark.parametrize("fault,transport", [("float32", "p2p"), ("shape", "colocated")])
def test_every_process_exits_with_the_error_and_status_1(fault, transport):
    res = _launch(fault, transport)
    fault_at = res.pop("fault_at")
    assert fault_at is not None, res
    for name, r in res.items():
        tail = r["stderr"][-3000:]
        assert r["status"] == 1, f"{name} exited with {r['status']}:\n{tail}"
        assert "terminate called" not in r["stderr"], f"{name}:\n{tail}"
        assert r["ended"] - fault_at < TIMEOUT_S + MARGIN_S, (name, r["ended"] - fault_at)
    assert "TargetError" in res["gen 1"]["stderr"] and OWN_ERROR[fault] in res["gen 1"]["stderr"]
    for name in ("train 0", "train 1"):  # the training side says which rank failed and why
        assert "PeerFailure" in res[name]["stderr"], res[name]["stderr"][-3000:]
        assert OWN_ERROR[fault] in res[name]["stderr"], res[name]["stderr"][-3000:]
    # the other generation rank: the library's error (the failure, or its store host gone
    # first when the training side exited before it looked)
    assert "megatron_reshard.groups.faults." in res["gen 0"]["stderr"], res["gen 0"]["stderr"]


def test_a_stopped_training_rank_is_named_by_every_survivor():
    # training rank 1 stops (SIGSTOP) after the first refit; the second refit's first step
    # times out on every other rank, and each says which rank stopped answering
    timeout_s = 8.0
    out = subprocess.run([sys.executable, "tests/prepare_failure_ranks.py", "launch", "--fault",
                          "stop-train", "--timeout-s", str(timeout_s)],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    fault_at = res.pop("fault_at")
    assert fault_at is not None and res.pop("train 1")["status"] is None  # killed by the launcher
    for name, r in res.items():
        tail = r["stderr"][-3000:]
        assert r["status"] == 1, f"{name} exited with {r['status']}:\n{tail}"
        assert "group rank 1 (train rank 1 (PP stage 0)) gave no sign of life" in r["stderr"], tail
        assert "stopped (SIGSTOP), hung or dead" in r["stderr"], tail
        assert "same batches in the same order" not in r["stderr"], tail  # not a coding error
        raised = [float(ln.split()[1]) for ln in r["stdout"].splitlines()
                  if ln.startswith("RAISED_AT ")]
        assert raised and raised[0] - fault_at < timeout_s + MARGIN_S, (name, raised, fault_at)
