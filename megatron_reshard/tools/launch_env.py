"""The environment defaults every launcher sets once, before any process group exists.

NVLink multicast (NVLS) stays off: on shared hosts its setup fails or hangs when another
job holds the multicast objects, and point-to-point refits do not use it. Launchers call
``apply_nccl_defaults`` at the top of ``main``; no module sets the environment at import.
"""

from __future__ import annotations

import os
from typing import MutableMapping

NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}


def apply_nccl_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each default that the user has not set already."""
    for key, value in NCCL_ENV_DEFAULTS.items():
        environ.setdefault(key, value)
