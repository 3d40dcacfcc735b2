"""What a steady-state refit does beyond moving bytes (issue 51 item 4), with real
processes: a real megatron-core model on a training rank and the worker extension over a
vLLM-layout model on a generation rank, one colocated refit group over gloo (the bench
``scripts/bench_refit_overhead.py``'s own job, a few refits). Each refit is bit-exact,
takes exactly two collective round trips (the version vote and the commit vote) and no
store round trip, waits for its votes on the calling thread when the peer is there, and
walks no module tree of a model without MLA layers. A vote whose peer is gone still fails loudly, not in a hang."""

import time

import pytest

from megatron_reshard.tools.bench.refit_overhead import _job, report
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
    text = report(train, gen)  # what the bench prints of this run
    assert "2 collective round trips (allreduce 2)" in text and "0 walks" in text, text
    assert "bit-exact against the reference: yes" in text, text


def _vote_with_a_dead_peer(job):
    import gc
    import os
    import threading
    import weakref

    import torch
    import torch.distributed as dist

    from megatron_reshard.groups.collectives import all_reduce
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.groups.faults import RefitError, RefitTimeout

    group = create_refit_group(job.host, job.ports[0], job.rank, 2, "gloo", 3.0,
                               who=f"rank {job.rank}")
    vote = torch.zeros(4, dtype=torch.int64)
    all_reduce(vote, group, dist.ReduceOp.MAX, "a first vote")  # both there: completes
    if job.rank == 0:
        group.store.set("first vote done", "1")
    else:  # gone before the second vote (not before rank 0 has the first): sockets close
        group.store.wait(["first vote done"])
        os._exit(0)
    time.sleep(0.5)
    gc.collect()
    gc.disable()  # the failed group must go without the cyclic collector (issue 52)
    holds_before = set(threading.enumerate())
    try:
        try:
            all_reduce(vote, group, dist.ReduceOp.MAX, "the second vote")
            out = {"error": None}
        except RefitError as exc:
            out = {"error": str(exc), "timed_out": isinstance(exc, RefitTimeout),
                   "retired": group.board.retired, "failed": group.board.failed}
        ref = weakref.ref(group)
        destroy_refit_group(group, timeout_s=2.0)
        del group
        for thread in threading.enumerate():  # this group's retirement hold (timeout + 5 s);
            # not those of earlier tests' groups in this reused worker (up to their timeouts)
            if thread.name == "refit-retired-group" and thread not in holds_before:
                thread.join(60.0)
        out["group_alive"] = ref() is not None
    finally:
        gc.enable()
    return out


def test_a_vote_whose_peer_is_gone_fails_at_once_and_lets_the_group_go(pool):
    # rank 1's exit is the pool's "first failure"; rank 0 then still waits out the vote's
    # error, the destroy and the retired group's hold (the group's timeout + 5 s): under a
    # loaded CI that went past the pool's default 15 s grace
    results = pool.run(_vote_with_a_dead_peer, 2, num_ports=1, timeout_s=90, grace_s=75,
                       return_failures=True)
    assert isinstance(results[1], RankFailure)
    out = results[0]
    assert not isinstance(out, RankFailure), out  # rank 0 raised past the vote: its trace
    assert out["error"] is not None and "the second vote" in out["error"], out
    # the transport's error, reported at once, not the group's timeout running out
    assert "failed in the transport" in out["error"] and not out["timed_out"], out
    assert out["retired"] and out["failed"], out
    assert not out["group_alive"], out


# ------------------------------------------------- a hook-free batch kept across refits


def _recording_loop():
    """A destination-side loop over 9 hook-free params, one batch, whose engine calls are
    recorded (no peers: the plan check is taken as done)."""
    import torch

    from megatron_reshard.refit.loop import RefitLoop
    from megatron_reshard.refit.order import stage_params
    from megatron_reshard.testing.groups import NoCommGroup
    from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info
    from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec

    meta = {f"model.layers.{i}.mlp.{proj}.weight":
            {"shape": [8, 4] if proj != "down_proj" else [4, 8], "dtype": "torch.float32"}
            for i in range(3) for proj in ("gate_proj", "up_proj", "down_proj")}
    info = build_nccl_reshard_refit_info(meta, {"tp_size": 2}, {"tp_size": 2}, 2, 2)
    specs = HFToLocalParamMap({p.name: LocalParamSpec(base=torch.zeros(4, 4))
                               for p in stage_params(info)[0]})
    calls = []
    loop = RefitLoop(info, specs, "dst", {0: NoCommGroup(3, 4)},
                     xfer_batch=lambda transfers, group, **kw: calls.append(list(transfers)))
    loop._verified = True
    return loop, specs, calls


def test_a_hook_free_batch_is_handed_over_again_and_follows_its_specs():
    import torch

    from megatron_reshard.wire.spec import RefitCtx

    loop, specs, calls = _recording_loop()
    first = loop.run()
    loop.run()
    assert len(calls) == 2 and len(calls[0]) == 9
    # the same transfers, over the same tensors: not rebuilt per refit
    assert all(a is b for a, b in zip(calls[0], calls[1]))
    assert loop.run().local_bytes == first.local_bytes == 9 * 4 * 4 * 4
    name = "model.layers.1.mlp.up_proj.weight"
    spec = specs.specs[name]
    # a tensor put in a spec later is the one written
    spec.base = fresh = torch.zeros(4, 4)
    loop.run()
    assert next(t.dst for t in calls[-1] if t.name == name) is fresh
    # a pre hook set later runs, and its buffer is the one written; post hooks run
    bounce, posted = torch.zeros(4, 4), []
    spec.pre = lambda base: RefitCtx(buf=bounce)
    spec.post = lambda ctx: posted.append(ctx.buf)
    loop.run()
    assert next(t.dst for t in calls[-1] if t.name == name) is bounce and posted == [bounce]
    spec.pre = spec.post = None
    loop.run()
    assert next(t.dst for t in calls[-1] if t.name == name) is fresh and posted == [bounce]
