"""Peak extra GPU memory taken by a call, from the caching allocator's statistics.

"Extra" is the peak of ``torch.cuda.max_memory_allocated`` during the call minus what was
allocated just before it: staging buffers, packed copies, temporaries. Memory that NCCL
allocates for itself (its channel buffers) does not go through the caching allocator and
is not counted; neither is memory the call frees before the peak is sampled — the peak is
what matters for a refit next to a full generation engine.

Signatures::

    measure_peak_extra(fn, device) -> tuple[result, Optional[PeakMemory]]   # None off CUDA
    with track_peak_memory(device) as peak: ...   # peak.value: Optional[PeakMemory] after
    PeakMemory(base_bytes, peak_bytes).extra_bytes
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class PeakMemory:
    base_bytes: int   # allocated just before the call
    peak_bytes: int   # peak allocated during the call

    @property
    def extra_bytes(self) -> int:
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
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield holder
    finally:
        torch.cuda.synchronize(device)
        holder.value = PeakMemory(base, torch.cuda.max_memory_allocated(device))


def measure_peak_extra(fn: Callable[[], Any], device: torch.device
                       ) -> tuple[Any, Optional[PeakMemory]]:
    """Call ``fn()``; return its result and its peak extra CUDA memory (None off CUDA)."""
    with track_peak_memory(device) as holder:
        result = fn()
    return result, holder.value
