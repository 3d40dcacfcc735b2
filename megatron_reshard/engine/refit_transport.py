"""The refit transport: how one refit group moves a batch's bytes, chosen by name at join.

This is the engine's one transport seam (``RefitTransport``); the refit loop hands every
batch to its group's transport. Not to be confused with ``engine/p2p.py``'s
``P2PChannel``, which is lower: the send / recv rounds and the vote's all-reduce over a
process group, which the "p2p" refit transport runs its schedule through (and the
colocated one its control messages).

Torch + stdlib only (the receiver imports it). Each transport keeps the engine's batch
contract (``execute.xfer_batch``: the same transfer list on every rank of the group, ``dst``
written in place, bad input raising on every rank before data moves). Two implement it:

- ``"p2p"`` (the default, ``P2PRefitTransport``): the engine's schedule of point-to-point
  rounds over the group's process group (gloo on CPU, NCCL on GPU);
- ``"colocated"`` (``colocated.py``): training and generation processes on the same
  devices; each generation rank maps the training ranks' local shards once (CUDA IPC, or
  shared memory on CPU) and copies straight out of them. The group's process group (gloo)
  only carries the control messages: the vote, the barriers, checksums and the commit.

A group made by ``groups.comm.create_refit_group(..., transport=name)`` (a ``RefitGroup``)
carries the name its ranks agreed on at join (``groups.comm.TRANSPORT_NAMES``);
``transport_of`` builds that transport for the group on first use and the group keeps it
(``RefitGroup.transport``) until its ``destroy()`` closes it. The names live with the groups
(they are agreed there), the implementations here: the groups never import the engine.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from megatron_reshard.groups.comm import DEFAULT_TRANSPORT, TRANSPORT_NAMES, check_transport_name
from megatron_reshard.groups.refit_group import RefitGroup

from .colocated import ColocatedTransport
from .execute import xfer_batch


class RefitTransport(Protocol):
    """What the refit loop needs of a transport (see the module docstring)."""

    name: str

    def move(self, transfers: Sequence, group: Any, *, stream=None, staging_bytes: int,
             planner=None, agree: bool = True, overlap: bool = False) -> None:
        """Move one batch, as ``execute.xfer_batch`` does (same arguments, same contract).
        ``overlap``: the caller moves more batches and calls ``flush`` after the last; the
        sources of this batch may then still be read after the call returns (they must
        not change before ``flush``)."""

    def flush(self) -> None:
        """Complete every batch moved with ``overlap`` (its sources may change after)."""

    def close(self) -> None:
        """Let go of what the transport holds (mapped memory); the group is done."""


class P2PRefitTransport:
    """The ``"p2p"`` refit transport: ``xfer_batch``'s schedule of point-to-point rounds
    over the refit group's process group (through ``p2p.P2PChannel``)."""

    name = "p2p"

    def move(self, transfers: Sequence, group: Any, *, stream=None,
             staging_bytes: int = 256 << 20, planner=None, agree: bool = True,
             overlap: bool = False) -> None:
        # ``overlap`` changes nothing here: a source's reads are queued on the stream
        # before the call returns, and stream order keeps them ahead of later writes
        xfer_batch(transfers, group, stream=stream, staging_bytes=staging_bytes,
                   planner=planner, agree=agree)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# name -> how to build it for (group, the group's store); one entry per TRANSPORT_NAMES
_BUILDERS: dict[str, Callable[[Any, Any], RefitTransport]] = {
    "p2p": lambda group, store: P2PRefitTransport(),
    "colocated": ColocatedTransport,
}
assert set(_BUILDERS) == set(TRANSPORT_NAMES) and DEFAULT_TRANSPORT in _BUILDERS


def make_transport(name: str, group: Any, store: Any) -> RefitTransport:
    """The transport ``name`` for ``group``; ``store`` is the group's own (prefixed) store."""
    return _BUILDERS[check_transport_name(name)](group, store)


def transport_of(group: Any) -> RefitTransport:
    """The group's transport: for a ``RefitGroup``, the one its ranks agreed on at join,
    built on first use and kept by the group; any other group (or None, the default world)
    uses p2p."""
    if not isinstance(group, RefitGroup):
        return P2PRefitTransport()
    return group.transport_for(lambda g: make_transport(g.transport_name, g, g.store))
