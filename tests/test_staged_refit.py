"""Staged refits (issue 53) with real processes: a real megatron-core model (dense, PP2: two
refit groups) on 2 training ranks, 2 generation ranks (TP2) whose worker extension was
prepared with ``{"staged": True}``; gloo, end-to-end checksums on.

Each refit: the generation rank starts the staged refit (its own thread), reads its live
params while the transfer runs (they must stay at version N: the ``generation side``), waits
until it is staged, checks the live params are still N, flips, and checks every param is
bit-exact at N+1 against the reference (full HF tensors sliced by vLLM's layout). Faults at
every phase (a training rank killed mid-transfer, a training rank killed at the commit
vote, a checksum mismatch voted down, a generation peer killed mid-transfer, a discard)
leave the live weights consistent at N, bit-exact, on every surviving generation rank.
The blocking ``refit()`` of a staged session stages and flips in one call.
"""

import json
import time
from datetime import timedelta

import pytest

from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.refit import loop as refit_loop, protocol
from megatron_reshard.tools.e2e import perturb_
from megatron_reshard.tools.worlds import RankFailure
from two_worlds import (FAULT_TIMEOUT_S, arm_victim, dense_pp2_source, gen_outcome, live_digests,
                        nudge_sparsely, prepared_worker, publish_reference, run_two_worlds,
                        stage_group, strike)

pytestmark = pytest.mark.slow

TRAIN, GEN = 2, 2      # processes per side
_GEN_STATE: dict = {}  # per generation worker process: model, worker (kept across jobs)


def _kill_at_vote(control, step, at_refit):
    """In a training victim: SIGKILL itself when refit ``at_refit`` reaches its commit vote
    (every byte of it already sent)."""
    inner = protocol.commit_refit

    def vote(*args, **kwargs):
        if step() == at_refit:
            strike(control, "kill")
        return inner(*args, **kwargs)

    protocol.commit_refit = vote


def _mismatch_at(step, at_refit):
    """In a generation victim: its end-to-end checksum check reports one mismatch at refit
    ``at_refit`` (what a corrupted byte on the wire would give): the vote fails everywhere.
    Returns the undo (the pool's processes outlive the job)."""
    inner = refit_loop.StageChecksums.check

    def check(self):
        found = inner(self)
        return found + ["injected"] if step() == at_refit else found

    refit_loop.StageChecksums.check = check
    return lambda: setattr(refit_loop.StageChecksums, "check", inner)


def _train(job, control, rank, plan):
    model, source, family, vocab_size = dense_pp2_source(GEN)
    if rank == 0:
        control.set("payload", source.payload_bytes())
    sender = RefitSender(source, stage_group(job, source, GEN, FAULT_TIMEOUT_S),
                         verify_checksums=True, delta=plan["delta"])
    step = {"k": 0}
    if plan.get("victim") == job.rank and plan["fault"] == "kill_mid":
        arm_victim(sender.loop, "kill", plan["seed"], plan["at_refit"], control,
                   lambda: step["k"])
    if plan.get("victim") == job.rank and plan["fault"] == "kill_vote":
        _kill_at_vote(control, lambda: step["k"], plan["at_refit"])
    rows = []
    for k in range(1, plan["refits"] + 1):
        step["k"] = k
        if k > 1:
            (nudge_sparsely(model, 100 * plan["seed"] + k) if plan["delta"]
             else perturb_(model, 100 * plan["seed"] + k))
        publish_reference(job, control, model, family, vocab_size, source.hf_config, k, GEN)
        # the generation ranks started their staged refit and read their live weights first
        control.wait([f"started/{k}/{g}" for g in range(GEN)], timedelta(seconds=60))
        try:
            out = sender.refit()
        except Exception as exc:  # noqa: BLE001 - what a survivor saw is the test's subject
            return {"error": f"{type(exc).__name__}: {exc}", "refits": k - 1, "rows": rows}
        rows.append({"mode": out["mode"], "version": out.get("version")})
    return {"error": None, "refits": plan["refits"], "rows": rows}


