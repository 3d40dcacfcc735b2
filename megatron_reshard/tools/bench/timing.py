"""Timing of multi-rank operations: barrier-aligned, warmed up, median of N, max over ranks.

Every rank of ``group`` calls :func:`time_collective` with its own part of the operation.
Each iteration starts right after a barrier (a tiny all-reduce on the device, so it also
aligns GPU streams), and its time is the *slowest* rank's time for that iteration: a
transfer is done only when its last byte has landed. The result is the list of those
per-iteration times (identical on every rank) and its median.

Timers:

- ``"wall"``: ``time.perf_counter`` around the call, with the device synchronized after the
  barrier and after the call. Measures everything the call leaves queued on any stream.
- ``"event"``: CUDA events on the current stream after the barrier and after the call
  (no host round trip inside the interval). Only correct if the call joins its side
  streams back into the current stream before returning.
- ``"auto"``: ``"wall"`` (the robust choice; CUDA only pays a ~10 µs sync per iteration).

``group`` may be ``None`` (the default world), a registered group, or a raw
``ProcessGroup`` that is not registered with c10d (a cross-world refit group): the
helpers here call the group's own methods, which work for all three.

Signatures::

    time_collective(fn, group=None, *, device, iters=10, warmup=3, timer="auto") -> Timing
    Timing(times_s: list[float]).median_s / .min_s / .max_s
    Measurement(name, bytes_per_dst, timing).gbps     # bytes into each destination / median
    GroupOps(group, device): .rank .size .barrier() .allreduce_max(t) .allreduce_min(t)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


def is_registered(group: Optional[dist.ProcessGroup]) -> bool:
    """True for None (the default world) and groups known to c10d; False for raw groups."""
    if group is None:
        return True
    try:
        dist.get_process_group_ranks(group)
        return True
    except (ValueError, RuntimeError, KeyError):
        return False


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GroupOps:
    """The few collectives the timing needs, on any kind of group (see module docstring)."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        self.group = group
        self.device = torch.device(device)
        if group is None:
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.size = group.rank(), group.size()

    def _allreduce(self, t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.group is None:
            dist.all_reduce(t, op=op)
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.group.allreduce([t], opts).wait()
        return t

    def allreduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks; returns a CPU tensor (input may be on CPU)."""
        t = values.to(self.device).clone()
        return self._allreduce(t, dist.ReduceOp.MAX).cpu()

    def allreduce_min(self, values: torch.Tensor) -> torch.Tensor:
        t = values.to(self.device).clone()
        return self._allreduce(t, dist.ReduceOp.MIN).cpu()

    def barrier(self) -> None:
        """All ranks (and, on CUDA, their streams) reach this point before anyone goes on."""
        t = torch.ones(1, device=self.device)
        self._allreduce(t, dist.ReduceOp.SUM)
        synchronize(self.device)


@dataclass
class Timing:
    """Per-iteration times in seconds (each the slowest rank's), identical on every rank."""

    times_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s) if self.times_s else float("nan")

    @property
    def min_s(self) -> float:
        return min(self.times_s) if self.times_s else float("nan")

    @property
    def max_s(self) -> float:
        return max(self.times_s) if self.times_s else float("nan")


@dataclass
class Measurement:
    """A timed transfer: ``bytes_per_dst`` useful bytes land on each destination rank."""

    name: str
    bytes_per_dst: int
    timing: Timing

    @property
    def median_s(self) -> float:
        return self.timing.median_s

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes/s) into each destination rank, from the median time."""
        t = self.timing.median_s
        return self.bytes_per_dst / t / 1e9 if t > 0 else float("nan")


def _resolve_timer(timer: str, device: torch.device) -> str:
    if timer not in ("auto", "wall", "event"):
        raise ValueError(f"timer must be 'auto', 'wall' or 'event', got {timer!r}")
    if timer == "event" and device.type != "cuda":
        raise ValueError(f"timer 'event' needs a CUDA device, got {device}")
    return "wall" if timer == "auto" else timer


def _time_once(fn: Callable[[], Any], ops: GroupOps, timer: str) -> float:
    ops.barrier()
    if timer == "event":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    synchronize(ops.device)
    return time.perf_counter() - t0


def time_collective(fn: Callable[[], Any], group: Optional[dist.ProcessGroup] = None, *,
                    device: torch.device, iters: int = 10, warmup: int = 3,
                    timer: str = "auto") -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then ``iters`` times timed; every rank calls.

    Returns the per-iteration max over ranks (so the same Timing on every rank).
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    device = torch.device(device)
    timer = _resolve_timer(timer, device)
    ops = GroupOps(group, device)
    for _ in range(warmup):
        ops.barrier()
        fn()
        synchronize(device)
    local = [_time_once(fn, ops, timer) for _ in range(iters)]
    slowest = ops.allreduce_max(torch.tensor(local, dtype=torch.float64))
    return Timing(times_s=[float(x) for x in slowest.tolist()])


def time_first_call(fn: Callable[[], Any], group: Optional[dist.ProcessGroup] = None, *,
                    device: torch.device, timer: str = "auto") -> float:
    """Seconds of one barrier-aligned call (slowest rank); for cold calls (plan building)."""
    device = torch.device(device)
    ops = GroupOps(group, device)
    local = _time_once(fn, ops, _resolve_timer(timer, device))
    return float(ops.allreduce_max(torch.tensor([local], dtype=torch.float64))[0])


def median_timer(device: torch.device) -> Callable[[Callable[[], Any], int, int], float]:
    """``measure(fn, iters, warmup) -> median seconds`` of one process's calls: CUDA events
    around each call on CUDA (after a device sync), ``perf_counter`` on CPU."""
    device = torch.device(device)

    def measure(fn: Callable[[], Any], iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure
