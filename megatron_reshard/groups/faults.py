"""Failures that reach every rank of a refit group, fast, and waits that never hang silently.

Torch + stdlib only (the receiver imports it). Each refit group made by
``comm.create_refit_group`` (a ``refit_group.RefitGroup``) owns a ``FaultBoard`` kept in the
group's own TCPStore (``group.board``; ``board_of`` reads it, None for any other group). A
rank that fails (bad input, a broken peer, an integrity mismatch) posts one line there;
every wait on the group (``wait_works``, ``wait_device``) polls the board, so a peer
blocked in a receive raises ``PeerFailure`` naming the failing rank and its message within
``POLL_S`` instead of waiting for the group's timeout. A rank that dies or hangs cannot
post: its gloo peers see the connection close at once (a process that exits closes its
sockets) and post in its place; a stopped process is found by the deadline every wait
carries (the group's timeout).

Why a waiter thread for gloo: a gloo ``send``/``recv`` Work completes only inside
``wait()`` (``is_completed()`` stays False until then) and ``wait(timeout)`` closes the pair,
so the main thread cannot poll it; it waits on a daemon thread instead and polls the board
meanwhile. A Work left behind by a failure is abandoned with its group: a failed group is
never used again (the board keeps the failure, ``raise_if_failed`` refuses new work), and
it is retired (``retire``): held on a daemon thread until its abandoned operations have
ended, so that neither dropping it, nor ``comm.destroy_refit_group``, nor the process's exit
waits for gloo's timeout.

NCCL work is asynchronous on the host; its blocking point is a device sync, which
``wait_device`` turns into an event poll with the same board checks and deadline, aborting
the communicator (``ProcessGroupNCCL.abort``) on a peer failure or timeout so that its
kernels stop.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_reshard.errors import MegatronReshardError
from megatron_reshard.groups import at_exit
from megatron_reshard.groups.threads import DaemonThreads, hold

POLL_S = 0.05          # how often a waiting rank looks at the board
EVENT_NAP_S = 1e-5     # a device wait's first nap between event queries (then doubled)
GRACE_S = 0.5          # after a transport error: how long to look for a peer's own report
POST_S = 2.0           # the longest a failing rank spends telling one group (a stopped store)
# how long a collective's Work is looked at on the waiting thread before its wait goes to a
# waiter thread (``wait_collective``): a vote whose peers are there takes 0.1-0.4 ms; longer
# looks took CPU from a late peer on a loaded machine (2 ms: the commit vote slower, measured)
SPIN_S = 5e-4



class RefitError(MegatronReshardError, RuntimeError):
    """A refit (or its setup) failed; the message says where and why."""


class PeerFailure(RefitError):
    """Another rank of a refit group failed: ``who`` names it, ``reason`` is its message,
    ``posted_by`` the group rank that posted it (itself, or a rank relaying it)."""

    def __init__(self, message: str, *, who: str, reason: str, posted_by: int):
        super().__init__(message)
        self.who, self.reason, self.posted_by = who, reason, posted_by


class RefitTimeout(RefitError, TimeoutError):
    """A wait passed the group's timeout: a peer is hung, stopped or gone."""


@dataclass(frozen=True)
class Fault:
    """One post on a board: who failed first (``who`` names the process, e.g. "train rank 3
    (PP stage 1)"), why, and the group rank that posted it (the failed rank itself, or a
    rank relaying a failure it saw in another refit group)."""

    who: str
    reason: str
    posted_by: int

    def describe(self) -> str:
        return f"{self.who} failed: {self.reason}"


