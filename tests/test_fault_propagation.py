"""Errors reach every rank of a refit group within seconds, naming the rank that failed.

Real gloo refit groups over loopback (spawned processes); the timeouts are long (60 s) so
that a pass proves the error came through the fault board, not through a timeout.
"""

import time

import pytest
import torch

from megatron_reshard.groups.comm import create_refit_group
from megatron_reshard.groups.collectives import all_gather_ints
from megatron_reshard.groups.faults import PeerFailure, RefitError
from megatron_reshard.receiver import MegatronReshardWorkerExtension
from megatron_reshard.testing.vllm_like import (
    build_plain_payload,
    build_vllm_like_model,
    random_hf_state_dict,
)

TIMEOUT_S = 60.0
CFG = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
           intermediate_size=64, num_hidden_layers=1, vocab_size=100, tie_word_embeddings=False,
           gated=True, qk_norm=True, family="qwen3")


def _catch(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"type": type(exc).__name__, "error": str(exc), "s": time.monotonic() - t0}
    return {"type": None, "error": None, "s": time.monotonic() - t0}


def _sizes_disagree(job):
    world = 4 if job.rank == 2 else 3  # rank 2 believes in a 4-rank group
    return _catch(lambda: create_refit_group(job.host, job.port, job.rank, world, "gloo",
                                             TIMEOUT_S, who=f"rank {job.rank} process"))


def test_ranks_that_disagree_on_the_group_size_all_raise_at_once(pool):
    results = pool.run(_sizes_disagree, 3, timeout_s=120)
    for res in results:
        assert res["type"] in ("RefitError", "PeerFailure"), res
        assert "disagree on the group" in res["error"] and "4 ranks" in res["error"], res
        assert res["s"] < 10, res  # not the 60 s timeout


class _Worker(MegatronReshardWorkerExtension):
    def __init__(self, model):
        self._model = model

    def get_refit_model(self):
        return self._model


def _prepare_fails_on_gen(job):
    """Gen rank (group rank 1) refuses the payload in prepare_refit; the training rank
    waits in the plan check that opens the first refit (an all-gather)."""
    full = random_hf_state_dict(CFG, seed=0)
    payload = build_plain_payload(CFG, full, {"tp_size": 1}, {"tp_size": 1}, 1, 1)
    if job.rank == 0:
        group = create_refit_group(job.host, job.port, 0, 2, "gloo", TIMEOUT_S, who="train rank 0")
        return _catch(lambda: all_gather_ints([1, 2], group, "the plan check"))
    worker = _Worker(build_vllm_like_model(CFG, 0, 1, 1, torch.bfloat16))
    worker.init_refit_groups(job.host, [job.port], 1, 2, "gloo", TIMEOUT_S)
    payload["gen_tp_size"] = 3  # the vLLM side disagrees with the payload
    out = _catch(lambda: worker.prepare_refit(payload))
    time.sleep(2)  # keep this rank's process up while its peer reads the board
    return out


def test_a_prepare_failure_on_the_generation_side_reaches_the_training_side(pool):
    train, gen = pool.run(_prepare_fails_on_gen, 2, timeout_s=120)
    assert gen["type"] == "RefitPayloadError" and "gen_tp_size 3" in gen["error"], gen
    assert train["type"] == "PeerFailure", train
    assert "generation worker at refit group rank 1" in train["error"], train
    assert "gen_tp_size 3" in train["error"] and train["s"] < 10, train


def _refit_after_failure_is_refused(job):
    group = create_refit_group(job.host, job.port, job.rank, 2, "gloo", TIMEOUT_S,
                               who=f"rank {job.rank}")
    from megatron_reshard.groups.faults import fault_scope

    if job.rank == 1:
        out = _catch(lambda: _raise_in_scope(group))
        time.sleep(2)
        return out
    first = _catch(lambda: all_gather_ints([0], group))
    second = _catch(lambda: all_gather_ints([0], group))  # the group stays failed
    return {"first": first, "second": second}


def _raise_in_scope(group):
    from megatron_reshard.groups.faults import fault_scope

    with fault_scope([group]):
        raise ValueError("bad shard on rank 1")


def test_a_failed_group_refuses_further_work(pool):
    train, other = pool.run(_refit_after_failure_is_refused, 2, timeout_s=120)
    assert other["type"] == "ValueError"
    for res in (train["first"], train["second"]):
        assert res["type"] == "PeerFailure" and "bad shard on rank 1" in res["error"], res
        assert res["s"] < 10
