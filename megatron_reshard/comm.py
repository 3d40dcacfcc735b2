"""Cross-world refit group: a process group over train + generation ranks from a TCPStore.

The two sides already belong to different default worlds (training under torchrun,
generation in another launcher), so the refit group is built from an explicit ``TCPStore``
(+ ``PrefixStore``) directly as a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` backend,
never through ``init_process_group`` (under torchrun that would rendezvous through the
agent store and hang). The result is not registered with c10d: use it through its own
methods (``rank()``, ``size()``, ``send``, ``recv``, ``allreduce``) or pass it to the
engine (``xfer_batch(..., group=pg)``), which accepts such groups. ``destroy_refit_group``
shuts it down at the end of the job.
"""

from __future__ import annotations

import time
import warnings
import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

# group -> (its store, whether this rank hosts it, world size), for destroy_refit_group
_STORES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def create_refit_group(host: str, port: int, rank: int, world_size: int,
                       backend: str = "gloo", timeout_s: float = 300.0,
                       prefix: str = "refit", device: Optional[torch.device] = None,
                       is_store_server: Optional[bool] = None):
    """Join the refit group ``prefix`` of ``world_size`` ranks rendezvousing at host:port.

    Rank 0 hosts the store unless ``is_store_server`` says otherwise. ``device`` (NCCL
    only): when given on every rank, the communicator is created eagerly on that device
    (a collective); otherwise NCCL creates it lazily at first use.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"create_refit_group: backend must be 'gloo' or 'nccl', found {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"create_refit_group: rank {rank} outside [0, {world_size})")
    timeout = timedelta(seconds=timeout_s)
    server = rank == 0 if is_store_server is None else is_store_server
    store = dist.TCPStore(host, port, world_size, server, timeout=timeout)
    store = dist.PrefixStore(f"{prefix}/", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if device is not None:
            pg.eager_connect_single_device(torch.device(device))
    _STORES[pg] = (store, server, world_size)
    return pg


def destroy_refit_group(pg, timeout_s: float = 60.0) -> int:
    """Shut the refit group down on this rank (its communicators and, on NCCL, the
    watchdog threads that poll the group's store). Call it on every rank once no refit
    will run again.

    The rank hosting the store returns only once every rank has shut down (or after
    ``timeout_s``, with a warning): a peer's NCCL watchdog still polling a store whose
    host has exited prints ``recvValue failed`` tracebacks. Returns how many ranks had
    shut down when this one returned (the host: all of them, unless the timeout ran out).
    """
    pg.shutdown()
    entry = _STORES.pop(pg, None)
    if entry is None:  # not made by create_refit_group: no store to meet at
        return 1
    store, server, world = entry
    try:
        done = int(store.add("shutdown", 1))
    except Exception as exc:  # noqa: BLE001 - teardown: the host may have gone already
        warnings.warn(f"destroy_refit_group: the group's store is gone ({exc}); its host "
                      f"did not wait for this rank", RuntimeWarning, stacklevel=2)
        return 1
    if server:
        deadline = time.monotonic() + timeout_s
        while done < world and time.monotonic() < deadline:
            time.sleep(0.01)
            done = int(store.add("shutdown", 0))
        if done < world:
            warnings.warn(f"destroy_refit_group: {world - done} of {world} ranks had not shut "
                          f"down after {timeout_s:g} s; closing the store anyway",
                          RuntimeWarning, stacklevel=2)
    return done
