"""Cross-world refit group: a process group over train + generation ranks from a TCPStore.

The two sides already belong to different default worlds (training under torchrun,
generation in another launcher), so the refit group is built from an explicit ``TCPStore``
(+ ``PrefixStore``) directly as a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` backend,
never through ``init_process_group`` (under torchrun that would rendezvous through the
agent store and hang). The result is not registered with c10d: use it through its own
methods (``rank()``, ``size()``, ``send``, ``recv``, ``allreduce``) or pass it to the
engine (``xfer_batch(..., group=pg)``), which accepts such groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


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
    return pg
