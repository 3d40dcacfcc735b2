"""Remove torch's shared-memory files that a SIGKILLed process left behind, when no one else can.

Torch + stdlib only. Torch names its POSIX shared-memory files ``/dev/shm/torch_<pid>_...``
(``<pid>``: the creator) and maps them through ``at::RefcountedMapAllocator``: a header whose
first word (an atomic int) counts the mappings opened through torch, in every process; the
close that brings it to 0 unlinks the name, and fails loudly (a ``TORCH_CHECK`` in a
destructor) if the name is gone. A process killed by SIGKILL never gives its count back, so
such a file outlives everyone: the CUDA IPC reference-counter file of every exporter the
colocated transport loses on a GPU (80,064 bytes each; docs/MEASUREMENTS.md, "CUDA IPC
counter files").

A file is removed only when both hold (docs/DESIGN.md, "Removing a dead process's torch
shared-memory files"):

1. its creator ``<pid>`` is dead (no new export of it will be made, no one opens it by name
   on behalf of a live exporter); and
2. its count is greater than the mappings of it that live processes hold now (every line
   naming it in ``/proc/*/maps``): some count belongs to a dead process and is stuck, so the
   count never reaches 0 and no survivor's close will try to unlink the name.

A mapping made without torch's count (``shm_segment.map_segment``) is still a mapping here:
it makes the rule keep a file, never remove one. The count is read before and after the
scan and must not have moved. Anything uncertain leaves the file: a ``/proc/<pid>/maps`` of
this user that cannot be read (except a process holding capabilities this one lacks, which
the kernel hides from it: a sandbox's init, not a peer of this program, whose ranks run
with one set of privileges), a file that changed or went meanwhile, a file of another
user or readable by others (torch makes them 0600). The creator's liveness is judged in
this pid namespace: a caller that may share ``/dev/shm`` with processes of another pid
namespace must pass ``creators`` (the pids it knows are dead here), as the colocated
transport does with its group's peers.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass
from typing import Collection, Optional

from megatron_reshard.engine.shm_segment import HEADER_BYTES, SHM_DIR

_NAME = re.compile(r"torch_(\d+)_")
_COUNT_BYTES = 4  # MapInfo's refcount: a std::atomic<int> at offset 0, native byte order


@dataclass(frozen=True)
class DeadFile:
    """A torch shared-memory file the rule lets go: its creator, its size, its count and the
    live mappings of it when checked."""

    path: str
    creator: int
    size: int
    count: int
    mappings: int


def remove_dead_files(shm_dir: str = SHM_DIR, creators: Optional[Collection[int]] = None,
                      dry_run: bool = False) -> list[DeadFile]:
    """Unlink the ``torch_<pid>_*`` files under ``shm_dir`` that the rule above lets go
    (only those created by ``creators`` when given); returns them (with ``dry_run``: what
    would be unlinked, nothing is). Cheap when no file has a dead creator (one listdir);
    otherwise one read of every process's ``/proc/<pid>/maps``."""
    # the path as /proc/<pid>/maps spells it (a mapping not recognised would not count)
    candidates = _candidates(os.path.realpath(shm_dir), creators)
    if not candidates:
        return []
    before = {path: _count(path, st) for path, _, st in candidates}
    mappings = _live_mappings({path for path, _, _ in candidates})
    if mappings is None:  # a process of this user whose maps cannot be read: leave all
        return []
    removed = []
    for path, creator, st in candidates:
        count = _count(path, st)
        live = mappings.get(path, 0)
        if count is None or count != before[path] or count <= live or _alive(creator):
            continue
        if not dry_run:
            try:
                os.unlink(path)  # what shm_unlink does for a name under /dev/shm
            except OSError:  # unlinked meanwhile (or not ours to unlink): leave it
                continue
        removed.append(DeadFile(path, creator, st.st_size, count, live))
    return removed


def _candidates(shm_dir: str, creators: Optional[Collection[int]]) -> list[tuple]:
    """(path, creator pid, stat) of this user's torch files whose creator is not alive."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    uid, out = os.getuid(), []
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        creator = int(m.group(1))
        if (creators is not None and creator not in creators) or _alive(creator):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if (stat.S_ISREG(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077
                and st.st_size >= HEADER_BYTES):
            out.append((path, creator, st))
    return out


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs here. A zombie does not: it released its memory
    without giving its counts back (a SIGKILLed rank its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True  # cannot tell: alive, so its files stay
    return state not in (b"Z", b"X")


def _count(path: str, st: os.stat_result) -> Optional[int]:
    """The header's count of the file ``st`` still at ``path``; None if it went or changed.
    Opening and reading the file does not touch the count (only torch's mappings do)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None
        word = os.pread(fd, _COUNT_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(word, sys.byteorder, signed=True) if len(word) == _COUNT_BYTES else None


def _live_mappings(paths: set[str]) -> Optional[dict[str, int]]:
    """How many mappings of each of ``paths`` the processes here hold now (lines of their
    ``/proc/<pid>/maps``: a mapping split in parts counts more than once, which only keeps
    files). None when a process of this user, no more privileged than this one, has maps
    that cannot be read."""
    uid, counts = os.getuid(), dict.fromkeys(paths, 0)
    needle = os.path.dirname(next(iter(paths))).encode() + b"/torch_"
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as f:
                data = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
        except OSError:
            try:
                mine = os.stat(f"/proc/{entry}").st_uid == uid
                theirs, ours = _caps(entry), _caps("self")
            except OSError:
                continue  # gone meanwhile
            # capabilities unknown: not known to be stronger (so its maps count as unread)
            stronger = theirs is not None and ours is not None and not theirs <= ours
            if mine and not stronger:
                return None
            continue  # another user's process cannot open this user's 0600 files
        if needle not in data:
            continue
        for line in data.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                path = fields[5].decode(errors="replace")
                if path in counts:  # an unlinked file reads "<path> (deleted)": not counted
                    counts[path] += 1
    return counts


def _caps(pid: str) -> Optional[set[int]]:
    """The permitted capabilities of process ``pid`` (``/proc/<pid>/status``, readable
    for every process), as a set of bit numbers; None where the status has no such line."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("CapPrm:"):
                bits = int(line.split()[1], 16)
                return {i for i in range(bits.bit_length()) if bits >> i & 1}
    return None


__all__ = ["DeadFile", "remove_dead_files"]
