"""A channel over one process group: send / recv rounds and the vote's all-reduce.

Below the transport seam, not beside it: a refit group's *transport* (``refit_transport.py``:
"p2p" or "colocated", the one ``RefitTransport`` interface the refit loop hands batches to)
decides how a batch's bytes move; a ``P2PChannel`` is what the engine talks over a group
with, on one device: the "p2p" transport's scheduled rounds, and every vote (the colocated
transport's too, over its gloo group).

A *round* is a set of sends and receives that are all posted before any is waited on;
``P2PChannel.round()`` is a context manager that waits for all of them on exit.

- gloo: every ``send``/``recv`` is posted at once as its own Work (gloo pairs are full
  duplex and buffered), and the round waits on all Works: no ordering deadlock.
- NCCL: the round is one coalesced NCCL group (``_start_coalescing`` / ``_end_coalescing``);
  a raw backend object's methods take no device, a registered ``ProcessGroup``'s take the
  device. Ops in one group run concurrently, so a rank that sends to and receives from the
  same peer cannot deadlock. Coalesced P2P uses the group's full communicator, which must
  already exist on every rank: the engine's agreement all-reduce (run by every rank before
  any data moves) creates it.

The group may be a ``torch.distributed.ProcessGroup`` (``dist.group.WORLD``, ``new_group``),
a backend built directly (``ProcessGroupGloo``/``ProcessGroupNCCL``) or a refit group
(``groups.RefitGroup``, which forwards these calls to its backend and carries the fault
board the waits poll); all offer ``rank()``, ``size()``, ``send([t], peer, tag)``,
``recv([t], peer, tag)``, ``allreduce``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from megatron_reshard.groups.collectives import backend_name, resolve_group
from megatron_reshard.groups.faults import wait_collective, wait_device, wait_works


def _is_registered_pg(group) -> bool:
    return isinstance(group, dist.ProcessGroup)


class P2PChannel:
    """send / recv / round and the vote's all-reduce over one group on one device (see the
    module docstring)."""

    def __init__(self, group, device: Optional[torch.device] = None,
                 backend: Optional[str] = None):
        """``backend``: ``backend_name(group)`` where the caller knows it already."""
        self.group = resolve_group(group)
        self.backend = backend if backend is not None else backend_name(self.group)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
            else torch.device("cpu"))
        self.coalesce = self.backend == "nccl"
        self._works: Optional[list] = None
        self._peers: list[int] = []

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        self._post(self.group.send([tensor], peer, tag), peer, "a send")

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        self._post(self.group.recv([tensor], peer, tag), peer, "a receive")

    def _post(self, work, peer: int, what: str) -> None:
        if self._works is None:
            wait_works([work], self.group, what, [peer])
            return
        self._peers.append(peer)
        if not self.coalesce:
            self._works.append(work)

    @contextmanager
    def round(self):
        """Post sends/recvs inside; all of them are waited for on exit."""
        self._works, self._peers = [], []
        if self.coalesce:
            if _is_registered_pg(self.group):
                self.group._start_coalescing(self.device)
            else:
                self.group._start_coalescing()
        failed = False
        try:
            yield self
        except BaseException:
            failed = True  # the error propagates; the round's Works are abandoned with it
            raise
        finally:
            works, self._works = self._works, None
            if self.coalesce:
                if _is_registered_pg(self.group):
                    work = self.group._end_coalescing(self.device)
                else:
                    work = self.group._end_coalescing()
                if work is not None:
                    works.append(work)
            if not failed:  # a failing peer or the group's timeout raises instead of hanging
                wait_works(works, self.group, "a transfer round", self._peers)

    def start_allreduce_max(self, tensor: torch.Tensor):
        """Launch an in-place MAX all-reduce over the whole group; returns its Work."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        return self.group.allreduce([tensor], opts)

    def allreduce_max(self, tensor: torch.Tensor) -> None:
        """In-place MAX all-reduce over the whole group (blocking for the host)."""
        wait_collective(self.start_allreduce_max(tensor), self.group, "the agreement all-reduce")
        if tensor.is_cuda:
            wait_device(tensor.device, [self.group], "the agreement all-reduce")
