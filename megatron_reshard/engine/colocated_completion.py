"""When a colocated batch's reads are complete: each rank reports its own, a training rank
waits for everyone's before it lets go of what was read.

Torch + stdlib only. Every rank keeps the batches whose copies it queued and has not
reported yet (a CUDA event after each batch's copies, or none: nothing to copy, or copies
that ran synchronously on CPU) and reports, in its ``copied`` word of the group's table
(``host_flags``), the last batch whose copies completed; batches complete in order, so the
word is a count. A training rank keeps the tensors of each batch it published (pre-hook
buffers too, so that none is freed or reused while it is read) until every rank reported
that batch. ``colocated.py`` says when each step runs; ``report`` is also what a rank does
while it waits in a barrier, so a rank waiting for its peers never keeps them waiting for
its own report.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional

from megatron_reshard.groups.threads import hold

from .host_flags import COPIED, HostFlags

UNREAD_LINGER_S = 2.0  # a peer's copies of a batch take milliseconds


class Completions:
    """One colocated transport's reads in flight (see the module docstring)."""

    def __init__(self, flags: HostFlags):
        self.flags = flags
        self._in_flight: deque = deque()  # (batch seq, CUDA event or None), not reported
        self._unread: deque = deque()     # training side: (batch seq, tensors kept alive)

    def queued(self, seq: int, event: Optional[Any]) -> None:
        """This rank's copies of batch ``seq`` are queued (``event`` after them; None:
        they are complete)."""
        self._in_flight.append((seq, event))

    def published(self, seq: int, transfers: Any) -> None:
        """Batch ``seq``'s sources (``transfers``) may be read until every rank reports it."""
        self._unread.append((seq, transfers))

    def report(self) -> None:
        """Report the batches whose copies completed (a look at each one's event, in order)."""
        done, in_flight = None, self._in_flight
        while in_flight and (in_flight[0][1] is None or in_flight[0][1].query()):
            done = in_flight.popleft()[0]
        if done is not None:
            self.flags.arrive(COPIED, seq=done)

    def complete_own(self) -> None:
        """Wait for this rank's copies in flight (a plain sync, not a wait that polls the
        board: they depend on no peer, mapped memory stays valid while mapped, its owner
        dead or alive, and a poll's naps end it up to ~0.1 ms late), then report them."""
        self._wait_events()
        self.report()

    def let_go(self, keep: int) -> None:
        """Wait until every rank read all but the newest ``keep`` batches this rank
        published, and drop their tensors (a pre hook's buffer may be freed then)."""
        while len(self._unread) > keep:
            self.flags.wait(COPIED, "the colocated refit's copied barrier",
                            seq=self._unread[0][0], idle=self.report)
            self._unread.popleft()

    def settle(self) -> None:
        """Everything in flight complete, on this rank and, for what it published, on all."""
        self.complete_own()
        self.let_go(0)

    def clear(self) -> None:
        """Forget it all (the transport failed or closes). No copy of this rank still runs
        after it, so the mappings it read from may be let go of; what this rank published
        and no peer reported read stays alive ``UNREAD_LINGER_S`` longer (a failing peer
        waits for its own copies before it lets go), so no buffer is reused under a read."""
        try:
            self._wait_events()
        except RuntimeError:  # a broken device context: no copy runs any more
            pass
        self._in_flight.clear()
        if self._unread:
            hold(list(self._unread), UNREAD_LINGER_S, "colocated-unread")
        self._unread.clear()

    def _wait_events(self) -> None:
        for _, event in self._in_flight:
            if event is not None:
                event.synchronize()
