"""A short soak (issue 52): a few dozen refits between a long-lived training world (real
megatron-core, dense then MoE, Adam steps) and a generation world (TP2), a handful of
faults from a fixed seed at random phases, every invariant checked after every refit and
fault (``megatron_reshard.tools.soak``); plus the checks themselves on hand-made replies,
so that each can be seen to fail."""

import pytest

from megatron_reshard.tools.soak import FAULTS, ISSUE_50, SoakConfig, run_soak
from megatron_reshard.tools.soak_checks import (Tally, check_delta_base, check_survivor,
                                                check_version, check_weights, slope)

pytestmark = pytest.mark.slow

REFITS, FAULTS_WANTED = 24, 8


@pytest.fixture(scope="module")
def report():
    # checksums off (the README's default): a delta over a base written behind the
    # library's back then stays silent until issue 50 is fixed, which the soak must see
    cfg = SoakConfig(refits=REFITS, faults=FAULTS_WANTED, seed=3, gen=2, timeout_s=5.0,
                     models=("dense", "moe"), switch_every=12, sample_every=4, ckpt_every=3,
                     kinds=FAULTS, checksums="off", quiet=True,
                     settle_samples=False)  # the leak figures are the long soak's
    return run_soak(cfg)


def _violations_after(report, causes_excluded=(), only=None):
    out = {}
    for counter, by_cause in report["violations_by_fault"].items():
        for cause, n in by_cause.items():
            base = cause.split()[0]
            if base in causes_excluded or (only is not None and base not in only):
                continue
            out[(counter, cause)] = n
    return out


def test_a_short_soak_runs_its_refits_and_faults_and_breaks_no_invariant(report):
    assert report["aborted"] is None, report["aborted"]
    assert report["refits"] >= REFITS and report["faults"] >= FAULTS_WANTED, report
    assert report["modes"].get("full") and report["modes"].get("delta"), report["modes"]
    c = report["counters"]
    assert c["weights_exact"] > REFITS and c["versions_checked"] > REFITS, c
    assert c["survivor_in_time"] > 0 and c["survivor_named_cause"] == c["survivor_in_time"], c
    assert report["hangs"] == 0, report["examples"]
    # every invariant held, except what follows issue 50's two faults (next test)
    assert _violations_after(report, causes_excluded=ISSUE_50) == {}, report["examples"]
    # leak samples were taken on every long-lived rank
    assert {"gen", "train"} <= set(report["leaks"]), report["leaks"]
    assert all("fds" in leak["figures"] and "threads" in leak["figures"]
               for leak in report["leaks"].values())


@pytest.mark.xfail(strict=True, reason="issue 50 (fixed on the trust-core branch): params "
                   "moved to new memory, and a delta over a base written behind the library's "
                   "back, end consistent over wrong bytes; remove this mark once it is merged")
def test_issue_50_faults_leave_no_silent_outcome(report):
    assert report["faults_by_kind"].get("params_moved") or report["faults_by_kind"].get("tamper_gen")
    assert _violations_after(report, only=ISSUE_50) == {}, report["examples"]


# ----------------------------------------------------------- the checks on hand-made replies

REFS = {3: {0: {"a": "x3", "b": "y3"}}, 4: {0: {"a": "x4", "b": "y4"}}}


def _reply(state, version, after, overwritten=(), before=None, mode="full"):
    return {"state": {"state": state, "version": version, "started_from": version,
                      "overwritten": list(overwritten)}, "after": after,
            "before": before or {}, "mode": mode}


def test_a_consistent_state_over_other_bytes_is_counted_silent():
    tally = Tally()
    assert check_weights(tally, 0, _reply("consistent", 4, {"a": "x4", "b": "y4"}), REFS, (), None, "t")
    assert not check_weights(tally, 0, _reply("consistent", 4, {"a": "x4", "b": "y3"}), REFS, (),
                             "tamper_gen", "t")
    assert tally.counts["silent_wrong_weights"] == 1 and tally.counts["weights_exact"] == 1
    assert tally.silent_by_fault == {"tamper_gen": 1}
    assert tally.violations() == {"silent_wrong_weights": 1}


def test_an_inconsistent_state_must_keep_what_it_does_not_list():
    tally = Tally()
    # b overwritten and listed: fine; a unlisted but changed: the state lies
    assert check_weights(tally, 0, _reply("inconsistent", 3, {"a": "x3", "b": "zz"}, ["b"]),
                         REFS, (), None, "t")
    assert not check_weights(tally, 0, _reply("inconsistent", 3, {"a": "zz", "b": "y3"}, ["b"]),
                             REFS, (), None, "t")
    # unless the soak wrote it itself behind the library's back
    assert check_weights(tally, 0, _reply("inconsistent", 3, {"a": "zz", "b": "y3"}, ["b"]),
                         REFS, {"a"}, None, "t")
    assert tally.counts["inconsistent_state_wrong"] == 1


def test_versions_delta_bases_and_survivors_are_checked():
    tally = Tally()
    assert check_version(tally, 4, {"version": 5}, "t") == 5
    check_version(tally, 5, {"version": 4}, "t")
    assert tally.counts["version_decreased"] == 1
    check_delta_base(tally, 0, _reply("consistent", 4, {}, before={"a": "x3", "b": "y3"},
                                      mode="delta"), REFS, 3, "t")
    check_delta_base(tally, 0, _reply("consistent", 4, {}, before={"a": "x3", "b": "y9"},
                                      mode="delta"), REFS, 3, "t")
    assert tally.counts["delta_onto_wrong_base"] == 1 and tally.counts["delta_base_checked"] == 1
    check_survivor(tally, "gen0", {"error": "PeerFailure: train rank 0 failed", "at": 11.0}, 10.0,
                   5.0, "t")
    check_survivor(tally, "gen1", {"error": "RefitTimeout: gave no sign of life", "at": 21.0},
                   10.0, 5.0, "t")
    check_survivor(tally, "gen1", {"error": "RuntimeError: boom", "at": 10.5}, 10.0, 5.0, "t")
    check_survivor(tally, "train", None, 10.0, 5.0, "t")
    assert tally.counts["survivor_late"] == 1 and tally.counts["survivor_no_cause"] == 1
    assert tally.counts["survivor_no_error"] == 1 and tally.counts["survivor_in_time"] == 2


def test_leak_slope_is_least_squares():
    assert slope([(0, 1.0), (10, 2.0), (20, 3.0)]) == pytest.approx(0.1)
    assert slope([(0, 1.0), (10, 1.0)]) is None
