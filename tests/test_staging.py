"""``receiver.staging`` in one process: the budget's first fit, the options' checks, and the
staged refit's phases around a session that writes as ``ReceiverSession.refit`` does (it
announces each batch to its weight state, writes its targets, then commits). The refit
itself, over real groups and a real megatron-core model, is tests/test_staged_refit.py."""

import threading

import pytest
import torch

from megatron_reshard.errors import BadInputError, CallOrderError
from megatron_reshard.receiver.staging import (StagedRefitError, StagedRefits, StagedRefitTimeout,
                                               plan_staging)
from megatron_reshard.receiver.state import WeightState
from megatron_reshard.receiver.worker_state import PrepareOptions


def test_the_budget_stages_the_longest_prefix_that_fits():
    params = {"a": torch.empty(100, dtype=torch.uint8), "b": torch.empty(50, dtype=torch.uint8),
              "c": torch.empty(20, dtype=torch.uint8)}
    assert plan_staging(params, None) == (["a", "b", "c"], [])
    assert plan_staging(params, 170) == (["a", "b", "c"], [])
    # "c" would fit after "b" is left out, but "b" is received inside the pause anyway
    assert plan_staging(params, 120) == (["a"], ["b", "c"])
    assert plan_staging(params, 0) == ([], ["a", "b", "c"])


@pytest.mark.parametrize("options,words", [
    ({"staged": "yes"}, "option staged: expected True or False, found 'yes'"),
    ({"staged": True, "staging_budget_bytes": -1}, "staging_budget_bytes: expected None or an int"),
    ({"staged": True, "staging_budget_bytes": 1.5}, "found 1.5"),
])
def test_bad_staged_options_are_named(options, words):
    with pytest.raises(BadInputError, match=words.replace("(", r"\(").replace(".", r"\.")):
        PrepareOptions.of(options)


def test_the_staged_options_are_the_workers_not_the_sessions():
    checked = PrepareOptions.of({"staged": True, "staging_budget_bytes": 10})
    assert checked.staged and checked.staging_budget_bytes == 10
    assert "staged" not in checked.session_options()
    assert "staging_budget_bytes" not in checked.session_options()


class _Writer:
    """Writes ``value`` into its targets the way a session's refit does: ``writing`` first
    (the weight state's hook), then the bytes, then ``committed``; waits on ``release``
    before committing, or raises ``fail`` there."""

    def __init__(self, stager, targets, value, version, fail=None):
        self.stager, self.targets, self.value, self.version = stager, targets, value, version
        self.release, self.fail = threading.Event(), fail

    def refit(self):
        weights = self.stager.weights
        for name, t in self.targets:
            weights.writing([name])
            t.fill_(self.value)
        self.release.wait(10)
        if self.fail:
            weights.failed(self.fail)
            raise RuntimeError(self.fail)
        weights.committed(self.version, [n for n, _ in self.targets])
        return {"version": self.version}


def _live():
    return {"a": torch.zeros(4), "b": torch.zeros(8), "c": torch.zeros(2)}


def test_a_staged_version_goes_live_only_at_the_flip_in_place():
    live, state = _live(), WeightState(version=1)
    ptrs = {n: t.data_ptr() for n, t in live.items()}
    stager = StagedRefits(live, state)
    session = _Writer(stager, stager.targets(live.items()), 7.0, 2)
    stager.start(session)
    with pytest.raises(CallOrderError, match="is running"):
        stager.start(session)
    with pytest.raises(StagedRefitTimeout, match="still receiving after 0.05 s"):
        stager.wait(0.05)
    session.release.set()
    assert stager.wait(10)["phase"] == "staged"
    assert all(bool((t == 0).all()) for t in live.values())  # still version 1
    assert state.version == 1 and stager.state()["staged_version"] == 2
    out = stager.flip()
    assert out["staged"]["version"] == 2 and state.version == 2 and state.consistent
    assert all(bool((t == 7).all()) for t in live.values())
    assert {n: t.data_ptr() for n, t in live.items()} == ptrs  # same storage (CUDA graphs)
    with pytest.raises(CallOrderError, match="no staged refit to flip"):
        stager.flip()


def test_what_does_not_fit_waits_for_the_flip_and_a_failure_before_it_leaves_n_live():
    live, state = _live(), WeightState(version=1)
    stager = StagedRefits(live, state, budget_bytes=4 * 4)  # "a" fits, "b" and "c" do not
    assert stager.in_place == ["b", "c"] and list(stager.staging) == ["a"]
    session = _Writer(stager, stager.targets(live.items()), 5.0, 2)
    session.release.set()
    stager.start(session)
    assert stager.wait(10)["phase"] == "waiting_for_pause"
    assert all(bool((t == 0).all()) for t in live.values())  # "b" not written before the pause
    stager.flip()
    assert all(bool((t == 5).all()) for t in live.values()) and state.version == 2

    session = _Writer(stager, stager.targets(live.items()), 9.0, 3, fail="vote: no")
    stager.start(session)
    session.release.set()
    with pytest.raises(StagedRefitError, match="inconsistent"):  # in place, after the gate
        stager.flip()
    assert not state.consistent and state.overwritten == {"b", "c"}

    live, state = _live(), WeightState(version=1)
    stager = StagedRefits(live, state)  # everything staged: nothing to repair
    session = _Writer(stager, stager.targets(live.items()), 9.0, 2, fail="vote: no")
    stager.start(session)
    session.release.set()
    with pytest.raises(StagedRefitError, match="live weights are consistent at version 1"):
        stager.wait(10)
    assert state.consistent and state.version == 1 and state.failed_refits == 0
    assert all(bool((t == 0).all()) for t in live.values())


def test_a_discard_stops_a_refit_waiting_for_the_pause_before_it_writes_in_place():
    live, state = _live(), WeightState(version=1)
    stager = StagedRefits(live, state, budget_bytes=0)
    session = _Writer(stager, stager.targets(live.items()), 3.0, 2)
    session.release.set()
    stager.start(session)
    assert stager.wait(10)["phase"] == "waiting_for_pause"
    assert stager.discard(10)["phase"] == "idle"
    assert state.consistent and state.version == 1
    assert all(bool((t == 0).all()) for t in live.values())
    assert isinstance(stager.error, StagedRefitError) and "discarded" in str(stager.error)


def test_a_failed_staged_refit_keeps_its_error_without_the_threads_frames():
    """The transfer thread's error is kept for wait / flip; kept with its traceback, its
    frames (their locals: this stager, the session and its refit groups) would form a cycle
    holding a failed group's gloo threads and sockets until the cyclic collector runs
    (issue 52). The text of where it was raised stays, as a note."""
    live, state = _live(), WeightState(version=1)
    stager = StagedRefits(live, state)
    session = _Writer(stager, stager.targets(live.items()), 9.0, 2, fail="vote: no")
    stager.start(session)
    session.release.set()
    with pytest.raises(StagedRefitError, match="live weights are consistent at version 1"):
        stager.wait(10)
    chained, error = [], stager.error
    while error is not None and error not in chained:
        chained.append(error)
        error = error.__cause__ or error.__context__
    assert chained and all(e.__traceback__ is None for e in chained)
    assert any("Traceback" in note for note in stager.error.__notes__)
