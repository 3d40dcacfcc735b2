"""Faults during a refit loop, with real processes: a refit completes everywhere or every
survivor says it failed, within the group's timeout plus a margin, and the generation
side's weight state says exactly which weights it holds.

Layout: a real megatron-core model (dense, Qwen3-shaped) on 2 training ranks (PP2: two
refit groups) and 2 generation ranks (TP2). A victim process kills (SIGKILL) or stops
(SIGSTOP) itself from inside a pre hook at a random param of refit 3. The generation
workers keep their model and worker object across jobs (module state of the pool's
long-lived worker processes), so a second job with a restarted training side on new
refit groups can show that a completed refit makes the weights consistent again.
"""

import time

import pytest

from megatron_reshard.engine.refit_transport import transport_of
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.tools.e2e import perturb_
from megatron_reshard.tools.worlds import RankFailure
from two_worlds import (FAULT_MARGIN_S, FAULT_TIMEOUT_S, arm_victim, check_all_or_nothing,
                        dense_pp2_source, gen_outcome, prepared_worker, publish_reference,
                        run_two_worlds, stage_group)

pytestmark = pytest.mark.slow

TRAIN, GEN = 2, 2             # processes per side
_GEN_STATE: dict = {}         # per generation worker process: model, worker (kept across jobs)
_check_all_or_nothing = check_all_or_nothing  # test_colocated imports it from here


def _train(job, control, rank, plan):
    model, source, family, vocab_size = dense_pp2_source(GEN)
    if rank == 0:
        control.set("payload", source.payload_bytes())
    group = stage_group(job, source, GEN, FAULT_TIMEOUT_S,
                        transport=plan.get("transport"))  # gen ranks follow it
    sender = RefitSender(source, group, verify_checksums=True)
    step = {"k": 0}
    if plan.get("victim") == job.rank:
        arm_victim(sender.loop, plan["fault"], plan["seed"], plan["at_refit"], control,
                   lambda: step["k"])
    for k in range(1, plan["refits"] + 1):
        step["k"] = k
        if k > 1:
            perturb_(model, k)
        publish_reference(job, control, model, family, vocab_size, source.hf_config, k, GEN)
        try:
            sender.refit()
        except Exception as exc:  # noqa: BLE001 - what a survivor saw is the test's subject
            return {"role": "train", "failed_at": time.time(),
                    "error": f"{type(exc).__name__}: {exc}", "refits": k - 1}
    return {"role": "train", "refits": plan["refits"], "error": None}


def _gen(job, control, gen_rank, plan):
    worker, model, payload = prepared_worker(job, control, gen_rank, GEN, TRAIN, FAULT_TIMEOUT_S,
                                             {"verify_checksums": True}, _GEN_STATE,
                                             fresh=plan.get("fresh_gen", False))
    step = {"k": 0}
    if plan.get("victim") == job.rank:
        arm_victim(worker.refit_worker_state.require_session().loop, plan["fault"],
                   plan["seed"], plan["at_refit"], control, lambda: step["k"])
    error, failed_at, done = None, None, 0
    for k in range(1, plan["refits"] + 1):
        step["k"] = k
        if k == plan.get("prepare_again_before"):  # a new session on groups that refitted
            worker.prepare_refit(payload, {"verify_checksums": True})
        try:
            worker.refit()
            done = k
        except Exception as exc:  # noqa: BLE001
            error, failed_at = f"{type(exc).__name__}: {exc}", time.time()
            break
    transports = sorted({transport_of(g).name
                         for g in worker.refit_worker_state.groups.values()})
    return {"role": "gen", "error": error, "failed_at": failed_at, "refits": done,
            "transports": transports, "report": worker.report(),
            **gen_outcome(control, gen_rank, worker, model, plan["refits"])}


def _run(pool, timeout_s=240, settle_s=None, **plan):
    plan = {"refits": 4, "at_refit": 3, "seed": 0, **plan}
    t0 = time.time()
    results = run_two_worlds(pool, TRAIN, GEN, _train, _gen, plan, num_ports=3,
                             timeout_s=timeout_s, grace_s=25, settle_s=settle_s,
                             return_failures=True)
    return results, time.time() - t0


