"""Daemon threads for calls that may never return: a fault-aware wait must end on time, and
so must the process, whatever a stuck call does.

Stdlib only. Two kinds of call block without a bound of their own: some TCPStore calls when
the store's host is stopped (SIGSTOP), and a gloo Work's ``wait()``, which ends only at
gloo's timeout when a peer stops taking part. ``DaemonThreads`` runs such calls on reusable
daemon threads: the caller waits as long as it chooses, a thread stuck in a call is never
handed another one, and at exit nothing joins them (``concurrent.futures`` pools are joined
at exit, so one stuck wait held the process until gloo's timeout). ``hold`` keeps an object
alive on a daemon thread for a while: a failed gloo group whose worker thread still runs an
abandoned collective blocks whichever thread drops its last reference until that collective
ends (``~ProcessGroupGloo`` joins its worker threads; neither ``abort()`` nor ``shutdown()``
ends the collective in torch 2.13, measured).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Iterable, Optional

from megatron_reshard.errors import CallOrderError


class Call:
    """One call handed to ``DaemonThreads.submit``: ``wait`` for it, then ``result()``."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """True once the call has returned or raised (within ``timeout_s``)."""
        return self._done.wait(timeout_s)

    def result(self) -> Any:
        """The value of a finished call, or its exception raised here (handed over once,
        not kept: raised here, it gains the caller's frames, and a ``Call`` still holding it
        from one of them would be a cycle that keeps every local of the calling frames, a
        refit group among them, alive until the cyclic collector runs; issue 52)."""
        error, self._error = self._error, None
        if error is None:
            return self._value
        try:
            raise error
        finally:
            del error  # nor this frame (in the traceback) holding the exception back


class DaemonThreads:
    """Daemon threads that run the calls handed to them, one at a time each; idle ones are
    kept for the next call, so a call costs a hand-off, not a new thread.

    Each refit group owns one (``groups.refit_group.RefitGroup.threads``) and closes it when
    it is destroyed: idle threads end then, a thread stuck in a call ends when that call
    returns. There is no process-wide list of them: a forked child (which has none of its
    parent's threads) starts afresh on its first call, and the exit hook (``at_exit``)
    reaches the threads of failed groups through the boards it was handed."""

    def __init__(self, name: str):
        self.name = name
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._threads: list[threading.Thread] = []
        self.busy = 0  # calls handed out and not yet returned (stuck ones included)
        self.closed = False

    def submit(self, fn: Callable[[], Any]) -> Call:
        if self._pid != os.getpid():
            self._forget()  # forked: the parent's threads do not exist here
        with self._lock:
            if self.closed:
                raise CallOrderError(f"{self.name}: submit after close (the refit group that "
                                     f"owns these threads was destroyed)")
            jobs = self._idle.pop() if self._idle else None
            self.busy += 1
        if jobs is None:
            jobs = queue.SimpleQueue()
            thread = threading.Thread(target=self._loop, args=(jobs,), daemon=True,
                                      name=self.name)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        call = Call()
        jobs.put((fn, call))
        return call

    def _loop(self, jobs: "queue.SimpleQueue") -> None:
        while True:
            job = jobs.get()
            if job is None:  # closed while idle
                return
            fn, call = job
            try:
                call._value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call._error = exc
            fn = job = None  # what the call held (Works, a group) is not kept by an idle thread
            with self._lock:  # idle again before the caller can ask for another call
                closed = self.closed
                if not closed:
                    self._idle.append(jobs)
                self.busy -= 1
            call._done.set()
            call = None
            if closed:  # closed while this call ran: end now
                return

    def close(self, join_s: float = 0.0) -> None:
        """End the idle threads (joined, at most ``join_s`` each, when given) and every busy
        one once its call returns; no call is taken after. Idempotent."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for jobs in idle:
            jobs.put(None)
        if join_s <= 0 or self.busy:
            return
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(join_s)

    def alive(self) -> int:
        """How many of these threads are still running (idle or in a call)."""
        return sum(t.is_alive() for t in self._threads)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._idle, self._threads = [], []
        self.busy = 0
        self._pid = os.getpid()


def calls_in_flight(pools: Iterable[DaemonThreads]) -> int:
    """How many calls handed to ``pools`` have not returned yet."""
    return sum(threads.busy for threads in pools)


def wait_for_calls(pools: Iterable[DaemonThreads], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for every call in flight on ``pools`` to return; True if
    none is left."""
    pools = list(pools)
    deadline = time.monotonic() + timeout_s
    while calls_in_flight(pools) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not calls_in_flight(pools)


def hold(obj: Any, seconds: float, name: str = "refit-hold") -> None:
    """Keep a reference to ``obj`` for ``seconds`` on a daemon thread, then drop it (if that
    was the last one, ``obj`` is destroyed on that thread, not on the caller's)."""
    kept = [obj]

    def keep() -> None:
        time.sleep(seconds)
        kept.clear()

    threading.Thread(target=keep, daemon=True, name=name).start()


__all__ = ["Call", "DaemonThreads", "calls_in_flight", "hold", "wait_for_calls"]
