"""Map another process's CPU shared-memory storage by name, without joining its manager.

Torch + stdlib only. The owner shares a CPU storage with torch's ``file_system`` strategy
(``_share_filename_cpu_``): a named POSIX segment (``/dev/shm/torch_<pid>_...``) whose first
``HEADER_BYTES`` hold torch's reference count, plus a ``torch_shm_manager`` process that
unlinks the segment when the owner is gone. Opening it with torch's own call
(``_new_shared_filename_cpu``) also connects this process to the owner's manager, and torch
keeps that connection for the life of the process (a process-wide table in libshm, never
pruned): every owner process this one ever mapped leaves a socket here and, once that owner
has died, keeps its manager alive, and with it the owner's segments, never unlinked (found
by the soak: one socket per restarted training rank on every generation rank, each holding
the dead rank's whole shared model in ``/dev/shm``; ``tests/test_soak_leaks.py``).

``map_segment`` maps the segment itself instead: ``open`` without ``O_CREAT`` (a segment
that is gone is an error, never a new empty one), ``mmap`` shared, the file closed at once
(no fd is kept), and ``munmap`` when the last tensor over it is freed. The owner's reference
count is left alone: the owner unlinks the name when it frees the storage or its manager
does when it dies, and a mapping made here stays valid after the unlink.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

from megatron_reshard.errors import BadInputError

SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps POSIX segments (Linux)
# torch's header before the data of a file_system segment (at::RefcountedMapAllocator:
# its reference count, padded to map_alloc_alignment)
HEADER_BYTES = 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def available() -> bool:
    """Whether segments can be mapped by name here (POSIX shared memory under ``SHM_DIR``)."""
    return os.path.isdir(SHM_DIR)


def segment_path(name: bytes) -> str:
    return os.path.join(SHM_DIR, name.decode().lstrip("/"))


def map_segment(name: bytes, nbytes: int) -> torch.UntypedStorage:
    """The ``nbytes`` of data of the torch ``file_system`` segment ``name``, mapped here
    (read and write, shared with its owner). Raises ``OSError`` if the segment is gone and
    ``BadInputError`` (a ``ValueError``) if its size is not torch's header plus ``nbytes``."""
    path = segment_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # no O_CREAT: a freed segment stays freed
    try:
        size = os.fstat(fd).st_size
        if size != HEADER_BYTES + nbytes:
            raise BadInputError(f"shared segment {path} holds {size} bytes, expected torch's "
                                f"{HEADER_BYTES}-byte header and {nbytes} bytes of data")
        if nbytes == 0:
            return torch.UntypedStorage(0)
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path} ({size} bytes) failed: {os.strerror(err)}")
    finally:
        os.close(fd)  # the mapping keeps the memory; no fd is held while it is mapped
    whole = (ctypes.c_char * size).from_address(addr)
    # unmapped once the last storage over it lets go (torch.frombuffer holds the array)
    weakref.finalize(whole, _libc.munmap, addr, size)
    return torch.frombuffer(whole, dtype=torch.uint8, count=nbytes,
                            offset=HEADER_BYTES).untyped_storage()


__all__ = ["HEADER_BYTES", "SHM_DIR", "available", "map_segment", "segment_path"]
