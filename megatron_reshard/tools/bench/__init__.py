"""Benchmark harness: same-run baselines, timing, peak memory, reports.

- ``timing``: barrier-aligned timing of multi-rank calls (median of N, slowest rank).
- ``baselines``: raw point-to-point bandwidth and the gather+broadcast naive refit.
- ``memory``: peak extra GPU memory of a call.
- ``report``: markdown table, JSON, PNG (when matplotlib is installed).
- ``env_options``: the NCCL environment options both benchmarks take.
- ``transfer_main``: the transfer benchmark (``scripts/bench_transfer.py``,
  ``megatron-reshard bench transfer``); ``main(argv)``. Its layouts in ``transfer_cases``,
  one measured row in ``transfer_run``.
- ``refit_main``: the refit benchmark (``scripts/bench_refit.py``, ``megatron-reshard bench
  refit``); ``main(argv)``. Its models in ``refit_model``, one case in ``refit_run``, the
  gather+broadcast baseline in ``refit_baseline`` (Megatron names through
  ``megatron.converters``).

Torch only; importing this package starts nothing.
"""

from .baselines import (BaselineGroups, BaselineParam, NaiveRefit, gather_broadcast,
                        measure_gather_broadcast, measure_raw_p2p, raw_p2p)
from .memory import PeakMemory, measure_peak_extra, track_peak_memory
from .patterns import chunk_bounds, pattern_values
from .report import Column, format_table, plot_bandwidth, sig, write_report
from .timing import GroupOps, Measurement, Timing, time_collective, time_first_call

__all__ = [
    "BaselineGroups", "BaselineParam", "Column", "GroupOps", "Measurement", "NaiveRefit",
    "PeakMemory", "Timing", "chunk_bounds", "format_table", "gather_broadcast",
    "measure_gather_broadcast", "measure_peak_extra", "measure_raw_p2p", "pattern_values",
    "plot_bandwidth", "raw_p2p", "sig", "time_collective", "time_first_call",
    "track_peak_memory", "write_report",
]
