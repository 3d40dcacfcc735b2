"""Local multi-process worlds on one machine: a pool of spawned workers that run jobs.

Used by the CPU tests and the demo. Starting a Python process that imports torch and
megatron costs seconds, so workers live across jobs; each job runs a function on the
first ``nprocs`` workers with its rank, and every worker cleans up its process groups
(and Megatron's parallel state) after the job so the next one starts clean.

A job that fails on any rank raises in the parent with that rank's traceback; once one rank
failed, the others get a short grace, then the ranks still running are killed and replaced
(a hung collective does not hold the job until its timeout).
"""

from __future__ import annotations

import io
import os
import multiprocessing as mp
import queue
import random
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

_POLL_S = 0.2


@dataclass(frozen=True)
class Job:
    """What a worker knows about the job it runs."""

    rank: int
    nprocs: int
    ports: tuple[int, ...]  # free loopback ports reserved for this job (rendezvous stores)
    host: str = "127.0.0.1"

    @property
    def port(self) -> int:
        return self.ports[0]


# Store ports are picked below Linux's ephemeral range (32768-60999): a port the kernel can
# hand to any outgoing connection (gloo opens many) may be taken again before the store
# binds it, which made runs fail at random.
_PORT_RANGE = (20000, 32000)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """First of ``count`` consecutive loopback ports that were free a moment ago."""
    for _ in range(200):
        base = random.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - count)
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no block of {count} free ports in {_PORT_RANGE}")


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct loopback ports that were free a moment ago."""
    base = free_port_block(count)
    return tuple(range(base, base + count))


def init_gloo_world(job: Job, timeout_s: float = 60.0, port_index: int = 0) -> None:
    """Make this job's ranks one default gloo world over loopback (short timeouts)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(job.host, job.ports[port_index], job.nprocs, job.rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=job.rank, world_size=job.nprocs,
                            timeout=timedelta(seconds=timeout_s))


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)  # plain bytes: no shared-memory file descriptors cross the queue
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _cleanup_after_job() -> None:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        try:
            ps.destroy_model_parallel()
        except Exception:
            pass
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _worker_main(tasks: "mp.Queue", results: "mp.Queue", worker_index: int) -> None:
    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            # leave at once: a normal exit joins the threads that imported libraries (vLLM)
            # leave behind, which holds up the pool's close by its join timeout
            results.close()
            results.join_thread()
            os._exit(0)
        job_id, fn, job, args, kwargs = task
        try:
            value = fn(job, *args, **kwargs)
            results.put((job_id, worker_index, True, _dumps(value)))
        except BaseException:
            results.put((job_id, worker_index, False, traceback.format_exc()))
        finally:
            _cleanup_after_job()


def _echo_rank(text: str) -> int:
    """0 for a rank's own error, 1 for an echo of a peer's (PeerFailure), 2 for a rank
    killed after the grace: the error report starts with the cause."""
    return 2 if text.endswith("; killed") else int("PeerFailure" in text)


def _wait_exit(proc, timeout_s: float) -> None:
    """Wait until ``proc`` has exited (``is_alive`` reaps it), at most ``timeout_s``. Not
    ``join``: it waits for the worker's sentinel pipe to close, and a child the worker
    started keeps it open (``torch_shm_manager``, started by the CPU shared memory of
    colocated refits, outlives a killed worker by up to 10 s)."""
    end = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < end:
        time.sleep(0.01)


@dataclass(frozen=True)
class RankFailure:
    """A rank's failure in a job run with ``return_failures``: its traceback or what happened."""

    rank: int
    text: str


