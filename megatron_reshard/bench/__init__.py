"""Benchmark harness: same-run baselines, timing, peak memory, reports.

- ``timing``: barrier-aligned timing of multi-rank calls (median of N, slowest rank).
- ``baselines``: raw point-to-point bandwidth and the gather+broadcast naive refit.
- ``memory``: peak extra GPU memory of a call.
- ``report``: markdown table, JSON, PNG (when matplotlib is installed).
- ``transfer_main``: the transfer benchmark (``scripts/bench_transfer.py``,
  ``megatron-reshard bench transfer``); ``main(argv)``.

Torch only; importing this package starts nothing.
"""

from .baselines import (BaselineGroups, BaselineParam, gather_broadcast, measure_gather_broadcast,
                        measure_raw_p2p, raw_p2p)
from .memory import PeakMemory, measure_peak_extra, track_peak_memory
from .report import Column, format_table, plot_bandwidth, write_report
from .timing import GroupOps, Measurement, Timing, time_collective, time_first_call

__all__ = [
    "BaselineGroups", "BaselineParam", "Column", "GroupOps", "Measurement", "PeakMemory",
    "Timing", "format_table", "gather_broadcast", "measure_gather_broadcast",
    "measure_peak_extra", "measure_raw_p2p", "plot_bandwidth", "raw_p2p", "time_collective",
    "time_first_call", "track_peak_memory", "write_report",
]
