"""Faults in the middle of a delta refit, with real processes (the layout of test_faults.py:
a real megatron-core model on 2 training ranks, PP2, two refit groups; 2 generation ranks,
TP2; the senders ask for deltas, end-to-end checksums on).

Refit 1 is full (no base), refit 2 a delta; in refit 3, a delta too, the victim kills
(SIGKILL) or stops (SIGSTOP) itself in the middle of the delta transport: a training rank
after cutting a seeded number of regions, a generation rank after applying a seeded number
of them (so part of its storage already holds the new bits). Every survivor fails, within
the group's timeout plus the margin, and the surviving generation rank's weight state
says exactly what it holds (every param not listed as overwritten is bit-exact at the
version it gives). A restarted training side on new refit groups then refits: the first
refit is full on every rank (the reasons: no base on the training side, and on a
surviving generation worker inconsistent weights), bit-exact, the weights consistent
again; the next one a delta, bit-exact. A bad delta (a training rank sends a region's
payload a byte short of what its header announces) is refused by its receiver before the
payload is taken, and every rank fails with that reason; the weights heal the same way.
"""

import random
import time

import pytest

import megatron_reshard.delta.encoding as delta_encoding
from megatron_reshard.tools.worlds import RankFailure
from two_worlds import (FAULT_MARGIN_S, FAULT_TIMEOUT_S, check_all_or_nothing, delta_pp2_sender,
                        gen_outcome, nudge_sparsely, prepared_worker, publish_reference,
                        run_two_worlds, strike)

pytestmark = pytest.mark.slow

TRAIN, GEN = 2, 2      # processes per side
_GEN_STATE: dict = {}  # per generation worker process: model, worker (kept across jobs)


def _arm(plan, control, step, what: str) -> None:
    """In the victim process: kill or stop it inside the delta transport's ``what``
    (``encode`` on a training rank, ``apply`` on a generation rank) at refit
    ``plan["at_refit"]``, after a seeded number of regions."""
    inner = getattr(delta_encoding, what)
    after = random.Random(plan["seed"]).randrange(1, 6)
    seen = {"n": 0}

    def hooked(*args):
        if step() == plan["at_refit"]:
            seen["n"] += 1
            if seen["n"] > after and plan["fault"] == "lie":
                count, enc, payload = inner(*args)
                if count and enc != delta_encoding.DENSE and not seen.get("lied"):  # 1 byte short
                    seen["lied"] = True
                    control.set("fault_at", repr(time.time()))
                    return count, enc, payload[:-1]
                return count, enc, payload
            if seen["n"] > after:
                strike(control, plan["fault"])
        return inner(*args)

    setattr(delta_encoding, what, hooked)


def _train(job, control, rank, plan):
    model, source, family, vocab_size, sender = delta_pp2_sender(job, control, rank, GEN,
                                                                 FAULT_TIMEOUT_S)
    step = {"k": 0}
    if plan.get("victim") == job.rank:
        _arm(plan, control, lambda: step["k"], "encode")
    rows = []
    for k in range(1, plan["refits"] + 1):
        step["k"] = k
        nudge_sparsely(model, plan["tag_seed"] * 100 + k)
        publish_reference(job, control, model, family, vocab_size, source.hf_config, k, GEN)
        try:
            out = sender.refit()
        except Exception as exc:  # noqa: BLE001 - what a survivor saw is the test's subject
            return {"failed_at": time.time(), "error": f"{type(exc).__name__}: {exc}",
                    "refits": k - 1, "rows": rows}
        rows.append({"mode": out["mode"], "full_reason": out["full_reason"]})
    return {"refits": plan["refits"], "error": None, "rows": rows}