class FaultBoard:
    """The failure notices of one refit group, kept in the group's store.

    ``threads``: the group's daemon threads (``threads.DaemonThreads``, owned by the group),
    on which the board's store calls and the group's Work waits run: some store calls never
    return while the store's host is stopped, and a gloo Work's wait() returns only at
    gloo's timeout when a peer has stopped taking part (a failure leaves one such wait
    behind on every survivor); a daemon thread stuck there cannot hold the process."""

    def __init__(self, store: Any, rank: int, world: int, who: str, label: str,
                 timeout_s: float, threads: DaemonThreads, backend: str = "gloo"):
        self.store, self.rank, self.world, self.backend = store, rank, world, backend
        self.threads = threads
        self.who = who            # this rank, for humans: "train rank 3", "gen rank 0"
        self.label = label        # the group, for humans: "refit group of PP stage 1"
        self.timeout_s = timeout_s
        self._seen: Optional[Fault] = None
        self.failed = False       # this rank posted or saw a failure of the group
        self.retired = False      # the failed group is held until its operations end (retire)
        # (fd, "socket:[inode]") of the group's store client and gloo pairs: shut down at
        # exit if the group failed with calls still in flight (groups.at_exit)
        self.sockets: list[tuple[int, str]] = []
        self.names: dict[int, str] = {}  # group rank -> its "who", from the join

    # -- posting -------------------------------------------------------------------------

    def post(self, reason: str, root: Optional[Fault] = None) -> None:
        """Tell every rank of the group that this rank failed (or relay ``root``'s failure).

        Best effort: a store that is gone (its host died) cannot be told anything.
        """
        self.fail()
        fault = root or Fault(self.who, reason, self.rank)
        record = {"who": fault.who, "reason": fault.reason, "posted_by": self.rank}
        def write() -> None:
            seq = int(self.store.add("fault/count", 1))
            self.store.set(f"fault/{seq}", json.dumps(record))

        try:
            self._bounded(write, POST_S)
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to tell
            pass

    def _bounded(self, fn, timeout_s: Optional[float] = None):
        """``fn()`` on a daemon thread, at most ``timeout_s``: some store calls never return
        when the store's host is stopped (SIGSTOP), and a stuck daemon thread cannot keep
        the process from exiting. The threads are reused (``threads.DaemonThreads``): a
        board read on a refit's hot path (a colocated batch's) costs a hand-off, not a new
        thread; a thread stuck in a call is never handed another one."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        call = self.threads.submit(fn)
        if not call.wait(timeout_s):
            raise RefitTimeout(f"the group's store did not answer within {timeout_s:g} s")
        return call.result()

    # -- reading -------------------------------------------------------------------------

    def first_fault(self, timeout_s: Optional[float] = None) -> Optional[Fault]:
        """The earliest failure posted by another rank, None if there is none.

        A store that cannot be reached (within ``timeout_s``, default the group's timeout)
        means its host, group rank 0, is gone or stopped.
        """
        if self._seen is not None:
            return self._seen
        try:
            fault = self._bounded(self._read, timeout_s)
            if fault is not None:
                self._seen = fault
                self.fail()
                return fault
        except Exception as exc:  # noqa: BLE001 - any store error: its host is unreachable
            if self.rank == 0:
                return None  # we host it; a local store error is not a peer failure
            self.fail()
            host = f" ({self.names[0]})" if 0 in self.names else ""
            self._seen = Fault(f"group rank 0{host}, which hosts the group's store,",
                               f"its store is unreachable ({type(exc).__name__}: {exc}); the "
                               f"process exited or is stopped", 0)
            return self._seen
        return None

    def _read(self) -> Optional[Fault]:
        self.store.add(f"beat/{self.rank}", 1)  # a sign of life: this rank is polling
        count = int(self.store.add("fault/count", 0))
        for seq in range(1, count + 1):
            key = f"fault/{seq}"
            if not self.store.check([key]):
                continue  # counted, not written yet: the next poll reads it
            rec = json.loads(self.store.get(key))
            if rec["who"] != self.who:  # not this rank's own failure coming back
                return Fault(rec["who"], rec["reason"], int(rec["posted_by"]))
        return None

    # -- signs of life ---------------------------------------------------------------------
    # Every board read (each poll of a waiting rank, every POLL_S) counts a beat of the
    # reading rank. A peer whose count does not move while this rank waits is not polling:
    # its process is stopped, hung or dead, or it is not running the refit at all.

    def beats(self, ranks: Sequence[int]) -> Optional[dict[int, int]]:
        """Each rank's beat count; None when the store does not answer within ``POST_S``."""
        try:
            return self._bounded(lambda: {r: int(self.store.add(f"beat/{r}", 0)) for r in ranks},
                                 POST_S)
        except Exception:  # noqa: BLE001 - the store's host is gone or stopped
            return None

    def silent_since(self, before: Optional[dict[int, int]]) -> list[int]:
        """The ranks of ``before`` whose beat count has not moved since it was read."""
        if not before:
            return []
        now = self.beats(list(before))
        return [] if now is None else [r for r in sorted(before) if now[r] == before[r]]

    def others(self, peers: Optional[Sequence[int]]) -> list[int]:
        """The peers of a step (all other ranks when not given)."""
        ranks = range(self.world) if not peers else set(peers)
        return sorted(r for r in ranks if r != self.rank)

    def name_ranks(self, ranks: Sequence[int]) -> str:
        return ", ".join(f"group rank {r} ({self.names[r]})" if r in self.names
                         else f"group rank {r}" for r in ranks)

    def fail(self) -> None:
        """Mark the group failed on this rank (once): the exit hook (``at_exit``) then ends
        whatever calls the group abandoned before the process exits."""
        if not self.failed:
            self.failed = True
            at_exit.remember_failed(self)

    def count_shutdown(self, n: int) -> int:
        """Add ``n`` to the group's shutdown count, at most ``POST_S`` (a failed group's
        store host may be stopped); the count."""
        return int(self._bounded(lambda: self.store.add("shutdown", n), POST_S))

    def peer_failure(self, fault: Fault, while_doing: str) -> PeerFailure:
        return PeerFailure(f"{self.label}, {self.who} (group rank {self.rank}) while "
                           f"{while_doing}: {fault.describe()}", who=fault.who,
                           reason=fault.reason, posted_by=fault.posted_by)

    def raise_if_failed(self, while_doing: str) -> None:
        fault = self.first_fault()
        if fault is not None:
            raise self.peer_failure(fault, while_doing)


def board_of(group: Any) -> Optional[FaultBoard]:
    """The group's board: a ``RefitGroup``'s own (None once it is destroyed); None for any
    other group (a torch process group, a raw backend, None)."""
    return getattr(group, "board", None)


def boards_of(groups: Iterable[Any]) -> list[FaultBoard]:
    return [b for b in (board_of(g) for g in groups) if b is not None]


def post_failure(groups: Iterable[Any], exc: BaseException) -> None:
    """Post ``exc`` on the board of every group (a peer's failure is relayed as its root)
    and retire the groups (``retire``)."""
    for group in groups:
        board = board_of(group)
        if board is None:
            continue
        if isinstance(exc, PeerFailure):
            board.post(exc.reason, Fault(exc.who, exc.reason, board.rank))
        else:
            board.post(f"{type(exc).__name__}: {exc}")
        retire(group)


# Past the group's timeout: a collective that got stuck just after the failure has ended
# by then (gloo bounds each of its waits by the group's timeout).
RETIRE_MARGIN_S = 5.0


def retire(group: Any) -> None:
    """A failed gloo group is kept alive on a daemon thread until every operation it may
    still run has ended (the group's timeout plus ``RETIRE_MARGIN_S``), so that dropping or
    destroying it returns at once: a ``ProcessGroupGloo`` whose worker thread still runs an
    abandoned collective blocks whoever drops its last reference until that collective ends
    (neither ``abort()`` nor ``shutdown()`` ends it, measured on torch 2.13). Once per group;
    the board is marked failed (``destroy_refit_group`` then does not wait for every rank)."""
    board = board_of(group)
    if board is None:
        return
    board.fail()
    if board.backend == "gloo" and not board.retired:
        board.retired = True
        hold(group, board.timeout_s + RETIRE_MARGIN_S, name="refit-retired-group")


class fault_scope:
    """``with fault_scope(groups):`` — any exception inside is posted on every group's board
    before it propagates, so the peers of this rank fail now instead of at their timeout."""

    def __init__(self, groups: Iterable[Any]):
        self.groups = list(groups)

    def __enter__(self) -> "fault_scope":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
            post_failure(self.groups, exc)
        return False


# ------------------------------------------------------------------------------- waits


def wait_works(works: Sequence[Any], group: Any, what: str,
               peers: Optional[Sequence[int]] = None) -> None:
    """Wait for the Works of one step on ``group``; raise instead of hanging.

    Without a board (a group not made by ``create_refit_group``) this is ``w.wait()`` for
    each. With one: the Works are waited for on a waiter thread while this thread polls the
    board; a peer's post raises ``PeerFailure`` at once, the group's timeout
    ``RefitTimeout``, a transport error (a peer's process exited) a ``RefitError`` naming
    the peers of the step, after a short look for a peer's own report.
    """
    board = board_of(group)
    if board is None or board.backend != "gloo" or not works:
        for w in works:  # NCCL: returns at once (the device waits); see wait_device
            w.wait()
        return
    call = board.threads.submit(lambda: _wait_all(works))
    try:
        _poll_until_done(call, board, what, peers)
    except BaseException:
        retire(group)  # its Works may still run: dropping the group must not wait for them
        raise


def wait_collective(work: Any, group: Any, what: str,
                    peers: Optional[Sequence[int]] = None) -> None:
    """``wait_works`` for one collective's Work (all-reduce, all-gather, broadcast): the
    refit's votes. Unlike a send or receive, a gloo collective completes on the backend's
    own worker thread (``is_completed()`` turns True without ``wait()``), so this thread
    looks at it for up to ``SPIN_S`` first, yielding the core between looks: a vote whose
    peers arrive in time then costs no hand-off to a waiter thread and back (~0.15 ms a
    vote on a loaded CPU, ``scripts/bench_refit_overhead.py``). Past ``SPIN_S`` (a peer
    late, stopped or gone) the wait is ``wait_works``' own, fault board and deadline
    included; a Work that completed with an error is reported as ``wait_works`` does."""
    board = board_of(group)
    if board is None or board.backend != "gloo" or not _completes_within(work, SPIN_S):
        wait_works([work], group, what, peers)
        return
    try:
        work.wait()  # completed: returns at once, or raises the transport's error
    except Exception as exc:  # noqa: BLE001 - the transport's error, re-raised with context
        try:
            _raise_transport_error(board, what, peers, exc)
        except BaseException:
            retire(group)  # as wait_works: dropping the failed group must not wait
            raise


def _completes_within(work: Any, seconds: float) -> bool:
    """Whether ``work`` completes within ``seconds`` (looked at between yields)."""
    if seconds <= 0:
        return False
    deadline = time.perf_counter() + seconds
    while not work.is_completed():
        if time.perf_counter() > deadline:
            return False
        os.sched_yield()
    return True


def _poll_until_done(call, board: FaultBoard, what: str, peers) -> None:
    deadline = time.monotonic() + board.timeout_s
    watched = None  # the peers' beat counts, read once the wait outlasts one poll
    while True:
        if call.wait(POLL_S):
            try:
                call.result()
            except Exception as exc:  # noqa: BLE001 - the transport's error, re-raised with context
                _raise_transport_error(board, what, peers, exc, watched)
            return
        board.raise_if_failed(what)
        if watched is None:
            watched = board.beats(board.others(peers)) or {}
        if time.monotonic() > deadline:
            raise RefitTimeout(f"{board.label}, {board.who} (group rank {board.rank}): {what} "
                               f"did not complete within the group's timeout of "
                               f"{board.timeout_s:g} s{_peers_text(peers)}; "
                               f"{_silence_text(board, board.silent_since(watched))}")


def _silence_text(board: FaultBoard, silent: Sequence[int]) -> str:
    """Who stopped answering, or, when every peer kept polling, what else keeps a step from
    completing."""
    if silent:
        return (f"{board.name_ranks(silent)} gave no sign of life meanwhile (it stopped "
                f"polling the group's fault board): that process is stopped (SIGSTOP), hung or "
                f"dead, or it is not running the refit")
    return ("every peer kept polling the group's fault board meanwhile, so they are alive "
            "but waiting on another step: check that every rank runs the same refits and "
            "batches in the same order")


def _wait_all(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()


def _peers_text(peers: Optional[Sequence[int]]) -> str:
    if not peers:
        return ""
    return f" (waiting on group rank(s) {sorted(set(peers))})"


def _raise_transport_error(board: FaultBoard, what: str, peers, exc: BaseException,
                           watched: Optional[dict[int, int]] = None) -> None:
    if not watched:  # the step failed within one poll: watch the peers during the grace
        watched = board.beats(board.others(peers)) or {}
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:  # a peer that failed on purpose may be posting now
        fault = board.first_fault(GRACE_S)  # (this rank's own beats: it is alive)
        if fault is not None:
            raise board.peer_failure(fault, what) from exc
        time.sleep(POLL_S / 5)
    silent = board.silent_since(watched)
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        raise RefitTimeout(f"{board.label}, {board.who} (group rank {board.rank}): {what} "
                           f"timed out in the transport{_peers_text(peers)}: {text}. "
                           f"{_silence_text(board, silent)}") from exc
    who = (f"{board.name_ranks(silent)} gave no sign of life since: that process most likely "
           f"exited or was killed" if silent else "a peer process most likely exited")
    raise RefitError(f"{board.label}, {board.who} (group rank {board.rank}): {what} failed in "
                     f"the transport{_peers_text(peers)}: {text}. No peer reported a failure; "
                     f"{who}") from exc


def wait_device(device: torch.device, groups: Iterable[Any], what: str,
                longest_nap_s: float = POLL_S / 10) -> None:
    """Block until the current CUDA stream of ``device`` is done (see ``wait_event``).
    A no-op on CPU."""
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    wait_event(event, groups, what, longest_nap_s)


def wait_event(event: "torch.cuda.Event", groups: Iterable[Any], what: str,
               longest_nap_s: float = POLL_S / 10) -> None:
    """Block until a CUDA event is reached, polling the groups' boards meanwhile.

    On a peer's post or past the timeout, the NCCL groups are aborted (their kernels stop)
    and the error raised. ``longest_nap_s`` bounds the doubling naps between event
    queries, so a wait ends at most that late after the event (a wait on the critical
    path, a colocated refit's copies, passes a short one).
    """
    groups = list(groups)
    boards = boards_of(groups)
    if not boards:
        event.synchronize()
        return
    timeout = min(b.timeout_s for b in boards)
    now = time.monotonic()
    deadline, next_look, nap = now + timeout, now + POLL_S, EVENT_NAP_S
    watched = None  # each board's peers' beat counts, read once the wait outlasts one look
    # Most waits are short (a vote: ~0.1 ms), so the naps start at 10 µs and double up to
    # POLL_S / 10; the boards (a store read each) are read every POLL_S.
    while not event.query():
        now = time.monotonic()
        if now >= next_look:
            next_look = now + POLL_S
            for board in boards:
                fault = board.first_fault()
                if fault is not None:
                    abort_groups(groups)
                    raise board.peer_failure(fault, what)
            if watched is None:
                watched = [b.beats(b.others(None)) or {} for b in boards]
            if now > deadline:
                silence = "; ".join(f"{b.label}: {_silence_text(b, b.silent_since(w))}"
                                    for b, w in zip(boards, watched))
                abort_groups(groups)
                raise RefitTimeout(f"{boards[0].who}: {what} did not complete on the device "
                                   f"within {timeout:g} s (groups aborted); {silence}")
        time.sleep(nap)
        nap = min(2 * nap, longest_nap_s)


def abort_groups(groups: Iterable[Any]) -> None:
    """Abort the communicators of NCCL groups (their pending kernels stop); best effort."""
    for g in groups:
        abort = getattr(g, "abort", None)
        name = ""
        try:
            name = str(g.name()).lower()
        except Exception:  # noqa: BLE001
            pass
        if abort is not None and "nccl" in name:
            try:
                abort()
            except Exception:  # noqa: BLE001 - already broken
                pass


__all__ = ["Fault", "FaultBoard", "PeerFailure", "RefitError", "RefitTimeout",
           "abort_groups", "board_of", "boards_of", "fault_scope", "post_failure", "retire",
           "wait_collective", "wait_device", "wait_event", "wait_works"]
