"""Point-to-point transport over a torch process group, registered with c10d or not.

A *round* is a set of sends and receives that are all posted before any is waited on;
``P2PTransport.round()`` is a context manager that waits for all of them on exit.

- gloo: every ``send``/``recv`` is posted at once as its own Work (gloo pairs are full
  duplex and buffered), and the round waits on all Works: no ordering deadlock.
- NCCL: the round is one coalesced NCCL group (``_start_coalescing`` / ``_end_coalescing``);
  a raw backend object's methods take no device, a registered ``ProcessGroup``'s take the
  device. Ops in one group run concurrently, so a rank that sends to and receives from the
  same peer cannot deadlock. Coalesced P2P uses the group's full communicator, which must
  already exist on every rank: the engine's agreement all-reduce (run by every rank before
  any data moves) creates it.

The group may be a ``torch.distributed.ProcessGroup`` (``dist.group.WORLD``, ``new_group``)
or a backend built directly (``ProcessGroupGloo``/``ProcessGroupNCCL``, see ``comm.py``);
both offer ``rank()``, ``size()``, ``send([t], peer, tag)``, ``recv([t], peer, tag)``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist


def resolve_group(group):
    """The group to talk over: ``None`` means the default world."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError("group is None and no default process group is initialised")
        return dist.group.WORLD
    return group


def backend_name(group) -> str:
    """'gloo', 'nccl', ... for a ProcessGroup or a raw backend object."""
    for attr in ("_get_backend_name", "name"):
        fn = getattr(group, attr, None)
        if fn is not None:
            try:
                name = str(fn()).lower()
            except Exception:
                continue
            for known in ("nccl", "gloo", "ucc", "mpi"):
                if known in name:
                    return known
    return str(dist.get_backend(group)).lower()


def _is_registered_pg(group) -> bool:
    return isinstance(group, dist.ProcessGroup)


class P2PTransport:
    """send/recv/round over one group on one device (see the module docstring)."""

    def __init__(self, group, device: Optional[torch.device] = None):
        self.group = resolve_group(group)
        self.backend = backend_name(self.group)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
            else torch.device("cpu"))
        self.coalesce = self.backend == "nccl"
        self._works: Optional[list] = None

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        work = self.group.send([tensor], peer, tag)
        if self._works is None:
            work.wait()
        elif not self.coalesce:
            self._works.append(work)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        work = self.group.recv([tensor], peer, tag)
        if self._works is None:
            work.wait()
        elif not self.coalesce:
            self._works.append(work)

    @contextmanager
    def round(self):
        """Post sends/recvs inside; all of them are waited for on exit."""
        self._works = []
        if self.coalesce:
            if _is_registered_pg(self.group):
                self.group._start_coalescing(self.device)
            else:
                self.group._start_coalescing()
        try:
            yield self
        finally:
            works, self._works = self._works, None
            if self.coalesce:
                if _is_registered_pg(self.group):
                    work = self.group._end_coalescing(self.device)
                else:
                    work = self.group._end_coalescing()
                if work is not None:
                    works.append(work)
            for w in works:
                w.wait()

    def allreduce_max(self, tensor: torch.Tensor) -> None:
        """In-place MAX all-reduce over the whole group (blocking for the host)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([tensor], opts).wait()
