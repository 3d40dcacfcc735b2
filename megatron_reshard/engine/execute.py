"""Batched execution: describe, check, agree, schedule, run.

``xfer_batch`` runs, on every rank of the group, in this order:

1. the batch description (``describe.py``, ``batch.py``): layouts validated (placements,
   shard dims, every mesh's ranks distinct ranks of the group) and planned; with a
   ``Planner`` passed across calls this, the fingerprint, the schedule and the resolved
   programs are cached per batch (per group), so a repeated call skips them;
2. local checks of this rank's tensors (``checks.py``: side membership, shape, dtype,
   device); a problem in steps 1-2 is not raised yet;
3. the agreement step (``agree.py``): one small MAX all-reduce; a problem on any rank,
   or ranks whose descriptions differ, make every rank raise ``ValueError`` before any
   data moves, each naming the param, the rank, what was expected and what was found;
4. the schedule (``schedule.py``), kept only when every rank's cache holds one built for
   the stride signatures voted now (when a rank has strided tensors, one more all-reduce
   tells every rank which), so every rank decides alike;
5. the rank's program (``program.py``, its steps resolved in ``resolve.py``): copies,
   packing and, on CUDA, the side stream (``overlap.py``).
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from . import agree as agreement
from .agree import Description, Vote, exchange_strided, hash_ints
from .batch import Batch
from .checks import Problem, check_local, local_ok
from .describe import MIN_STAGING_BYTES, Rejected, describe_batch
from .fuse import fused_tensors, scatter
from megatron_reshard.layout.permuted_rows import PermutedRows
from .lane import Lane, call_tensors, lane_for
from .members import stride_keys, with_members
from .plan import Planner
from .schedule import build_schedule
from .sequence import CallSequence
from .p2p import P2PChannel
from megatron_reshard.groups.collectives import backend_name, resolve_group
from ..errors import BadInputError
from ..groups.faults import RefitError

# agree=False: what a failed call adds to its error (sequence.py)
_SKIPPED_NOTE = ("xfer_batch(agree=False) skipped the vote: this call is the one the "
                 "group's history predicts. A peer that called another batch voted "
                 "instead; check that every rank calls the same batches in the same order.")
_UNPREDICTED_NOTE = ("xfer_batch(agree=False) voted: this call is not the one the group's "
                     "history predicts, and peers that called the predicted batch skip the "
                     "vote; check that every rank calls the same batches in the same order.")


def _explained(exc: BaseException) -> bool:
    """A group's own failure report (a peer's failure, a timeout or a closed connection,
    with the silent peer named where one is): the batch-order notes above would point at
    a coding error instead of the stopped or dead process."""
    return isinstance(exc, RefitError)


def xfer_batch(transfers: Sequence, group=None, *, stream=None,
               staging_bytes: int = 256 << 20, planner: Optional[Planner] = None,
               backend: str = "python", agree: bool = True) -> None:
    """Move every transfer of the batch from its source layout to its destination layout.

    ``group``: a torch process group (registered with c10d or not), a refit group
    (``groups.RefitGroup``: its waits then poll its fault board) or None (the default
    world); the engine uses only ``rank()``, ``size()``, ``send``, ``recv``, ``allreduce``,
    ``name()`` and, on NCCL, the coalescing calls of it. Every rank of ``group`` calls with
    the same list (names, shapes, dtypes, layouts, order) and the same ``staging_bytes``; a
    rank passes ``None`` for a side it does not hold. ``dst`` tensors are written in place.
    Pass one ``Planner`` across calls to reuse plans, schedules and execution programs (a
    warm call then costs a few µs per param on the host). Raises ``ValueError`` on every
    rank before any data moves when any rank's input is invalid. ``backend``: "python" or
    "auto", both run this engine.

    ``agree=False`` skips the agreement step (one small all-reduce and the call's only
    host sync) when this call is the one the group's history of calls through this
    planner predicts (``sequence.py``): a loop that repeats its calls, as the refit loop
    from its second refit on, votes until each call has been seen to follow the one
    before it, then no more. A call that is
    not the predicted one votes; if only some ranks deviate, the call ends in the group's
    timeout on every rank rather than in mismatched transfers. Local checks still run on
    every call: a rank that fails one in a skipped vote raises alone, and its peers wait
    for the group's timeout.
    """
    run_batch(transfers, group, stream=stream, staging_bytes=staging_bytes,
              planner=planner, backend=backend, agree=agree)


def run_batch(transfers: Sequence, group, *, stream=None, staging_bytes: int = 256 << 20,
              planner: Optional[Planner] = None, backend: str = "python",
              agree: bool = True, described: bool = True,
              problem: Optional[Problem] = None) -> None:
    """``xfer_batch`` for the engine's own verbs. ``described=False``: this rank holds
    neither side and only stands in for the description (``xferdtensor`` outside both
    meshes), so it abstains from the fingerprint vote. ``problem``: one the caller found
    already, raised on every rank through the agreement step."""
    # gc_paused, inline: its context manager alone costs a warm call ~1 µs of ~10
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _run(transfers, group, stream, staging_bytes, planner, backend, agree, described,
             problem)
    finally:
        if was_enabled:
            gc.enable()


def _run(transfers, group, stream, staging_bytes: int, planner: Optional[Planner],
         backend: str, agree: bool, described: bool, problem: Optional[Problem]) -> None:
    planner = planner if planner is not None else Planner()
    group = resolve_group(group)
    history = planner.call_sequence(group)
    try:
        _call(transfers, group, stream, staging_bytes, planner, backend, agree, described,
              problem, history)
    except BaseException:
        history.forget()  # the ranks' histories may differ now: every rank votes again
        raise


def _call(transfers, group, stream, staging_bytes: int, planner: Planner, backend: str,
          agree: bool, described: bool, problem: Optional[Problem],
          history: CallSequence) -> None:
    facts = history.group_facts
    if facts is None:
        facts = history.group_facts = (group.rank(), group.size(), backend_name(group))
    me, world, backend_of = facts
    device_type = "cuda" if backend_of == "nccl" else "cpu"
    batch = device = strides = None
    tensors: list = []  # this rank's tensors, two per transfer: src at 2 * ti, dst at 2 * ti + 1
    member_keys: dict = {}  # id of a list of members -> its stride key (checks.local_ok)
    if problem is None:
        try:
            batch = describe_batch(transfers, world, me, staging_bytes, backend, planner,
                                   group)
        except Rejected as rejected:
            problem = rejected.problem
    if batch is not None and problem is None:
        lane = batch.lane
        if (lane is not None and not agree and lane.sched is batch.sched
                and _lane_call(lane, batch, transfers, group, backend_of, stream, planner,
                               history, staging_bytes)):
            return
        ok, device = local_ok(transfers, batch.expected, device_type, tensors, member_keys)
        if not ok:  # lists, permuted rows, or a problem: the detailed checks
            problem, device = check_local(transfers, batch.plans, me, device_type,
                                          permuted_dst=True)
    channel = P2PChannel(group, device if problem is None else None, backend_of)
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    # What the schedule and program run: the transfers themselves, or with small params
    # of one layout fused (fuse.py: stacked sources, destination images scattered after).
    xfers, work = transfers, []
    if problem is None:
        if batch.fusion is not None:
            with ctx:
                xfers, tensors, work = fused_tensors(batch.fusion, transfers, batch.plans, me,
                                                     tensors)
            if stream is not None:  # the caller's tensors are read (stack) and written
                _record_stream([x for t in transfers for x in (t.src, t.dst)], stream)
        strides = stride_keys(tensors, member_keys)

    # agree=False: no vote for the call the group's history predicts (sequence.py); its
    # schedule is cached on every rank alike. Any other call (a fresh planner, a new batch,
    # a new order) votes below.
    if not agree and batch is not None and batch.sched is not None:
        key = _sequence_key(batch, staging_bytes)
        if history.predicts(key):
            if problem is not None:  # this rank's tensors changed since the batch agreed
                raise BadInputError(f"xfer_batch: {problem.text()} (agree=False: peers are "
                                 f"not told and wait for the group's timeout)")
            prog = batch.program(xfers, me, strides)
            try:
                _execute(prog, with_members(tensors), channel, stream, planner, work=work)
            except Exception as exc:
                if not _explained(exc):
                    exc.add_note(_SKIPPED_NOTE)
                raise
            history.record(key)
            _keep_lane(batch, tensors, prog, device)
            return
    vote = Vote(problem, len(transfers), staging_bytes,
                batch.fp if described and batch is not None else None,
                batch.sched_hash if batch is not None and batch.sched is not None else 0,
                0 if strides is None else batch.strided_of(strides, tensors).signature,
                tuple(map(int, transfers[0].global_shape))
                if described and transfers and problem is None else None)
    on_cuda = channel.device.type == "cuda"
    ahead = on_cuda and strides is not None and batch.sched is not None
    with ctx:
        ready = _stream_mark(channel) if ahead else None
        pending = agreement.start(vote, channel)
    # Where the schedule is cached, the first round's pack runs while the vote is on its
    # way, on the side stream (after what the caller queued before the call, not after
    # the vote): a local read of this rank's own tensors into its own staging slot,
    # discarded if the call stops.
    early = None
    try:
        if ahead:
            with ctx:
                early = batch.program(xfers, me, strides).pack_ahead(
                    with_members(tensors), channel, planner, ready)
        with ctx:
            try:
                tally = agreement.conclude(pending, lambda: _description(batch, transfers,
                                                                         described),
                                           channel, "xfer_batch")
            except Exception as exc:
                if not agree and not isinstance(exc, ValueError) and not _explained(exc):
                    exc.add_note(_UNPREDICTED_NOTE)  # the vote itself failed
                raise
        if not tally.keep_schedule:  # decided from the all-reduced votes: alike everywhere
            with ctx:
                strided = (exchange_strided(batch.strided_of(strides, tensors).tensors,
                                            len(tensors), channel)
                           if any(tally.signatures) else set())
            # the fused params' stacks and images come out of the budget (fuse.py)
            budget = staging_bytes - (2 * batch.fusion.fused_bytes if batch.fusion else 0)
            # CUDA rounds are double-buffered (see overlap.py): two slots share the budget
            budget = max(MIN_STAGING_BYTES, budget // 2 if on_cuda else budget)
            batch.sched = build_schedule(batch.exec_plans, [t.dtype.itemsize for t in xfers],
                                         me, budget, strided)
            batch.sched_hash = hash_ints(tally.signatures)
            batch.programs.clear()
            if early is not None:
                early.discard()
            early = None
    except BaseException:
        if early is not None:
            early.discard()
        raise
    prog = batch.program(xfers, me, strides)
    _execute(prog, with_members(tensors), channel, stream, planner, early, work)
    history.record(_sequence_key(batch, staging_bytes))
    if not agree:
        _keep_lane(batch, tensors, prog, device)


def _lane_call(lane: Lane, batch: Batch, transfers, group, backend: str, stream,
               planner: Planner, history: CallSequence, staging_bytes: int) -> bool:
    """The call run through its batch's lane (``lane.py``) when it is the predicted one
    and its tensors match the lane's; False: nothing was done, the full path runs."""
    key = _sequence_key(batch, staging_bytes)
    if not history.predicts(key):
        return False
    tensors = call_tensors(transfers)
    flat = lane.flat(tensors, batch.expected)
    if flat is None:
        return False
    try:
        if lane.copies is not None:  # local copies only: the kept batch, same addresses
            if not lane.same_copies(flat):
                return False
            if stream is None:
                lane.copies.run()
            else:
                with torch.cuda.stream(stream):
                    _record_stream(flat, stream)
                    lane.copies.run()
        else:
            _execute(lane.program, with_members(tensors),
                     P2PChannel(group, lane.device, backend), stream, planner)
    except Exception as exc:
        if not _explained(exc):
            exc.add_note(_SKIPPED_NOTE)
        raise
    history.record(key)
    return True


