"""Optional backend: NVIDIA's native reshard, ``nccl.m2n`` (package ``nccl-extensions``).

Imported lazily; never required. It is *selected* only when it imports, reports a usable
``reshard`` entry point, and the batch is within its limits (see ``within_limits``). The
Python engine stays the default. This adapter could not be run anywhere this project
tests: its native library needs NCCL >= 2.30 (the GPU machine has 2.28.9), and no CPU
build exists. So ``available()`` is false unless the package loads *and* exposes the names
this adapter expects; the call itself is unverified and kept deliberately thin.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Sequence


@lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(usable, why): tries ``import nccl.m2n`` once per process."""
    try:
        m2n = importlib.import_module("nccl.m2n")
    except Exception as exc:  # ImportError, or OSError from the native library
        return False, f"nccl.m2n does not import: {type(exc).__name__}: {exc}"
    if not hasattr(m2n, "reshard"):
        return False, "nccl.m2n imported but exposes no 'reshard' entry point"
    return True, "nccl.m2n loaded"


def available() -> bool:
    return availability()[0]


def _interval(ranks: Sequence[int]) -> bool:
    return list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))) if ranks else False


def within_limits(keys: Sequence[tuple]) -> tuple[bool, str]:
    """Whether every layout key fits m2n's documented model: each mesh a row-major
    contiguous rank interval, source and destination meshes disjoint."""
    for key in keys:
        _, _, s_ranks, _, _, d_ranks, _ = key
        if not (_interval(s_ranks) and _interval(d_ranks)):
            return False, f"meshes must be contiguous rank intervals; got {s_ranks} -> {d_ranks}"
        if set(s_ranks) & set(d_ranks):
            return False, f"source and destination meshes overlap: {s_ranks} / {d_ranks}"
    return True, "within limits"


# The call into nccl.m2n has never run (see the module docstring); until it has been
# verified on a machine with NCCL >= 2.30, selection refuses it even when it loads.
ADAPTER_VERIFIED = False


def select(keys: Sequence[tuple]) -> tuple[bool, str]:
    """True only when m2n loads, the adapter is verified and every layout is within limits."""
    ok, why = availability()
    if not ok:
        return ok, why
    if not ADAPTER_VERIFIED:
        return False, "nccl.m2n loaded, but this adapter's call into it is not verified yet"
    return within_limits(keys)
