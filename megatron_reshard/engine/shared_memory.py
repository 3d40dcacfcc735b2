"""Storages shared between processes of one host: export on the owner, open on a reader.

Torch + stdlib only. A handle is plain data (tuples of bytes, ints, str) so that it can
travel through a refit group's TCPStore (pickled); file descriptors could not.

- CPU: the storage is moved into shared memory in place (``_share_filename_cpu_``, the
  ``file_system`` strategy of ``torch.multiprocessing``: a named segment plus the
  ``torch_shm_manager`` that unlinks it when its owner is gone). The owner's tensors and
  views stay valid (same storage object, new data pointer), so a Megatron model can be
  shared once at setup. A reader maps the segment by name (``shm_segment``), not through
  the owner's manager, whose connection torch would keep for the reader's whole life.
- CUDA: a CUDA IPC handle of the caching allocator's block (``_share_cuda_``, what
  ``torch.multiprocessing`` sends for a CUDA tensor); the reader maps it with
  ``_new_shared_cuda``. The allocator's IPC reference counting keeps the owner from
  reusing the block while a reader still maps it.

Allocator settings (``allocator_problem``): torch's ``cudaMallocAsync`` backend has no IPC
(``shareIpcHandle`` is not implemented for it), so it is refused up front. With
``expandable_segments:True`` torch exports the segment's physical memory as a file
descriptor that the reader takes over with ``pidfd_getfd`` (same user, ptrace allowed):
measured working on torch 2.11 (one H200, docs/MEASUREMENTS.md), refused on older torch,
where it was not checked here; a failure to export or open is reported with the settings.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch

from megatron_reshard.errors import MegatronReshardError

from . import shm_segment

# the torch version from which expandable segments were seen to work over CUDA IPC here
EXPANDABLE_IPC_FROM = (2, 11)


class SharedMemoryError(MegatronReshardError, RuntimeError):
    """A storage could not be shared or opened; the message says which and why."""


class StorageHandle(NamedTuple):
    """What a reader needs to map one of the owner's storages (plain data)."""

    kind: str         # "cpu" or "cuda"
    key: tuple        # identity of the shared segment (same key: same memory)
    nbytes: int
    args: tuple       # the arguments of the opening call


def allocator_settings() -> str:
    """The CUDA caching allocator's settings of this process. They can only be set by the
    environment before CUDA starts, so that is where they are read (the one exception to
    "configuration enters at the edge": it is the process's own fact, not an option)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")


def _torch_version() -> tuple:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def allocator_problem(settings: Optional[str] = None,
                      version: Optional[tuple] = None) -> Optional[str]:
    """Why CUDA IPC of caching-allocator blocks cannot be used here, or None."""
    settings = allocator_settings() if settings is None else settings
    version = _torch_version() if version is None else version
    opts = {}
    for part in settings.replace(";", ",").split(","):
        if ":" in part:
            k, v = part.split(":", 1)
            opts[k.strip()] = v.strip()
    if opts.get("backend", "native") == "cudaMallocAsync":
        return (f"the CUDA allocator backend is cudaMallocAsync (allocator settings "
                f"{settings!r}); torch cannot share its blocks over CUDA IPC: use the native "
                f"caching allocator for colocated refits")
    if opts.get("expandable_segments", "").lower() == "true" and version < EXPANDABLE_IPC_FROM:
        return (f"expandable_segments:True with torch {'.'.join(map(str, version))}: CUDA IPC "
                f"of expandable segments is verified from torch "
                f"{'.'.join(map(str, EXPANDABLE_IPC_FROM))} on; unset it or upgrade torch")
    return None


def export_storage(storage: torch.UntypedStorage) -> StorageHandle:
    """Share ``storage`` (in place on CPU) and return the handle a reader opens."""
    if storage.device.type == "cpu":
        manager, name, nbytes = storage._share_filename_cpu_()
        return StorageHandle("cpu", (name,), int(nbytes), (manager, name, int(nbytes)))
    if storage.device.type == "cuda":
        problem = allocator_problem()
        if problem is not None:
            raise SharedMemoryError(f"colocated refit refused: {problem}")
        try:
            args = storage._share_cuda_()
        except Exception as exc:  # noqa: BLE001 - say which settings were in force
            raise SharedMemoryError(f"could not export a CUDA storage over IPC (allocator "
                                    f"settings {allocator_settings()!r}): {exc}") from exc
        # (device, handle, storage bytes, offset in the block, ref counter handle and
        # offset, event handle, event sync needed)
        return StorageHandle("cuda", (args[1], int(args[3])), int(args[2]), tuple(args))
    raise SharedMemoryError(f"cannot share a storage on device {storage.device}")


def open_storage(handle: StorageHandle) -> torch.UntypedStorage:
    """Map the owner's storage in this process (the memory stays the owner's)."""
    try:
        if handle.kind == "cpu":
            _manager, name, nbytes = handle.args
            if shm_segment.available():  # not through the owner's torch_shm_manager: a
                return shm_segment.map_segment(name, nbytes)  # connection torch never closes
            return torch.UntypedStorage._new_shared_filename_cpu(*handle.args)
        torch.cuda._lazy_init()
        return torch.UntypedStorage._new_shared_cuda(*handle.args)
    except Exception as exc:  # noqa: BLE001 - the owner may be gone, or IPC not allowed
        extra = (f" (allocator settings {allocator_settings()!r})" if handle.kind == "cuda"
                 else "")
        raise SharedMemoryError(f"could not open a shared {handle.kind} storage of "
                                f"{handle.nbytes} bytes{extra}: {exc}") from exc


def view_of(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple,
            stride: tuple) -> torch.Tensor:
    """A tensor over an opened storage (offset, size, stride in elements of ``dtype``)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def storage_of(t: torch.Tensor) -> Any:
    return t.untyped_storage()
