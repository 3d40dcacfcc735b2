"""Peak extra GPU memory taken by a call, from the caching allocator's statistics.

"Extra" is the larger of two peaks over the call, each minus its value just before the
call (the allocator's cache emptied first): ``max_memory_reserved`` (what the device had
to give the allocator) and ``max_memory_allocated``. Each misses something: a buffer freed
while a stream still uses it (``record_stream``; NCCL does it to every buffer it sends or
receives) leaves the *allocated* count at once but keeps its memory until that stream is
past it, and a block carved from free space of a segment that holds live tensors needs no
new *reserved* memory. The allocated peak alone is kept too (``allocated_extra_bytes``).
Memory that NCCL allocates for itself (its channel buffers) does not go through the
caching allocator and is not counted.

Signatures::

    measure_peak_extra(fn, device) -> tuple[result, Optional[PeakMemory]]   # None off CUDA
    with track_peak_memory(device) as peak: ...   # peak.value: Optional[PeakMemory] after
    PeakMemory(base, peak, reserved_base, reserved_peak).extra_bytes
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class PeakMemory:
    base_bytes: int           # allocated just before the call
    peak_bytes: int           # peak allocated during the call
    reserved_base_bytes: int  # reserved just before the call (cache emptied)
    reserved_peak_bytes: int  # peak reserved during the call

    @property
    def extra_bytes(self) -> int:
        """The device memory the call needed (see the module docstring)."""
        return max(self.allocated_extra_bytes,
                   self.reserved_peak_bytes - self.reserved_base_bytes)

    @property
    def allocated_extra_bytes(self) -> int:
        return max(0, self.peak_bytes - self.base_bytes)


@dataclass
class _Holder:
    value: Optional[PeakMemory] = None


@contextmanager
def track_peak_memory(device: torch.device) -> Iterator[_Holder]:
    """Record the peak extra CUDA memory of the body into ``holder.value`` (None off CUDA).

    Resets the device's peak statistics: do not nest with other peak measurements.
    """
    device = torch.device(device)
    holder = _Holder()
    if device.type != "cuda":
        yield holder
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # reserved then holds only live blocks
    base = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield holder
    finally:
        torch.cuda.synchronize(device)
        holder.value = PeakMemory(base, torch.cuda.max_memory_allocated(device), reserved,
                                  torch.cuda.max_memory_reserved(device))


def measure_peak_extra(fn: Callable[[], Any], device: torch.device
                       ) -> tuple[Any, Optional[PeakMemory]]:
    """Call ``fn()``; return its result and its peak extra CUDA memory (None off CUDA)."""
    with track_peak_memory(device) as holder:
        result = fn()
    return result, holder.value


def measure_cpu_peak_extra(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Call ``fn()``; return its result and the peak of the bytes it held allocated on the
    CPU allocator above what was held before the call.

    From ``torch.profiler`` with ``profile_memory``: each op reports the bytes it left
    allocated (its own allocations minus its frees) and each later free is a ``[memory]``
    event; their running sum, in time order, peaks at the call's extra memory, to the
    resolution of one op (a buffer allocated and freed inside one op is not seen).
    Allocations outside torch's allocator (gloo's own buffers) are not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return result, peak
