"""How a refit group moves a batch's bytes: one narrow interface, chosen by name.

Torch + stdlib only (the receiver imports it). The refit loop hands every batch to its
group's transport with the engine's batch contract (``execute.xfer_batch``: the same
transfer list on every rank of the group, ``dst`` written in place, bad input raising on
every rank before data moves). Two transports implement it:

- ``"p2p"`` (the default): the engine's schedule of point-to-point rounds over the group's
  process group (gloo on CPU, NCCL on GPU);
- ``"colocated"`` (``colocated.py``): training and generation processes on the same
  devices; each generation rank maps the training ranks' local shards once (CUDA IPC, or
  shared memory on CPU) and copies straight out of them. The group's process group (gloo)
  only carries the control messages: the vote, the barriers, checksums and the commit.

A group made by ``groups.comm.create_refit_group(..., transport=name)`` carries the name
its ranks agreed on at join (``groups.comm.TRANSPORT_NAMES``); ``transport_of`` builds that
transport for the group on first use, keeps it while the group lives and has
``destroy_refit_group`` close it. The names live with the groups (they are agreed there),
the implementations here: the groups never import the engine.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol, Sequence

from megatron_reshard.groups.comm import (DEFAULT_TRANSPORT, TRANSPORT_NAMES, at_destroy,
                                          check_transport_name, group_transport)

from .colocated import ColocatedTransport
from .execute import xfer_batch

# group -> its transport, built on first use; weak: a dropped group drops it
_TRANSPORTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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


class ProcessGroupTransport:
    """The engine's point-to-point rounds over the refit group's process group."""

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
    "p2p": lambda group, store: ProcessGroupTransport(),
    "colocated": ColocatedTransport,
}
assert set(_BUILDERS) == set(TRANSPORT_NAMES) and DEFAULT_TRANSPORT in _BUILDERS


def make_transport(name: str, group: Any, store: Any) -> RefitTransport:
    """The transport ``name`` for ``group``; ``store`` is the group's own (prefixed) store."""
    return _BUILDERS[check_transport_name(name)](group, store)


def attach_transport(group: Any, transport: RefitTransport) -> None:
    """Give ``group`` this transport (``destroy_refit_group`` closes it)."""
    _TRANSPORTS[group] = transport
    at_destroy(group, close_transport)


def transport_of(group: Any) -> RefitTransport:
    """The group's transport: the one its ranks agreed on at join, built on first use; a
    group made elsewhere (or None, the default world) uses p2p."""
    if group is None:
        return ProcessGroupTransport()
    try:
        got: Optional[RefitTransport] = _TRANSPORTS.get(group)
    except TypeError:  # a group object that cannot be weakly referenced
        return ProcessGroupTransport()
    if got is None:
        agreed = group_transport(group)
        if agreed is None:
            return ProcessGroupTransport()
        name, store = agreed
        got = make_transport(name, group, store)
        attach_transport(group, got)
    return got


def close_transport(group: Any) -> None:
    transport = _TRANSPORTS.pop(group, None)
    if transport is not None:
        transport.close()
