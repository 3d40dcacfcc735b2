"""Which batch a group runs next, predicted from the calls that went through on it.

``xfer_batch(agree=False)`` skips the agreement vote only for the call this history
predicts. Every rank of a group records the same calls in the same order (a call is
recorded once it went through; a voted call's key is the same on every rank, and a
skipped one matched the prediction that every rank shares), so every rank predicts the
same next batch. A rank whose call is not the predicted one votes instead:

- when every rank changed alike (a new batch, a new order), they all vote, agree, and
  the history learns the new successor;
- when only some ranks deviate, the voters wait in the vote while the others wait in
  their transfers: the call ends in the group's timeout on every rank (a loud error),
  never with one rank's messages matched against another batch's, which could have
  written bytes into the wrong destination.

Any failure clears the history on the rank that sees it, so after an error every rank
votes again. The key is what must be equal on every rank for their operations to match:
the batch fingerprint, the staging budget and the stride signatures its schedule was
built for.
"""

from __future__ import annotations

from typing import Hashable, Optional

MAX_KEYS = 4096  # successors kept; reached on every rank at the same call, then cleared


class CallSequence:
    """The calls of one group through one planner: the last key and each key's successor."""

    def __init__(self) -> None:
        self.last: Optional[Hashable] = None
        self.successor: dict = {}
        # (rank, size, backend name) of the group, read at its first call: a group's own
        # facts, fixed for its life (a warm call saves the three lookups, ~1 µs)
        self.group_facts: Optional[tuple] = None

    def predicts(self, key: Hashable) -> bool:
        """Whether ``key`` is the call this history says comes next."""
        return self.last is not None and self.successor.get(self.last) == key

    def record(self, key: Hashable) -> None:
        """A call with ``key`` went through on this rank."""
        if self.last is not None:
            if len(self.successor) >= MAX_KEYS:
                self.successor.clear()
            self.successor[self.last] = key
        self.last = key

    def forget(self) -> None:
        """A call failed: predict nothing until calls go through again."""
        self.last = None
        self.successor.clear()
