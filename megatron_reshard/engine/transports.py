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

A group made by ``comm.create_refit_group(..., transport=name)`` carries its transport
(``transport_of``); every rank of the group uses the same one (agreed at join).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol, Sequence

TRANSPORT_NAMES = ("p2p", "colocated")
DEFAULT_TRANSPORT = "p2p"

# group -> its transport (set by comm.create_refit_group); weak: a dropped group drops it
_TRANSPORTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class RefitTransport(Protocol):
    """What the refit loop needs of a transport (see the module docstring)."""

    name: str

    def move(self, transfers: Sequence, group: Any, *, stream=None, staging_bytes: int,
             planner=None, agree: bool = True) -> None:
        """Move one batch, as ``execute.xfer_batch`` does (same arguments, same contract)."""

    def close(self) -> None:
        """Let go of what the transport holds (mapped memory); the group is done."""


class ProcessGroupTransport:
    """The engine's point-to-point rounds over the refit group's process group."""

    name = "p2p"

    def move(self, transfers: Sequence, group: Any, *, stream=None,
             staging_bytes: int = 256 << 20, planner=None, agree: bool = True) -> None:
        from .execute import xfer_batch  # execute imports this package's transport module

        xfer_batch(transfers, group, stream=stream, staging_bytes=staging_bytes,
                   planner=planner, agree=agree)

    def close(self) -> None:
        pass


def check_transport_name(name: str) -> str:
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"unknown refit transport {name!r}: expected one of {TRANSPORT_NAMES}")
    return name


def make_transport(name: str, group: Any, store: Any) -> RefitTransport:
    """The transport ``name`` for ``group``; ``store`` is the group's own (prefixed) store."""
    check_transport_name(name)
    if name == "colocated":
        from .colocated import ColocatedTransport

        return ColocatedTransport(group, store)
    return ProcessGroupTransport()


def attach_transport(group: Any, transport: RefitTransport) -> None:
    _TRANSPORTS[group] = transport


def transport_of(group: Any) -> RefitTransport:
    """The group's transport; a group made elsewhere (or None, the default world) uses p2p."""
    got: Optional[RefitTransport] = None
    if group is not None:
        try:
            got = _TRANSPORTS.get(group)
        except TypeError:  # a group object that cannot be weakly referenced
            got = None
    return got if got is not None else ProcessGroupTransport()


def close_transport(group: Any) -> None:
    transport = _TRANSPORTS.pop(group, None)
    if transport is not None:
        transport.close()