def _gen(job, control, gen_rank, plan):
    options = {"verify_checksums": True, "staged": True}
    if plan.get("budget") is not None:
        options["staging_budget_bytes"] = plan["budget"]
    if plan.get("host_budget") is not None:  # tests/test_staged_delta.py: the host tier
        options["host_staging_budget_bytes"] = plan["host_budget"]
    if plan.get("delta_flip") is not None:   # ... and how a delta refit flips
        options["staged_delta_flip"] = plan["delta_flip"]
    worker, model, _ = prepared_worker(job, control, gen_rank, GEN, TRAIN, FAULT_TIMEOUT_S,
                                       options, _GEN_STATE, fresh=plan.get("fresh_gen", False))
    step = {"k": 0}
    if plan.get("victim") == job.rank and plan["fault"] == "kill_mid":
        arm_victim(worker.refit_worker_state.require_session().loop, "kill", plan["seed"],
                   plan["at_refit"], control, lambda: step["k"])
    if plan.get("victim") == job.rank and plan["fault"] == "checksum":
        undo = _mismatch_at(lambda: step["k"], plan["at_refit"])
        try:
            return _staged_refits(control, plan, gen_rank, worker, model, step)
        finally:
            undo()
    return _staged_refits(control, plan, gen_rank, worker, model, step)


def _staged_refits(control, plan, gen_rank, worker, model, step):
    """The generation rank's refits (see module doc); what it saw, per refit."""

    def live() -> dict:
        return live_digests(model)

    def want(k) -> dict:
        return json.loads(control.get(f"expected/{k}/{gen_rank}"))

    rows, error = [], None
    for k in range(1, plan["refits"] + 1):
        step["k"] = k
        before = live()  # version k - 1 (or what was loaded)
        control.wait([f"expected/{k}/{gen_rank}"], timedelta(seconds=60))
        if plan.get("blocking_at") == k:  # refit() of a staged session: stage, then flip
            control.set(f"started/{k}/{gen_rank}", "1")
            out = worker.refit()
            expected = want(k)
            rows.append({"k": k, "blocking": True, "version": out["version"],
                         "flip": out["staged"], "exact": sorted(
                             n for n, d in live().items() if expected.get(n) == d)})
            continue
        started = worker.start_staged_refit()
        row = {"k": k, "phase_at_start": started["phase"], "reads": 0, "reads_receiving": 0,
               "live_changed_before_flip": []}
        first = True
        while True:  # generation's reads of the live weights while the transfer runs
            phase = worker.refit_weights_state()["staged"]["phase"]
            changed = [n for n, d in live().items() if d != before[n]]
            row["live_changed_before_flip"] += changed
            row["reads"] += 1
            row["reads_receiving"] += phase == "receiving"
            if first:
                control.set(f"started/{k}/{gen_rank}", "1")
                first = False
            if phase != "receiving":
                break
            time.sleep(0.01)
        try:
            state = worker.wait_staged_refit(timeout_s=120)
            row["waited_phase"] = state["phase"]
            row["staged_version"] = state["staged_version"]
            row["in_place_params"] = state["in_place_params"]
            row["staging_bytes"] = state["staging_bytes"]
            # staged: the live params are still version k - 1, all of them
            row["live_changed_before_flip"] += [n for n, d in live().items() if d != before[n]]
            if plan.get("discard_at") == k:
                row["discarded"] = worker.discard_staged_refit()["phase"]
                row["after_discard"] = [n for n, d in live().items() if d != before[n]]
                rows.append(row)
                continue
            out = worker.flip_staged_refit()
        except Exception as exc:  # noqa: BLE001 - the fault's outcome is the test's subject
            error = f"{type(exc).__name__}: {exc}"
            row["live_changed_before_flip"] += [n for n, d in live().items() if d != before[n]]
            rows.append(row)
            break
        row.update(mode=out["mode"], version=out["version"], flip=out["staged"])
        expected = want(k)
        row["exact"] = sorted(n for n, d in live().items() if expected.get(n) == d)
        rows.append(row)
    return {"error": error, "rows": rows,
            **gen_outcome(control, gen_rank, worker, model, plan["refits"])}


def _run(pool, timeout_s=240, **plan):
    plan = {"refits": 2, "delta": False, "seed": 0, "fault": None, "victim": None,
            "at_refit": 2, "fresh_gen": True, **plan}
    return run_two_worlds(pool, TRAIN, GEN, _train, _gen, plan, num_ports=3, timeout_s=timeout_s,
                          grace_s=25, return_failures=True)


def _check_row_exact(gen, row):
    assert row["live_changed_before_flip"] == [], row  # generation saw version N throughout
    assert row["reads_receiving"] >= 1, row           # ... while the transfer ran
    assert set(row["exact"]) == set(gen["names"]), sorted(set(gen["names"]) - set(row["exact"]))


