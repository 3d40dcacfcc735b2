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


def test_cuda_ipc_is_refused_for_the_async_allocator_and_old_torch_with_expandable_segments():
    from megatron_reshard.engine.shared_memory import allocator_problem

    assert allocator_problem("", (2, 11)) is None
    assert allocator_problem("expandable_segments:True", (2, 11)) is None
    assert "cudaMallocAsync" in allocator_problem("backend:cudaMallocAsync", (2, 13))
    assert "expandable_segments" in allocator_problem("expandable_segments:True", (2, 4))


def test_an_unknown_transport_name_is_refused_before_any_store():
    from megatron_reshard.comm import create_refit_group

    with pytest.raises(ValueError, match="unknown refit transport 'ipc'"):
        create_refit_group("127.0.0.1", 1, 0, 2, transport="ipc")
    with pytest.raises(ValueError, match="colocated transport talks over gloo"):
        create_refit_group("127.0.0.1", 1, 0, 2, backend="nccl", transport="colocated")
