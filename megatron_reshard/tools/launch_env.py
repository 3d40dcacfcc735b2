"""The environment defaults every launcher sets once, before any process group exists.

NVLink multicast (NVLS) stays off: on shared hosts its setup fails or hangs when another
job holds the multicast objects, and point-to-point refits do not use it. Launchers call
``apply_launch_defaults`` (or ``apply_nccl_defaults`` alone) at the top of ``main``; no
module sets the environment at import.

Quieter logs (``QUIET_ENV_DEFAULTS``): torch's C++ warnings carry a 20-line C++ stack each
(a kill -9 of a store's host printed 48 lines on every peer), and the profiler (the
benchmarks' memory figures) prints ``USDT ... profiler_start/stop`` lines; the library's
own errors say what happened. ``TORCH_CPP_LOG_LEVEL`` is read when torch is imported, so
it quiets the processes a launcher starts after setting it (its own workers), not the
launcher itself. A value the user set is kept.
"""

from __future__ import annotations

import os
from typing import MutableMapping

NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}


QUIET_ENV_DEFAULTS = {"TORCH_CPP_LOG_LEVEL": "ERROR", "KINETO_LOG_LEVEL": "6"}


def apply_nccl_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each default that the user has not set already."""
    for key, value in NCCL_ENV_DEFAULTS.items():
        environ.setdefault(key, value)


def apply_launch_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """The NCCL defaults and the quieter logs, each unless the user has set it already."""
    apply_nccl_defaults(environ)
    for key, value in QUIET_ENV_DEFAULTS.items():
        environ.setdefault(key, value)
