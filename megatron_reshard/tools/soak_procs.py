"""The soak's processes (``tools.soak``): spawned ranks (``soak_rank.rank_main``) with one
warm spare, and the parent's one call pattern: a command to several ranks at once, the
replies gathered with a deadline, a fault fired by a victim noted with its time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait as wait_conns
from typing import Any, Mapping, Optional

from megatron_reshard.tools.soak_rank import rank_main

START_S = 300.0  # a spawned rank's imports on a loaded machine


class Proc:
    """One spawned rank and the samples of its life."""

    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=rank_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.pid = self.process.pid
        self.ready = False
        self.role: Optional[str] = None
        self.samples: list = []  # (refit count, {metric: value})

    def wait_ready(self, timeout_s: float = START_S) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"a soak rank (pid {self.pid}) did not start in {timeout_s:g} s")
        kind, _ = self.conn.recv()
        assert kind == "ready", kind
        self.ready = True

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL (a stopped process dies too), then reap it."""
        if self.process.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(10)
        self.conn.close()

    def close(self) -> None:
        try:
            self.conn.send(("exit", {}))
        except (OSError, ValueError):
            pass
        self.process.join(5)
        self.kill()


class Procs:
    """The ranks by name ("train", "gen0", ...) and a warm spare for the next start."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.by_name: dict[str, Proc] = {}
        self.spare: Optional[Proc] = Proc(self.ctx)
        self.lives: list[dict] = []  # every rank ever started: role + samples

    def start(self, name: str) -> Proc:
        """Give ``name`` a fresh process (the warm spare) and start the next spare."""
        old = self.by_name.get(name)
        if old is not None:
            old.kill()
        proc, self.spare = self.spare, Proc(self.ctx)
        proc.wait_ready()
        proc.role = name.rstrip("0123456789")
        self.by_name[name] = proc
        self.lives.append({"role": proc.role, "pid": proc.pid, "samples": proc.samples})
        return proc

    def __getitem__(self, name: str) -> Proc:
        return self.by_name[name]

    def call(self, cmds: Mapping[str, tuple[str, dict]], deadline_s: float, *,
             after_fault_s: Optional[float] = None) -> tuple[dict[str, dict], Optional[dict]]:
        """Send each named rank its command, gather the replies.

        A reply is ``{"status": "ok", "result": ...}``, ``{"status": "error", "error", "at",
        ...}``, ``{"status": "died"}`` (the process ended) or ``{"status": "missing"}`` (no
        answer by the deadline). A victim that fires a fault sends its time first; the call
        then ends once every other rank has answered (a stopped victim never does), at the
        latest ``after_fault_s`` after the fault. Returns (replies, the fault or None)."""
        for name, (cmd, kwargs) in cmds.items():
            self.by_name[name].conn.send((cmd, kwargs))
        pending = set(cmds)
        replies: dict[str, dict] = {}
        fault: Optional[dict] = None
        end = time.time() + deadline_s
        while pending:
            if fault is not None and pending <= {fault["victim"]}:
                break
            now = time.time()
            if now > end:
                break
            conns = {self.by_name[n].conn: n for n in pending}
            for conn in wait_conns(list(conns), timeout=min(0.5, max(0.0, end - now))):
                name = conns[conn]
                try:
                    kind, data = conn.recv()
                except (EOFError, OSError):
                    replies[name] = {"status": "died"}
                    pending.discard(name)
                    continue
                if kind == "fault":
                    fault = dict(data, victim=name)
                    if after_fault_s is not None:
                        end = min(end, fault["at"] + after_fault_s)
                    continue
                replies[name] = ({"status": "ok", "result": data} if kind == "ok"
                                 else dict(data, status="error"))
                pending.discard(name)
        for name in pending:
            replies[name] = {"status": "missing"}
        return replies, fault

    def sample(self, refits: int) -> dict[tuple, dict]:
        """Each live rank's figures, recorded against the refit count; returns them by
        (role, pid)."""
        replies, _ = self.call({n: ("sample", {}) for n, p in self.by_name.items() if p.alive()},
                               60.0)
        out = {}
        for name, reply in replies.items():
            if reply["status"] == "ok":
                proc = self.by_name[name]
                proc.samples.append((refits, reply["result"]))
                out[(proc.role, proc.pid)] = reply["result"]
        return out

    def close(self) -> None:
        for proc in [*self.by_name.values(), *([self.spare] if self.spare else [])]:
            proc.close()
        self.by_name, self.spare = {}, None


def error_of(reply: Mapping[str, Any]) -> Optional[dict]:
    """The error of a rank's reply as {"error", "error_type", "at"} (a generation rank's
    refit reports its error inside an ok reply, beside its weights), None if it succeeded."""
    if reply["status"] == "error":
        return reply
    if reply["status"] == "ok" and isinstance(reply["result"], dict) and "error" in reply["result"]:
        return reply["result"]
    return None


__all__ = ["Proc", "Procs", "error_of"]