class WorkerPool:
    """``size`` long-lived spawned workers; ``run`` executes one job on the first ``nprocs``."""

    def __init__(self, size: int):
        self.size = size
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._tasks: list = []
        self._results: Optional[mp.Queue] = None
        self._next_job = 0

    def _grow_to(self, count: int) -> None:
        """Start workers until ``count`` are running (workers start only when first needed)."""
        if self._results is None:
            self._results = self._ctx.Queue()
        while len(self._procs) < count:
            self._procs.append(None)
            self._tasks.append(None)
            self._start(len(self._procs) - 1)

    def _start(self, index: int) -> None:
        tasks = self._ctx.Queue()
        proc = self._ctx.Process(target=_worker_main, args=(tasks, self._results, index),
                                 daemon=True)
        proc.start()
        self._tasks[index], self._procs[index] = tasks, proc

    def _replace(self, index: int) -> None:
        """Kill worker ``index`` (if alive) and start a fresh one in its place; the other
        workers, and whatever state they keep between jobs, are untouched."""
        proc = self._procs[index]
        if proc.is_alive():
            proc.kill()
        _wait_exit(proc, 10)
        self._start(index)

    def run(self, fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 180.0,
            num_ports: int = 4, grace_s: float = 15.0, return_failures: bool = False,
            settle_s: Optional[float] = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(job, *args, **kwargs)`` on ranks ``0..nprocs-1``; return results by rank.

        A rank that raises or whose process dies fails the job. From the first failure the
        other ranks get ``grace_s`` to finish (with fault boards they fail within a poll);
        the ranks still running then are killed and replaced, so the job ends early
        instead of at ``timeout_s``. The error puts the first failure that is not a peer's
        echo (``PeerFailure``) on top. With ``return_failures`` a failed rank's entry is a
        ``RankFailure`` instead, and nothing is raised for failures (fault tests).
        With ``settle_s``, once every rank but one has returned (a result or a failure), the
        last one gets ``settle_s`` more, then it is killed: a fault test whose stopped rank
        can never return ends when its survivors have, not at ``timeout_s``.
        """
        if nprocs > self.size:
            raise ValueError(f"job needs {nprocs} processes, the pool has {self.size}")
        self._grow_to(nprocs)
        job_id = self._next_job
        self._next_job += 1
        ports = free_ports(num_ports)
        for rank in range(nprocs):
            self._tasks[rank].put((job_id, fn, Job(rank, nprocs, ports), args, kwargs))
        done: dict[int, Any] = {}
        failures: dict[int, str] = {}  # in the order they arrived
        deadline = time.monotonic() + timeout_s
        why = f"did not finish within {timeout_s:g} s"  # what a rank killed at the deadline hears

        def tighten(seconds: float, reason: str) -> None:
            nonlocal deadline, why
            if time.monotonic() + seconds < deadline:
                deadline, why = time.monotonic() + seconds, reason

        def settle() -> None:
            if settle_s is not None and len(done) + len(failures) == nprocs - 1:
                tighten(settle_s, f"still running {settle_s:g} s after every other rank returned")

        while len(done) + len(failures) < nprocs:
            try:
                got_id, rank, ok, payload = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                for i in range(nprocs):
                    if i not in done and i not in failures and not self._procs[i].is_alive():
                        failures[i] = f"worker process died (exit code {self._procs[i].exitcode})"
                        self._replace(i)
                        tighten(grace_s, f"still running {grace_s:g} s after the first failure")
                        settle()
                if time.monotonic() > deadline:
                    for i in sorted(set(range(nprocs)) - set(done) - set(failures)):
                        failures[i] = f"{why}; killed"
                        self._replace(i)
                continue
            if got_id != job_id:
                continue  # late answer from an earlier, abandoned job
            if ok:
                done[rank] = _loads(payload)
            else:
                failures[rank] = payload
                tighten(grace_s, f"still running {grace_s:g} s after the first failure")
            settle()
        if return_failures:
            return [done[r] if r in done else RankFailure(r, failures[r]) for r in range(nprocs)]
        if failures:
            order = sorted(failures, key=lambda r: _echo_rank(failures[r]))  # stable
            detail = "".join(f"\n--- rank {r} ---\n{failures[r]}" for r in order)
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on ranks "
                               f"{sorted(failures)} (first: rank {order[0]}):{detail}")
        return [done[r] for r in range(nprocs)]

    def close(self, force: bool = False) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p is None:
                continue
            if force:
                p.kill()
            else:
                q.put(None)
        for p in self._procs:
            if p is None:
                continue
            _wait_exit(p, 10)
            if p.is_alive():
                p.kill()
        self._procs, self._tasks, self._results = [], [], None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
