"""A delta is applied only onto the base it was cut from, checksums off (issue 50, item 2).

Real processes: a real megatron-core model (dense, Qwen3-shaped, bf16) on 1 training rank
refits 2 generation ranks (TP2, vLLM-layout model, the worker extension) with
``RefitSender(delta=True)`` and the end-to-end checksums off (the default of the README's
sketch and of ``MegatronReshardTrainerInitInfo``). Between refits ~2% of the training
weights change. After refit 2, generation rank 0 changes two elements of a param's storage
behind the refits' back (a user, a post-load step, a bug). Before the fix the next two
delta refits applied their deltas onto those bytes, left them wrong for good and reported
``consistent``. Now the session's base digest (``delta.base_digest``, taken at the last
commit) differs, the refit goes full on every rank with the reason, generation rank 0's
report names the param, and every refit is bit-exact against the reference (full HF
tensors gathered by the independent oracle, sliced by the vLLM layout).
"""

import time

import pytest
import torch

from two_worlds import prepared_worker, refit_and_record, run_two_worlds, train_sparse_deltas

GEN = 2
TIMEOUT_S = 60.0
REFITS = 5
WRITTEN_BEFORE = 2
WRITTEN = "model.layers.1.self_attn.o_proj.weight"
MODES = ["full", "delta", "full", "delta", "delta"]


def _train(job, control, rank):
    return train_sparse_deltas(job, control, GEN, REFITS, TIMEOUT_S)


def _gen(job, control, gen_rank):
    worker, model, _ = prepared_worker(job, control, gen_rank, GEN, 1, TIMEOUT_S)
    out = {"refits": [], "states": [], "reports": [], "mismatched": []}
    for step in range(REFITS):
        if step == WRITTEN_BEFORE and gen_rank == 0:
            with torch.no_grad():  # two elements written outside the refits
                flat = dict(model.named_parameters())[WRITTEN].view(-1)
                flat[7:9] = flat[7:9] * 2 + 1
        refit_and_record(out, worker, control, step, gen_rank, model)
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def runs(pool):
    return run_two_worlds(pool, 1, GEN, _train, _gen, num_ports=2, timeout_s=300)


def test_every_refit_is_bit_exact_though_a_base_was_written(runs):
    for gen in runs[1:]:
        assert gen["mismatched"] == [[]] * REFITS, gen["mismatched"]
        assert all(s["state"] == "consistent" for s in gen["states"]), gen["states"]


def test_the_refit_after_the_write_is_full_on_every_rank_and_says_why(runs):
    train, gens = runs[0], runs[1:]
    assert [r["mode"] for r in train] == MODES, [r.get("full_reason") for r in train]
    reason = train[WRITTEN_BEFORE]["full_reason"]
    assert "written outside the refits" in reason, reason
    for gen_rank, gen in enumerate(gens):
        assert [r["mode"] for r in gen["refits"]] == MODES, gen["refits"]
        report = gen["reports"][WRITTEN_BEFORE]
        assert report["mode"] == "full" and "written outside the refits" in report["full_reason"]
        assert report["written_outside"] == ([WRITTEN] if gen_rank == 0 else []), report
        assert gen["reports"][WRITTEN_BEFORE + 1]["written_outside"] == []