@pytest.mark.parametrize("delta", [False, True])
def test_staged_refits_are_bit_exact_after_the_flip_and_invisible_before(pool, delta):
    results = _run(pool, refits=4, delta=delta, seed=1 + delta, blocking_at=4)
    for r in range(TRAIN):
        assert results[r]["error"] is None, results[r]
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["error"] is None, gen
        blocking = gen["rows"].pop()  # the last one through refit(): staged, flipped at once
        assert blocking["version"] == 4 and blocking["flip"]["phase"] == "idle", blocking
        assert set(blocking["exact"]) == set(gen["names"])
        for row in gen["rows"]:
            _check_row_exact(gen, row)
            assert row["waited_phase"] == "staged" and row["in_place_params"] == []
            assert row["staging_bytes"] > 0
            if row["mode"] == "full":  # a delta flip writes less (tests/test_staged_delta.py)
                assert row["flip"]["flip_bytes"] == row["staging_bytes"]
        assert [row["version"] for row in gen["rows"]] == [1, 2, 3]
        want_modes = ["full", "delta", "delta"] if delta else ["full"] * 3
        assert [row["mode"] for row in gen["rows"]] == want_modes, gen["rows"]
        state = gen["state"]
        assert state["state"] == "consistent" and state["version"] == 4
        assert state["staged"]["phase"] == "idle" and state["staged"]["staged_version"] is None


def test_a_budget_applies_what_does_not_fit_in_place_inside_the_pause(pool):
    results = _run(pool, refits=2, seed=3, budget=64 * 1024)
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["error"] is None, gen
        for row in gen["rows"]:
            # what does not fit waits for the flip; the live weights stay N until then
            assert row["in_place_params"] and row["waited_phase"] == "waiting_for_pause", row
            assert row["staging_bytes"] <= 64 * 1024
            _check_row_exact(gen, row)
            assert row["flip"]["in_place_bytes"] > 0
        assert gen["state"]["state"] == "consistent" and gen["state"]["version"] == 2


def _survivors_hold_n(results, victim, n):
    for r in range(TRAIN, TRAIN + GEN):
        if r == victim:
            continue
        gen = results[r]
        assert not isinstance(gen, RankFailure), gen
        assert gen["error"] is not None and "live weights are consistent at version" \
            in gen["error"], gen["error"]
        failed = gen["rows"][-1]
        assert failed["k"] == n + 1 and failed["live_changed_before_flip"] == [], failed
        state = gen["state"]
        assert state["state"] == "consistent" and state["version"] == n, state
        assert state["overwritten"] == [] and state["staged"]["phase"] == "failed", state
        assert set(gen["versions"][n]) == set(gen["names"])  # every live param bit-exact at N


@pytest.mark.parametrize("victim,fault", [(1, "kill_mid"), (1, "kill_vote"), (3, "kill_mid")])
def test_a_killed_peer_at_any_phase_leaves_version_n_live_and_consistent(pool, victim, fault):
    results = _run(pool, refits=2, seed=4 + victim, victim=victim,
                   fault=fault, delta=fault == "kill_vote")
    assert isinstance(results[victim], RankFailure), results[victim]
    _survivors_hold_n(results, victim, 1)


def test_a_checksum_mismatch_voted_down_leaves_n_live_and_consistent(pool):
    results = _run(pool, refits=2, seed=7, victim=2, fault="checksum")
    for r in range(TRAIN + GEN):
        assert not isinstance(results[r], RankFailure), results[r]
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert "checksums differ" in gen["error"], gen["error"]
        assert gen["rows"][-1]["live_changed_before_flip"] == []
        assert gen["state"]["state"] == "consistent" and gen["state"]["version"] == 1
        assert set(gen["versions"][1]) == set(gen["names"])


def test_a_discarded_staged_version_leaves_n_live_and_the_next_refit_is_full(pool):
    results = _run(pool, refits=3, delta=True, seed=8, discard_at=2)
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["error"] is None, gen
        rows = gen["rows"]
        assert rows[1]["discarded"] == "idle" and rows[1]["after_discard"] == []
        assert rows[2]["mode"] == "full", rows  # the staging held a base vLLM never served
        _check_row_exact(gen, rows[2])
        assert gen["state"]["version"] == 3 and gen["state"]["state"] == "consistent"
