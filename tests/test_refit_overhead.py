"""What a steady-state refit does beyond moving bytes (issue 51 item 4), with real
processes: a real megatron-core model on a training rank and the worker extension over a
vLLM-layout model on a generation rank, one colocated refit group over gloo (the bench
``scripts/bench_refit_overhead.py``'s own job, a few refits). Each refit is bit-exact,
takes exactly two collective round trips (the version vote and the commit vote) and no
store round trip, waits for its votes on the calling thread when the peer is there, and
walks no module tree of a model without MLA layers. A vote whose peer is gone still fails loudly, not in a hang."""

import time

import pytest

from megatron_reshard.tools.bench.refit_overhead import _job
from megatron_reshard.tools.worlds import RankFailure

pytestmark = pytest.mark.slow

PLAN = {"preset": "moe", "overrides": {}, "refits": 8, "warmup": 2, "trips": 3, "profile": 0}


def test_a_steady_state_refit_is_exact_with_two_votes_and_no_walks_or_hand_offs(pool):
    train, gen = pool.run(_job, 2, PLAN, num_ports=2, timeout_s=240)
    assert gen["wrong"] == [] and gen["params"] > 0  # every vLLM param bit-exact
    for side in (train, gen):
        assert len(side["calls"]) == PLAN["refits"]
        for calls in side["calls"]:
            # the version vote and the commit vote: nothing else crosses the network
            assert {k: v for k, v in calls.items()
                    if k in ("allreduce", "allgather", "broadcast", "send", "recv")} == \
                {"allreduce": 2}, calls
        # the group's store (fault board, colocated tables) is not asked: a refit whose
        # ranks all arrive in time reads no board
        assert min(c.get("store call", 0) for c in side["calls"]) == 0, side["calls"]
        # a vote whose peer is there is waited for on the calling thread: in some refit
        # neither vote went to a waiter thread (the old code handed every vote over)
        assert min(c.get("waiter hand-off", 0) for c in side["calls"]) < 2, side["calls"]
    # no MLA layer (no kv_b_proj): the derived refresh does not walk vLLM's modules
    assert all(c.get("module walk", 0) == 0 for c in gen["calls"]), gen["calls"]
    assert all(r["derived"] < 1e-3 for r in gen["rows"])


def _vote_with_a_dead_peer(job):
    import os

    import torch
    import torch.distributed as dist

    from megatron_reshard.groups.collectives import all_reduce
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.groups.faults import RefitError

    group = create_refit_group(job.host, job.ports[0], job.rank, 2, "gloo", 20.0,
                               who=f"rank {job.rank}")
    vote = torch.zeros(4, dtype=torch.int64)
    all_reduce(vote, group, dist.ReduceOp.MAX, "a first vote")  # both there: completes
    if job.rank == 1:
        os._exit(0)  # gone before the second vote: its sockets close
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        all_reduce(vote, group, dist.ReduceOp.MAX, "the second vote")
    except RefitError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0,
                "retired": group.board.retired, "failed": group.board.failed}
    return {"error": None}


def test_a_vote_whose_peer_is_gone_fails_at_once_and_retires_the_group(pool):
    results = pool.run(_vote_with_a_dead_peer, 2, num_ports=1, timeout_s=60,
                       return_failures=True)
    assert isinstance(results[1], RankFailure)
    out = results[0]
    assert out["error"] is not None and "the second vote" in out["error"], out
    assert out["seconds"] < 10.0, out  # the transport's error, not the group's timeout (20 s)
    assert out["retired"] and out["failed"], out
