"""Cross-world refit group: a process group over train + generation ranks from a TCPStore.

The two sides already belong to different default worlds (training under torchrun,
generation in another launcher), so the refit group is built from an explicit ``TCPStore``
(+ ``PrefixStore``) directly as a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` backend,
never through ``init_process_group`` (under torchrun that would rendezvous through the
agent store and hang). The result is a ``refit_group.RefitGroup``: the backend (not
registered with c10d) and everything kept for the group (store, fault board, threads, its
transport once built). Use it through its own methods (``rank()``, ``size()``, ``send``,
``recv``, ``allreduce``) or pass it to the engine (``xfer_batch(..., group=group)``).
``group.destroy()`` (or ``destroy_refit_group(group)``) shuts it down at the end of the job.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputError
from megatron_reshard.groups import at_exit
from megatron_reshard.groups.faults import POLL_S, FaultBoard, RefitError, RefitTimeout
from megatron_reshard.groups.refit_group import FAILED_LINGER_S, RefitGroup
from megatron_reshard.groups.threads import DaemonThreads

# The transports a refit group can agree on at join (``engine.refit_transport`` builds the
# agreed one for the group on first use and the group keeps it: ``RefitGroup.transport``).
TRANSPORT_NAMES = ("p2p", "colocated")
DEFAULT_TRANSPORT = "p2p"


def check_transport_name(name: str) -> str:
    if name not in TRANSPORT_NAMES:
        raise BadInputError(f"unknown refit transport {name!r}: expected one of {TRANSPORT_NAMES}")
    return name


def create_refit_group(host: str, port: int, rank: int, world_size: int,
                       backend: str = "gloo", timeout_s: float = 300.0,
                       prefix: str = "refit", device: Optional[torch.device] = None,
                       is_store_server: Optional[bool] = None, *, who: Optional[str] = None,
                       label: Optional[str] = None,
                       transport: Optional[str] = None) -> RefitGroup:
    """Join the refit group ``prefix`` of ``world_size`` ranks rendezvousing at host:port.

    Rank 0 hosts the store unless ``is_store_server`` says otherwise. ``device`` (NCCL
    only): when given on every rank, the communicator is created eagerly on that device
    (a collective); otherwise NCCL creates it lazily at first use. ``who`` names this
    process in errors its peers raise ("train rank 3 (PP stage 1)"), ``label`` the group
    ("refit group of PP stage 1").

    Before any communicator exists the ranks check, through the store, that they agree
    on the group (size, backend) and that no rank number is taken twice; a disagreement
    raises on every rank at once with what each rank said. The group gets a fault board
    (``megatron_reshard.groups.faults``): its waits raise instead of hanging when a peer fails.

    ``transport`` (one of ``TRANSPORT_NAMES``; ``engine.refit_transport.transport_of`` builds
    it for the group on first use, and the group keeps it): how the group moves bytes, "p2p"
    (point-to-point over the group) or "colocated" (copies out of the training ranks' mapped
    memory; the group then carries control messages only, over gloo). None follows the
    ranks that chose (a vLLM worker follows its trainer); ranks that chose differently are
    refused at join; nobody chose: "p2p".
    """
    if backend not in ("gloo", "nccl"):
        raise BadInputError(f"create_refit_group: backend must be 'gloo' or 'nccl', found {backend!r}")
    if not 0 <= rank < world_size:
        raise BadInputError(f"create_refit_group: rank {rank} outside [0, {world_size})")
    if transport is not None:
        check_transport_name(transport)
        if transport == "colocated" and backend != "gloo":
            raise BadInputError(f"create_refit_group: the colocated transport talks over gloo "
                             f"(its data never crosses the group), found backend {backend!r}")
    label = label or f"refit group at {host}:{port}"
    who = who or f"group rank {rank} of the {label}"
    timeout = timedelta(seconds=timeout_s)
    # one deadline for the whole join: reaching the store, then waiting for the peers (and
    # the host's linger after a failed join) all fit in timeout_s, never one after another
    deadline = time.monotonic() + timeout_s
    server = rank == 0 if is_store_server is None else is_store_server
    try:
        raw, store_sockets = at_exit.opened_sockets(
            lambda: dist.TCPStore(host, port, None, server, timeout=timeout,
                                  wait_for_workers=False))
    except Exception as exc:  # noqa: BLE001 - say which store and who hosts it
        role = "host" if server else "reach"
        raise RefitError(f"{label}: {who} could not {role} the group's store at {host}:{port} "
                         f"within {timeout_s:g} s (group rank 0 hosts it): {exc}") from exc
    store = dist.PrefixStore(f"{prefix}/", raw)
    threads = DaemonThreads("refit-group")  # the group's: its store calls and Work waits
    board = FaultBoard(store, rank, world_size, who, label, timeout_s, threads, backend)
    try:
        chosen = _join(board, backend, transport, deadline)
    except BaseException:
        threads.close()  # the group never came to be: nobody else would end them
        raise
    board.sockets = store_sockets if not server else []  # the host's: a listener, peers'
    if backend == "gloo":
        pg, pair_sockets = at_exit.opened_sockets(
            lambda: dist.ProcessGroupGloo(store, rank, world_size, timeout))
        board.sockets += pair_sockets
    else:
        opts = dist.ProcessGroupNCCL.Options()
        # NCCL's own watchdog fires later than our waits, which then abort with a clear error
        opts._timeout = timeout + timedelta(seconds=NCCL_TIMEOUT_MARGIN_S)
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if device is not None:
            pg.eager_connect_single_device(torch.device(device))
    return RefitGroup(pg, store, board, threads, is_host=server, transport_name=chosen)


NCCL_TIMEOUT_MARGIN_S = 10.0


def _join(board: FaultBoard, backend: str, transport: Optional[str], deadline: float) -> str:
    """Every rank posts what it believes the group is; each reads all posts until the group
    is complete or ``deadline`` (``time.monotonic()``) passes. A disagreement (size,
    backend, transport, a rank number twice or out of range) is posted on the board, so
    every rank raises it within a poll. Returns the group's transport."""
    store, rank, world = board.store, board.rank, board.world
    mine = {"rank": rank, "world": world, "backend": backend, "who": board.who,
            "transport": transport}
    seq = int(store.add("join/count", 1))
    store.set(f"join/{seq}", json.dumps(mine))
    try:
        seen = _join_until_complete(board, mine, deadline)
    except RefitError:
        _linger_if_host(board, deadline)
        raise
    board.names = {r: s["who"] for r, s in seen.items()}  # errors name a silent peer
    chosen = {s.get("transport") for s in seen.values()} - {None}
    return chosen.pop() if chosen else DEFAULT_TRANSPORT