def _keep_lane(batch: Batch, tensors: list, prog, device) -> None:
    """After a call with ``agree=False`` went through: its lane, for the next such call
    (none for a fused batch: its stacks and scatters take the full path)."""
    if batch.fusion is not None:
        batch.lane = None
        return
    old = batch.lane if batch.lane is not None and batch.lane.program is prog else None
    batch.lane = lane_for(tensors, batch.expected, batch.sched, prog, device, old)


def _sequence_key(batch: Batch, staging_bytes: int) -> tuple:
    """What every rank's call must share for their operations to match (sequence.py)."""
    return batch.fp, staging_bytes, batch.sched_hash


def _stream_mark(channel: P2PChannel) -> "torch.cuda.Event":
    """An event at the current stream's present end: what the caller queued so far."""
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream(channel.device))
    return mark


def _description(batch: Optional[Batch], transfers, described: bool) -> Description:
    if described and batch is not None:
        return batch.description(transfers)
    return Description([getattr(t, "name", f"#{i}") for i, t in enumerate(transfers)],
                       None, None)  # abstains


def _execute(prog, tensors, channel: P2PChannel, stream, planner: Planner, early=None,
             work=()) -> None:
    """Run this rank's part of an agreed batch (its program for these strides); then copy
    the fused images into their members' destinations."""
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        if stream is not None:
            _record_stream(tensors, stream)
        prog.run(tensors, channel, planner, early)
        if work:
            scatter(work)


def _record_stream(tensors, stream) -> None:
    """Keep the CUDA tensors (members of lists too) from reuse until ``stream`` is past
    this point, whichever stream allocated them."""
    for x in with_members(list(tensors)):
        if isinstance(x, PermutedRows):
            x = x.storage
        if isinstance(x, torch.Tensor) and x.is_cuda:
            x.record_stream(stream)

