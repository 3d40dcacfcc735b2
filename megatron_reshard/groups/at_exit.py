"""A process that leaves a failed refit group behind exits with its own status, never SIGABRT.

Stdlib only. After a failure, daemon threads (``threads.DaemonThreads``) may still sit in a
C++ call that released the GIL: a gloo Work's ``wait()`` abandoned by the failure, a store
call to a stopped host. Such a call returns when its connection closes, typically because
the failed peer's process exits, which happens while the survivors exit too. If it
returns once the interpreter has begun to finalize, CPython (3.11-3.13) ends the thread
with ``pthread_exit`` when it asks for the GIL back; that unwinds through pybind11's
``~gil_scoped_release``, a noexcept destructor, so ``std::terminate`` aborts the process
("terminate called without an active exception", exit -6) after the library's error was
printed (measured: ``tests/prepare_failure_ranks.py``, gdb backtrace of the thread).

So at exit (an ``atexit`` hook, armed when the first group fails: it runs before
finalization, while threads may still take the GIL), if such a call is in flight, the
sockets of every failed group are shut down: the abandoned calls return now, with a
connection error nobody reads, and the hook waits (briefly) until they have. The sockets
are the ones the group's store client and its gloo process group opened
(``opened_sockets``, recorded at creation); the process was about to close them anyway.

A group's fault board hands itself to ``remember_failed`` when the group fails: the hook
needs the failed groups whoever still holds them (a destroyed group lets go of its board,
but calls it abandoned may still be in flight). That list is the exit hook's, not the
groups' state; a board whose calls have all returned is dropped from it at the next
failure.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
from typing import Any, Callable, Iterable, Protocol

from megatron_reshard.groups.threads import DaemonThreads, calls_in_flight, wait_for_calls

# How long the exit hook waits for abandoned calls once their sockets are shut down
# (they return at once; this only bounds a call that was not on one of them).
EXIT_WAIT_S = 2.0

_FD_DIR = "/proc/self/fd"
_armed = threading.Lock()
_is_armed = False


def _socket_fds() -> dict[int, str]:
    """fd -> "socket:[inode]" for every socket this process holds (empty off Linux)."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    out = {}
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def opened_sockets(make: Callable[[], Any]) -> tuple[Any, list[tuple[int, str]]]:
    """``make()``, and the sockets that appeared meanwhile as (fd, "socket:[inode]")."""
    before = _socket_fds()
    value = make()
    after = _socket_fds()
    return value, sorted((fd, link) for fd, link in after.items() if before.get(fd) != link)


def shut_down(sockets: Iterable[tuple[int, str]]) -> None:
    """Shut each connected socket down (both ways) if its fd still holds that same socket;
    the fd stays open (its owner closes it)."""
    for fd, link in sockets:
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") != link:
                continue  # closed, and the number reused: not ours any more
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)  # (a listener is left alone: gloo's
        except OSError:                          # accept loop aborts on a shut one)
            pass  # already closed by the peer
        finally:
            sock.detach()  # the fd belongs to the group, not to this object


class FailedGroup(Protocol):
    """What the hook reads of a failed group's board."""

    sockets: list[tuple[int, str]]   # (fd, "socket:[inode]") its store client and pairs opened
    threads: DaemonThreads           # where its calls ran


# FailedGroup boards whose abandoned calls may still be in flight. Kept for the process on
# purpose: the exit hook must reach them at interpreter exit, whenever the group failed.
# Bounded by the calls still running: each new entry first drops every board whose threads
# have all returned
_failed: list = []


def remember_failed(board: FailedGroup) -> None:
    """Keep ``board`` for the exit hook (once); arm the hook."""
    with _armed:
        _failed[:] = [b for b in _failed if b.threads.busy]  # all returned: nothing to end
        if not any(b is board for b in _failed):
            _failed.append(board)
    arm()


def arm() -> None:
    """Register the exit hook once per process."""
    global _is_armed
    with _armed:
        if _is_armed:
            return
        _is_armed = True
    atexit.register(end_abandoned_calls)


def end_abandoned_calls(wait_s: float = EXIT_WAIT_S) -> bool:
    """The exit hook: end the calls failed groups left in flight; True if none is left."""
    boards = list(_failed)
    pools = [b.threads for b in boards]
    if not calls_in_flight(pools):
        return True
    shut_down(s for b in boards for s in b.sockets)
    return wait_for_calls(pools, wait_s)


__all__ = ["EXIT_WAIT_S", "arm", "end_abandoned_calls", "opened_sockets", "remember_failed",
           "shut_down"]
