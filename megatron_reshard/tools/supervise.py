"""Run launcher processes side by side (a training launcher, a generation launcher) and end
them the way a job scheduler should: a run that keeps making progress is never killed,
one that stalls is, a survivor gets the time to fail and say why once its peer has ended,
and no process a launcher spawned outlives it.

Each launcher starts in a session of its own, so that ending it ends its whole process
group (``mp.spawn``'s ranks, a vLLM-style driver's workers), stopped processes included.
Progress is whatever ``progress()`` returns: a launcher writes a counter to a file after
each step, and the supervisor compares what it reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, Optional, Sequence


def start(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """A launcher in a session of its own (its process group is its pid)."""
    return subprocess.Popen(list(cmd), start_new_session=True, **popen_kwargs)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's whole process group (a stopped process dies too)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the launcher and everything it started have ended
    proc.wait()


def read_progress(path: str) -> Optional[str]:
    """The progress counter a launcher wrote to ``path`` (None before the first write)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def write_progress(path: Optional[str], step: int) -> None:
    """Record one more step for the supervisor (no-op without a path)."""
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)  # never a half-written counter


def supervise(procs: dict, progress: Callable[[], object], stall_s: float, settle_s: float,
              start_s: Optional[float] = None,
              poll_s: float = 0.2) -> tuple[dict, Optional[str]]:
    """Wait for every launcher in ``procs`` (name -> Popen from ``start``).

    While all run, they are killed once ``progress()`` has not changed for ``stall_s``
    (``start_s``, default ``stall_s``, until it first changes: imports and model builds on
    a loaded machine take longer than a step).
    Once one has ended, the others get ``settle_s`` more to end on their own (their ranks
    fail within the group's timeout and print why), then are killed. Every launcher's
    process group is killed at the end, so nothing it spawned is left behind. Returns
    name -> exit status (None: killed) and why launchers were killed (None: none was).
    """
    codes: dict = {}
    seen, last = progress(), time.monotonic()
    started, bound = seen, stall_s if start_s is None else start_s
    first_end: Optional[float] = None
    why = None
    while len(codes) < len(procs):
        now = time.monotonic()
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                first_end = now if first_end is None else first_end
        if len(codes) == len(procs):
            break
        current = progress()
        if current != seen:
            seen, last, bound = current, now, stall_s
        if first_end is not None and now - first_end > settle_s:
            why = (f"{', '.join(n for n in procs if n not in codes)} still running {settle_s:g} s "
                   f"after {', '.join(n for n in codes)} ended")
            break
        if first_end is None and now - last > bound:
            why = (f"no progress for {bound:g} s" if seen != started
                   else f"no progress in the first {bound:g} s")
            break
        time.sleep(poll_s)
    for name, proc in procs.items():
        if name not in codes:
            codes[name] = None
        kill_group(proc)  # a launcher that ended may have left a child behind
    return codes, why


__all__ = ["kill_group", "read_progress", "start", "supervise", "write_progress"]