# every fault test runs over both transports: process-group P2P and colocated (mapped memory)
@pytest.mark.parametrize("seed,transport", [(1, "p2p"), (2, "p2p"), (1, "colocated")])
def test_killed_training_rank_fails_every_survivor_and_a_restart_restores_consistency(
        pool, seed, transport):
    results, _ = _run(pool, victim=1, fault="kill", seed=seed, fresh_gen=True,
                      transport=transport)
    assert isinstance(results[1], RankFailure) and "died" in results[1].text
    fault_at = None
    for r in (0, 2, 3):
        res = results[r]
        assert not isinstance(res, RankFailure), res
        assert res["error"] is not None and res["refits"] == 2, res
        assert "train rank 1" in res["error"] or "exited" in res["error"] or \
            "closed" in res["error"], res["error"]
    # the kill time is stored by the victim in the control store; survivors failed soon after
    for r in (2, 3):
        gen = results[r]
        assert gen["state"]["state"] == "inconsistent", gen["state"]
        assert gen["state"]["version"] == 2 and gen["state"]["started_from"] == 2
        assert gen["state"]["overwritten"], gen["state"]
        _check_all_or_nothing(gen)
        assert gen["report"]["groups_usable"] is False
    fault_at = results[2]["fault_at"]  # written by the victim just before it killed itself
    assert fault_at is not None
    for r in (0, 2, 3):  # every survivor failed soon after (a closed connection: no timeout)
        assert results[r]["failed_at"] - fault_at < FAULT_TIMEOUT_S + FAULT_MARGIN_S

    # a restarted training side on new refit groups: one completed refit, weights consistent;
    # the fresh sender's default version continues after the one the weights hold (2)
    results, _ = _run(pool, refits=1, transport=transport)
    for r in (2, 3):
        gen = results[r]
        assert gen["error"] is None and gen["state"]["state"] == "consistent", gen
        assert gen["state"]["version"] == 3 and gen["state"]["overwritten"] == []
        assert set(gen["versions"][1]) == set(gen["names"])  # every param bit-exact


@pytest.mark.parametrize("transport", ["p2p", "colocated"])
def test_killed_generation_rank_fails_every_survivor_within_the_timeout(pool, transport):
    results, _ = _run(pool, victim=3, fault="kill", seed=3, fresh_gen=True,
                      transport=transport)
    assert isinstance(results[3], RankFailure) and "died" in results[3].text
    times = []
    for r in (0, 1, 2):
        res = results[r]
        assert not isinstance(res, RankFailure), res
        assert res["error"] is not None and res["refits"] == 2, res
        times.append(res["failed_at"])
    gen = results[2]
    assert gen["state"]["version"] == 2
    _check_all_or_nothing(gen)
    assert max(times) - gen["fault_at"] < FAULT_TIMEOUT_S + FAULT_MARGIN_S


@pytest.mark.parametrize("transport", ["p2p", "colocated"])
def test_stopped_training_rank_makes_survivors_time_out(pool, transport):
    # survivors return their errors; the stopped rank is killed a second after the last of
    # them has (a stopped process never returns), or when the job times out (45 s)
    results, elapsed = _run(pool, victim=1, fault="stop", seed=4, fresh_gen=True, timeout_s=45,
                            settle_s=1.0, transport=transport)
    assert isinstance(results[1], RankFailure) and "killed" in results[1].text
    for r in (0, 2, 3):
        res = results[r]
        assert not isinstance(res, RankFailure), res
        assert res["error"] is not None and res["refits"] == 2, res
    errors = " | ".join(results[r]["error"] for r in (0, 2, 3))
    # the stopped rank hosts stage 1's store: its peers find the store or the data late
    assert "timeout" in errors.lower() or "timed out" in errors.lower() or \
        "unreachable" in errors, errors
    for r in (0, 2, 3):
        assert results[r]["failed_at"] - results[2]["fault_at"] < FAULT_TIMEOUT_S + FAULT_MARGIN_S
    for r in (2, 3):
        _check_all_or_nothing(results[r])
