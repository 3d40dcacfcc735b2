"""The colocated transport with real processes: a real megatron-core model on the training
ranks, the real receiver on the generation ranks, bytes copied out of the training ranks'
shared memory (CPU stand-in for CUDA IPC), bit for bit against the independent reference;
its fault twins live in test_faults.py (same jobs, ``transport="colocated"``)."""

import pytest

from test_faults import _check_all_or_nothing, _run

pytestmark = pytest.mark.slow


def test_colocated_refits_are_bit_exact_and_committed(pool):
    results, _ = _run(pool, refits=2, tag="coloc", transport="colocated", fresh_gen=True)
    for r in (0, 1):
        assert results[r]["error"] is None, results[r]
    for r in (2, 3):
        gen = results[r]
        assert gen["error"] is None, gen["error"]
        assert gen["state"]["state"] == "consistent" and gen["state"]["version"] == 2, gen
        assert set(gen["versions"][2]) == set(gen["names"])  # every param bit-exact
        assert gen["transports"] == ["colocated"]  # chosen by the trainer, followed here
        _check_all_or_nothing(gen)
