"""``megatron-reshard clean-shm``: list, and with ``--yes`` unlink, torch's shared-memory
files that SIGKILLed processes left in ``/dev/shm`` and no survivor will unlink
(``engine.ipc_counters``: the creator is dead and its count is stuck above the live mappings).
Imports no torch at parse time."""

from __future__ import annotations

import argparse

DESCRIPTION = (
    "List, and with --yes unlink, torch's shared-memory files (/dev/shm/torch_<pid>_*) that "
    "SIGKILLed processes left behind and no survivor will unlink: the creator is dead and the "
    "file's count is stuck above the live mappings of it (a CUDA IPC reference-counter file "
    "per killed exporter on a GPU).\n\nA dry run by default: each file with its size, its "
    "creator, its count and the live mappings of it. Only this user's files; a file whose "
    "last live mapper would unlink it itself is never listed.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--yes", action="store_true", help="unlink the files listed")
    parser.add_argument("--dir", default="/dev/shm", help="where the files are")


def run(args: argparse.Namespace) -> int:
    from megatron_reshard.engine.ipc_counters import remove_dead_files  # imports torch

    files = remove_dead_files(args.dir, dry_run=not args.yes)
    verb = "removed" if args.yes else "would remove"
    for f in files:
        print(f"{verb} {f.path}: {f.size} bytes, creator pid {f.creator} (dead), count "
              f"{f.count}, live mappings {f.mappings}")
    total = sum(f.size for f in files)
    print(f"{verb} {len(files)} file(s), {total / 2**20:.3f} MiB"
          + ("" if args.yes or not files else "; run again with --yes to unlink them"))
    return 0