def _gen(job, control, gen_rank, plan):
    worker, model, _ = prepared_worker(job, control, gen_rank, GEN, TRAIN, FAULT_TIMEOUT_S,
                                       {"verify_checksums": True}, _GEN_STATE,
                                       fresh=plan.get("fresh_gen", False))
    step = {"k": 0}
    if plan.get("victim") == job.rank:
        _arm(plan, control, lambda: step["k"], "apply")
    error, failed_at, rows = None, None, []
    for k in range(1, plan["refits"] + 1):
        step["k"] = k
        try:
            out = worker.refit()
        except Exception as exc:  # noqa: BLE001
            error, failed_at = f"{type(exc).__name__}: {exc}", time.time()
            break
        rows.append({"mode": out["mode"], "full_reason": out["full_reason"]})
    return {"error": error, "failed_at": failed_at, "refits": len(rows), "rows": rows,
            **gen_outcome(control, gen_rank, worker, model, plan["refits"])}


def _run(pool, timeout_s=240, settle_s=None, **plan):
    plan = {"refits": 4, "at_refit": 3, "seed": 0, "tag_seed": 0, **plan}
    return run_two_worlds(pool, TRAIN, GEN, _train, _gen, plan, num_ports=3, timeout_s=timeout_s,
                          grace_s=25, settle_s=settle_s, return_failures=True)


def test_a_delta_that_does_not_fit_its_box_is_refused_on_every_rank(pool):
    # training rank 1 sends one region's payload a byte short of what its header announces
    results = _run(pool, victim=1, fault="lie", seed=5, tag_seed=5, fresh_gen=True)
    errors = {r: results[r]["error"] for r in range(TRAIN + GEN)}
    assert all(e is not None and results[r]["refits"] == 2 for r, e in errors.items()), errors
    # the receiver of that region names it (param, ranks, box, announced and expected
    # sizes); every other rank fails with that reason (the fault board)
    for r, error in errors.items():
        assert "does not fit" in error and "payload bytes, expected" in error, (r, error)
    assert any(e.startswith("DeltaTransportError") for e in errors.values()), errors
    for r in range(TRAIN, TRAIN + GEN):
        check_all_or_nothing(results[r])
    results = _run(pool, refits=2, tag_seed=15, victim=None, fault=None)
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert [row["mode"] for row in gen["rows"]] == ["full", "delta"], gen["rows"]
        assert set(gen["versions"][2]) == set(gen["names"])


@pytest.mark.parametrize("victim,fault,seed", [(1, "kill", 1), (3, "kill", 2), (1, "stop", 3),
                                               (2, "stop", 4)])
def test_a_fault_mid_delta_fails_every_survivor_and_a_full_refit_restores_consistency(
        pool, victim, fault, seed):
    results = _run(pool, victim=victim, fault=fault, seed=seed, tag_seed=seed, fresh_gen=True,
                   timeout_s=60 if fault == "stop" else 240,
                   settle_s=1.0 if fault == "stop" else None)
    assert isinstance(results[victim], RankFailure), results[victim]
    survivors = [r for r in range(TRAIN + GEN) if r != victim]
    fault_at = next(results[r]["fault_at"] for r in range(TRAIN, TRAIN + GEN) if r != victim)
    assert fault_at is not None
    for r in survivors:
        res = results[r]
        assert not isinstance(res, RankFailure), res
        assert res["error"] is not None and res["refits"] == 2, res
        # refit 1 full (no base yet), refit 2 a delta: the fault hit a delta refit
        assert [row["mode"] for row in res["rows"]] == ["full", "delta"], res["rows"]
        assert res["failed_at"] - fault_at < FAULT_TIMEOUT_S + FAULT_MARGIN_S, (r, res["error"])
    for r in survivors:
        if r >= TRAIN:
            gen = results[r]
            assert gen["state"]["started_from"] == 2, gen["state"]
            check_all_or_nothing(gen)

    # a restarted training side on new refit groups; the surviving generation workers keep
    # their model (the victim's replacement starts from a fresh one)
    results = _run(pool, refits=2, tag_seed=seed + 10, victim=None, fault=None)
    for r in range(TRAIN + GEN):
        res = results[r]
        assert not isinstance(res, RankFailure) and res["error"] is None, res
        assert [row["mode"] for row in res["rows"]] == ["full", "delta"], res["rows"]
        assert "holds no base" in res["rows"][0]["full_reason"], res["rows"][0]
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["state"]["state"] == "consistent" and gen["state"]["overwritten"] == []
        assert set(gen["versions"][2]) == set(gen["names"]), gen["versions"]  # bit-exact
