"""A colocated refit group's barriers in shared host memory: one word per rank and barrier.

Torch + stdlib only. The processes of a colocated group share one host, so the barriers
of each batch (ready: the sources are written and described; verdict: every rank's checks
passed, or the batch is to be moved again; copied: a rank's reads of the batch are
complete) need no network round trip: each rank writes its own words of a small shared
table and reads the others'. A gloo all-reduce on loopback cost 0.5-0.7 ms
per barrier on this project's CPU machines, and replacing the two of each batch took a
whole colocated refit on one H200 from 47% to 60% of memcpy (docs/MEASUREMENTS.md); a
look at the table costs about a microsecond.

The table (``int64 [world, 4]``, made by group rank 0 in shared memory, opened by the
others through the group's store) holds per rank:

- ``ready``: ``seq << 32 | payload`` (payload: 31 bits of the caller's, e.g. a training
  rank's generation and a problem bit), one 64-bit store, so a reader never sees the
  number of one batch with the payload of another;
- ``verdict``: ``seq << 32 | payload`` (the caller's: e.g. a redo bit);
- ``copied``: ``seq << 32`` of the last batch whose reads this rank completed (batches
  complete in order, so it is a count: a wait for batch ``s`` passes on any ``seq >= s``);
- ``failed``: non-zero once the rank gave up on the group.

The caller keeps a rank from overwriting a payload before every peer read it: a word is
read between the caller's arrival and its next one in the same column, and the caller
arrives again only after a barrier that every peer enters after that read
(``colocated.py``: ``ready`` of batch k+1 after ``verdict`` of batch k, which every
rank enters after its ``ready`` wait; ``verdict`` of k+1 after ``ready`` of k+1).

A waiting rank never hangs silently. Every ``POLL_S`` it reads the group's fault board
(a peer's post raises ``PeerFailure`` with the peer's message), looks whether the peers it
waits for are still alive (``/proc/<pid>/stat``: gone, a zombie, or a new process behind
the same pid is a dead peer; peers whose pid this process cannot see, another pid
namespace, are left to the deadline), and checks the group's deadline (``RefitTimeout``
naming the ranks that did not arrive). A peer's ``failed`` word ends a wait for it at once
(a peer that arrived before it failed has arrived: its payload may say why).
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import time
from typing import Any, Callable, Optional

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.groups.faults import POLL_S, RefitError, RefitTimeout

from .shared_memory import StorageHandle, export_storage, open_storage, view_of

READY, VERDICT, COPIED, FAILED = 0, 1, 2, 3
COLUMNS = 4
PAYLOAD_BITS = 31
SPIN_S = 20e-3        # how long a wait only yields the CPU before it starts to nap: a
                      # nap ends 50-100 µs late (timer slack), the barrier ends the batch
LONGEST_NAP_S = 1e-3  # the naps after that double up to this
GRACE_S = 0.5         # on a peer's failed word: how long to look for its own report


class HostFlags:
    """The barriers of one colocated refit group (see the module docstring). Every rank
    of the group makes one; the table is opened on the first ``wait``."""

    def __init__(self, store: Any, rank: int, world: int, board: Any, timeout_s: float,
                 key: str = "colocated/flags"):
        self.store, self.rank, self.world = store, rank, world
        self.board, self.timeout_s, self.key = board, timeout_s, key
        self.who = getattr(board, "who", f"group rank {rank}")
        self._table: Optional[torch.Tensor] = None  # owns the memory the words live in
        self._storage = None
        self._words = None       # the table as a ctypes array: a read or write in ~0.1 µs
                                 # (a tensor's __setitem__ costs tens of µs)
        self._peers: list = []   # per rank: (who, pid, start time or None: not visible)
        self._seq = 0

    # -- set-up ----------------------------------------------------------------------

    def _open(self) -> torch.Tensor:
        if self._table is None:
            if self.rank == 0:
                table = torch.zeros(self.world, COLUMNS, dtype=torch.int64)
                handle = export_storage(table.untyped_storage())  # shared in place
                self.store.set(f"{self.key}/table", pickle.dumps(tuple(handle)))
                self._storage = table.untyped_storage()
            else:  # blocks until rank 0 published it (the store's own timeout)
                handle = StorageHandle(*pickle.loads(self.store.get(f"{self.key}/table")))
                self._storage = open_storage(handle)
                table = view_of(self._storage, torch.int64, 0, (self.world, COLUMNS),
                                (COLUMNS, 1))
            me = {"who": self.who, "pid": os.getpid(), "start": _start_time(os.getpid())}
            self.store.set(f"{self.key}/peer/{self.rank}", json.dumps(me))
            self._table = table
            self._words = (ctypes.c_int64 * (COLUMNS * self.world)).from_address(table.data_ptr())
            self._peers = [self._peer(r) for r in range(self.world)]
        return self._table

    def _peer(self, r: int) -> tuple:
        if r == self.rank:
            return (self.who, os.getpid(), None)
        got = json.loads(self.store.get(f"{self.key}/peer/{r}"))
        seen = _start_time(got["pid"])  # another pid namespace: not the same process
        return (got["who"], got["pid"], got["start"] if seen == got["start"] else None)

    # -- the barriers ------------------------------------------------------------------

    def next_batch(self) -> int:
        self._seq += 1
        return self._seq

    @property
    def seq(self) -> int:
        """The number of the current batch (``next_batch``)."""
        return self._seq

    def arrive(self, column: int, payload: int = 0, seq: Optional[int] = None) -> None:
        """This rank's word in ``column`` for the current batch (or batch ``seq``)."""
        if not 0 <= payload < (1 << PAYLOAD_BITS):
            raise BadInputError(f"HostFlags.arrive: payload {payload} does not fit "
                             f"{PAYLOAD_BITS} bits")
        self._open()
        self._words[COLUMNS * self.rank + column] = ((self._seq if seq is None else seq) << 32
                                                     | payload)

    def wait(self, column: int, what: str, seq: Optional[int] = None,
             idle: Optional[Callable[[], None]] = None) -> list[int]:
        """Every rank's payload in ``column`` for the current batch (or batch ``seq``),
        once all have arrived. ``idle`` is called between two looks at the table (the
        colocated transport reports its completed copies from there)."""
        self._open()
        words, world = self._words, self.world
        seq = self._seq if seq is None else seq
        start = time.monotonic()
        deadline, next_look, nap = start + self.timeout_s, start + POLL_S, 0.0
        while True:
            got = words[column::COLUMNS]  # one slice: every rank's word of this barrier
            late = [r for r in range(world) if got[r] >> 32 < seq]
            if not late:  # a rank that arrived and failed after: its payload says why
                mask = (1 << PAYLOAD_BITS) - 1
                return [w & mask for w in got]
            if any(words[FAILED::COLUMNS]):
                self._raise_failed(words[FAILED::COLUMNS], what)
            if idle is not None:
                idle()
            now = time.monotonic()
            if now >= next_look:
                next_look = now + POLL_S
                self._look(late, what, now > deadline)
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                nap = min(max(2 * nap, 1e-5), LONGEST_NAP_S)
                time.sleep(nap)

    def mark_failed(self) -> None:
        """This rank gives up on the group: a peer waiting for it raises at once."""
        if self._words is not None:
            self._words[COLUMNS * self.rank + FAILED] = 1

    def gone_peers(self) -> list[int]:
        """The pids of the peers seen in this pid namespace whose process is gone now."""
        return [self._peers[r][1] for r in range(len(self._peers))
                if r != self.rank and self._peers[r][2] is not None and not self._alive(r)]

    def close(self) -> None:
        self._words = None  # before the memory it points into
        self._table = self._storage = None

    # -- why a wait ends badly -------------------------------------------------------------

    def _look(self, late: list, what: str, past_deadline: bool) -> None:
        if self.board is not None:
            self.board.raise_if_failed(what)
        dead = [r for r in late if not self._alive(r)]
        if dead:
            names = ", ".join(f"{self._peers[r][0]} (group rank {r}, pid {self._peers[r][1]})"
                              for r in dead)
            raise RefitError(f"{self._label()}, {self.who} (group rank {self.rank}): {what}: "
                             f"{names} exited (its process is gone) before it arrived")
        if past_deadline:
            raise RefitTimeout(f"{self._label()}, {self.who} (group rank {self.rank}): {what} "
                               f"did not complete within the group's timeout of "
                               f"{self.timeout_s:g} s (waiting on group rank(s) {late}); "
                               f"{self._why_late(late)}")

    def _why_late(self, late: list) -> str:
        """The late peers by name, and whether their process is stopped (they share this
        host: its state says so) or running but elsewhere."""
        stopped = [r for r in late if _state(self._peers[r][1]) in (b"T", b"t")]
        if stopped:
            names = ", ".join(f"{self._peers[r][0]} (group rank {r}, pid {self._peers[r][1]})"
                              for r in stopped)
            return f"{names} is stopped (SIGSTOP or a debugger): continue or kill that process"
        names = ", ".join(f"{self._peers[r][0]} (group rank {r})" for r in late)
        return (f"{names} is running but did not arrive: it is hung, or waiting on another "
                f"step (every rank must run the same refits and batches in the same order)")

    def _raise_failed(self, failed_words: list, what: str) -> None:
        failed = [r for r, w in enumerate(failed_words) if w and r != self.rank]
        if self.board is not None:  # the failed rank posts its reason: say it when there
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline:
                fault = self.board.first_fault(GRACE_S)
                if fault is not None:
                    raise self.board.peer_failure(fault, what)
                time.sleep(POLL_S / 5)
        names = ", ".join(f"{self._peers[r][0]} (group rank {r})" for r in failed) or "a peer"
        raise RefitError(f"{self._label()}, {self.who} (group rank {self.rank}): {what}: "
                         f"{names} gave up on the group without saying why")

    def _alive(self, r: int) -> bool:
        _, pid, start = self._peers[r]
        return start is None or _start_time(pid) == start

    def _label(self) -> str:
        return getattr(self.board, "label", "colocated refit group")


def _state(pid: int) -> Optional[bytes]:
    """Process ``pid``'s state letter (R, S, T: stopped, ...), None when it is not visible."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot), None when there is no such
    live process here (gone, a zombie, or not visible from this pid namespace)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return int(fields[19])


__all__ = ["HostFlags", "READY", "VERDICT", "COPIED"]
