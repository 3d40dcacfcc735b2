"""``create_refit_group`` keeps one deadline for the whole join: waiting for the peers and
the host's linger after a failed join share ``timeout_s``, they do not run one after the
other (a 5 s timeout once took 10-11.5 s: the join's 5 s, then up to 5 s of linger).

Measured on a fake clock, never on the wall clock: ``comm.time`` is replaced by a clock
that moves only when the code sleeps, over a real TCPStore and a real fault board."""

import pytest

from megatron_reshard.groups import comm
from megatron_reshard.groups.faults import POLL_S, RefitTimeout
from megatron_reshard.tools.worlds import free_ports


class FakeClock:
    """``time.monotonic`` / ``time.sleep`` for ``comm``: sleeping moves the clock."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_join_nobody_answers_ends_at_the_timeout_not_after_a_linger_too(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(comm, "time", clock)
    start = clock.now
    with pytest.raises(RefitTimeout, match=r"group ranks \[1\] of 2 did not join within 5 s"):
        comm.create_refit_group("127.0.0.1", free_ports(1)[0], 0, 2, "gloo", 5.0)
    # the peers' wait ends one poll past the deadline at most; no linger after it
    assert 5.0 <= clock.now - start <= 5.0 + 2 * POLL_S


def test_the_host_linger_after_a_refused_join_stops_at_the_deadline(monkeypatch):
    """A disagreement found late in the join: the host lingers for the slower ranks only
    until the join's deadline."""
    clock = FakeClock()
    monkeypatch.setattr(comm, "time", clock)
    board_of = {}

    def join_refused(board, mine, deadline):
        board_of["deadline"] = deadline
        clock.now = deadline - 1.0  # the problem shows up 1 s before the deadline
        raise comm.RefitError("refused for the test")

    monkeypatch.setattr(comm, "_join_until_complete", join_refused)
    with pytest.raises(comm.RefitError, match="refused for the test"):
        comm.create_refit_group("127.0.0.1", free_ports(1)[0], 0, 2, "gloo", 5.0)
    assert board_of["deadline"] == pytest.approx(1005.0)  # timeout_s from the call's start
    assert clock.now <= board_of["deadline"] + POLL_S
