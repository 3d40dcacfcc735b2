"""The benchmarks' NCCL environment options (``--p2p-channels``, ``--nccl-env``), set by
each benchmark's ``main`` before any process group exists (never at import).
"""

from __future__ import annotations

import argparse
import os

from ..launch_env import apply_launch_defaults


def add_env_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--p2p-channels", type=int, default=None, metavar="N",
                   help="set NCCL_MIN_P2P_NCHANNELS and NCCL_MAX_P2P_NCHANNELS to N before init")
    p.add_argument("--nccl-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable before init (repeatable)")


def apply_env(args: argparse.Namespace, environ: "os._Environ | dict" = os.environ) -> dict:
    """Set the NCCL-related environment (and the quieter logs: ``launch_env``) before any
    process group exists; return the NCCL part."""
    apply_launch_defaults(environ)
    if args.p2p_channels is not None:
        environ["NCCL_MIN_P2P_NCHANNELS"] = str(args.p2p_channels)
        environ["NCCL_MAX_P2P_NCHANNELS"] = str(args.p2p_channels)
    for item in args.nccl_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--nccl-env wants KEY=VALUE, got {item!r}")
        environ[key] = value
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_"))}