def _join_until_complete(board: FaultBoard, mine: dict, deadline: float) -> dict:
    store, world = board.store, board.world
    seen: dict[int, dict] = {}
    read = 0
    while True:
        board.raise_if_failed("joining the group")
        count = int(store.add("join/count", 0))
        while read < count:
            key = f"join/{read + 1}"
            if not store.check([key]):
                break  # counted, not written yet
            other = json.loads(store.get(key))
            read += 1
            problem = _join_problem(mine, other, seen)
            if problem is not None:
                board.post(problem)
                raise RefitError(f"{board.label}: {problem}")
            seen[other["rank"]] = other
        if len(seen) == world:
            return seen
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(seen))
            raise RefitTimeout(f"{board.label}, {board.who}: group ranks {missing} of {world} did "
                               f"not join within {board.timeout_s:g} s (joined: "
                               f"{[seen[r]['who'] for r in sorted(seen)]})")
        time.sleep(POLL_S)


JOIN_LINGER_S = 5.0


def _linger_if_host(board: FaultBoard, join_deadline: float) -> None:
    """A failed join: every rank counts itself out; the rank hosting the store waits (a
    few seconds at most, never past the join's deadline) for the others, so that slower
    ranks still read why."""
    try:
        board.store.add("join/failed", 1)
        if board.rank != 0:
            return
        deadline = min(time.monotonic() + JOIN_LINGER_S, join_deadline)
        while int(board.store.add("join/failed", 0)) < board.world and time.monotonic() < deadline:
            time.sleep(POLL_S)
    except Exception:  # noqa: BLE001 - best effort: the store may be gone already
        pass


def _join_problem(mine: dict, other: dict, seen: dict) -> Optional[str]:
    if other["world"] != mine["world"] or other["backend"] != mine["backend"]:
        return (f"ranks disagree on the group: {mine['who']} (rank {mine['rank']}) expects "
                f"{mine['world']} ranks over {mine['backend']}, {other['who']} (rank "
                f"{other['rank']}) expects {other['world']} ranks over {other['backend']}")
    theirs = other.get("transport")
    if theirs is not None and mine["transport"] is not None and theirs != mine["transport"]:
        return (f"ranks disagree on the group's transport: {mine['who']} (rank {mine['rank']}) "
                f"chose {mine['transport']!r}, {other['who']} (rank {other['rank']}) "
                f"chose {theirs!r}")
    if not 0 <= other["rank"] < mine["world"]:
        return (f"{other['who']} joined as rank {other['rank']}, outside the group's ranks "
                f"0..{mine['world'] - 1}")
    if other["rank"] in seen:
        return (f"rank {other['rank']} joined twice: by {seen[other['rank']]['who']} and by "
                f"{other['who']}")
    return None


def destroy_refit_group(group, timeout_s: float = 60.0) -> int:
    """``group.destroy(timeout_s)`` for a ``RefitGroup`` (see there; returns how many ranks
    had shut down); any other process group is shut down and 1 returned."""
    if isinstance(group, RefitGroup):
        return group.destroy(timeout_s)
    group.shutdown()
    return 1


__all__ = ["DEFAULT_TRANSPORT", "FAILED_LINGER_S", "RefitGroup", "TRANSPORT_NAMES",
           "check_transport_name", "create_refit_group", "destroy_refit_group"]
