"""Peak extra GPU memory taken by a call, from the caching allocator's statistics.

"Extra" is what the device had to give the allocator for the call: the peak of
``torch.cuda.max_memory_reserved`` during the call minus what was reserved just before it,
with the allocator's cache emptied first. Reserved, not allocated: a buffer freed while a
stream still uses it (``record_stream``, as the engine's staging slots and the refit's
stacked experts are) leaves the *allocated* count at once but keeps its memory until that
stream is past it, so the allocated peak understates what a refit needs next to a full
generation engine. The allocated peak is kept beside it (``allocated_extra_bytes``).
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
        return max(0, self.reserved_peak_bytes - self.reserved_base_bytes)

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
