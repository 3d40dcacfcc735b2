"""One refit group on this rank, as one object that owns everything kept for it.

Torch + stdlib only (the receiver imports it). ``comm.create_refit_group`` returns a
``RefitGroup``: its torch backend (``pg``, a ``ProcessGroupGloo`` / ``ProcessGroupNCCL``
built from the group's own store, not registered with c10d), that store, the group's fault
board (``faults.FaultBoard``), the daemon threads its waits and store calls run on, and the
transport its ranks agreed on at join (built by the engine on first use,
``engine.refit_transport.transport_of``, together with that transport's caches). Nothing
about a group is kept in a module-level table: whoever holds the group holds its state,
and ``destroy()`` ends it (docs/DESIGN.md, "Refit groups: who owns what").

A ``RefitGroup`` offers the process-group calls the engine and the refit protocol use
(``rank()``, ``size()``, ``send``, ``recv``, ``allreduce``, ``allgather``, ...), each
forwarded to ``pg``, so it goes wherever a process group goes (``xfer_batch(...,
group=group)``); what the engine reads beyond them (the board) it finds on the object.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any, Callable, Optional

from megatron_reshard.errors import CallOrderError
from megatron_reshard.groups.faults import POST_S, FaultBoard
from megatron_reshard.groups.threads import DaemonThreads

# How long the store's host waits for its peers' shutdown once the group has failed: the
# survivors count themselves soon after their error, the dead never do.
FAILED_LINGER_S = 2.0


class RefitGroup:
    """A refit group on this rank (see the module docstring). Built by
    ``comm.create_refit_group``; lives as long as its holders keep it; ``destroy()`` shuts
    it down and lets go of its board, its transport and its threads."""

    def __init__(self, pg: Any, store: Any, board: FaultBoard, threads: DaemonThreads, *,
                 is_host: bool, transport_name: str):
        self.pg = pg                  # the torch backend: kept until the object goes
        self.store = store            # the group's own (prefixed) store
        self.board: Optional[FaultBoard] = board    # None once destroyed
        self.threads = threads        # where its store calls and Work waits run
        self.is_host = is_host        # this rank hosts the store
        self.world, self._rank = board.world, board.rank
        self.label, self.who = board.label, board.who
        self.transport_name = transport_name    # agreed at join (comm.TRANSPORT_NAMES)
        self.transport: Any = None    # built on first use (transport_for); closed by destroy
        self.destroyed = False
        # a group dropped without destroy() still ends its idle threads (not joined there:
        # the last reference may go on any thread)
        weakref.finalize(self, threads.close, 0.0).atexit = False  # (daemons: exit ends them)

    # -- the process-group calls, forwarded to ``pg`` ---------------------------------

    def rank(self) -> int:
        return self.pg.rank()

    def size(self) -> int:
        return self.pg.size()

    def name(self) -> str:
        return self.pg.name()

    def send(self, tensors, peer: int, tag: int = 0):
        return self.pg.send(tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int = 0):
        return self.pg.recv(tensors, peer, tag)

    def allreduce(self, tensors, *args):
        return self.pg.allreduce(tensors, *args)

    def allgather(self, outputs, inputs, *args):
        return self.pg.allgather(outputs, inputs, *args)

    def broadcast(self, tensors, *args):
        return self.pg.broadcast(tensors, *args)

    def barrier(self, *args):
        return self.pg.barrier(*args)

    def abort(self) -> None:
        self.pg.abort()

    def _start_coalescing(self, *args):
        return self.pg._start_coalescing(*args)

    def _end_coalescing(self, *args):
        return self.pg._end_coalescing(*args)

    def __getattr__(self, attr: str) -> Any:
        # anything else a torch backend offers (a bench's own collectives): the backend's
        if attr == "pg":  # not set yet (an object under construction or being unpickled)
            raise AttributeError(attr)
        return getattr(self.pg, attr)

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else self.transport_name
        return f"RefitGroup({self.label!r}, rank {self._rank} of {self.world}, {state})"

    # -- what the group owns ------------------------------------------------------------

    def transport_for(self, build: Callable[["RefitGroup"], Any]) -> Any:
        """The group's transport, ``build(self)`` on first use (the engine knows how to
        build the agreed one: ``engine.refit_transport.transport_of``); ``destroy`` closes
        it."""
        if self.transport is None:
            if self.destroyed:
                raise CallOrderError(f"{self.label}, {self.who}: the refit group was destroyed; "
                                     f"create a new one")
            self.transport = build(self)
        return self.transport

    def destroy(self, timeout_s: float = 60.0) -> int:
        """Shut the group down on this rank (its transport, its communicators and, on NCCL,
        the watchdog threads that poll the group's store), then let go of its board,
        transport and threads. Call it on every rank once no refit will run again.

        The rank hosting the store returns only once every rank has shut down (or after
        ``timeout_s``, with a warning): a peer's NCCL watchdog still polling a store whose
        host has exited prints ``recvValue failed`` tracebacks. A group that failed waits
        at most ``FAILED_LINGER_S``, and its store calls are bounded: a dead or stopped rank
        never counts itself. Returns how many ranks had shut down when this one returned
        (the host: all of them, unless it stopped waiting); 1 on a second call.
        """
        if self.destroyed:
            return 1
        self.destroyed = True
        try:
            if self.transport is not None:
                self.transport.close()  # a colocated transport lets go of mapped memory
            self.pg.shutdown()
            return self._meet_at_shutdown(timeout_s)
        finally:
            self.board, self.transport = None, None
            self.threads.close(join_s=10.0)  # (idle ones end at once; a stuck call's thread
            # ends when the call returns, and is not waited for)

    def _meet_at_shutdown(self, timeout_s: float) -> int:
        board, store, world = self.board, self.store, self.world
        failed = board.failed or board.first_fault(POST_S) is not None

        def count(n: int) -> int:  # a failed group's store may have a stopped host: bounded
            return board.count_shutdown(n) if failed else int(store.add("shutdown", n))

        try:
            done = count(1)
        except Exception as exc:  # noqa: BLE001 - teardown: the host may have gone already
            warnings.warn(f"destroy_refit_group: the group's store is gone ({exc}); its host "
                          f"did not wait for this rank", RuntimeWarning, stacklevel=3)
            return 1
        if self.is_host:
            wait_s = min(timeout_s, FAILED_LINGER_S) if failed else timeout_s
            deadline = time.monotonic() + wait_s
            try:
                while done < world and time.monotonic() < deadline:
                    time.sleep(0.01)
                    done = count(0)
            except Exception:  # noqa: BLE001 - a failed group's bounded call: stop waiting
                if not failed:
                    raise
            if done < world:
                why = "; the group had failed" if failed else ""
                warnings.warn(f"destroy_refit_group: {world - done} of {world} ranks had not "
                              f"shut down after {wait_s:g} s{why}; closing the store anyway",
                              RuntimeWarning, stacklevel=3)
        return done


__all__ = ["FAILED_LINGER_S", "RefitGroup"]
