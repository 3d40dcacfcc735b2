"""Colocated transport: generation ranks copy straight out of the training ranks' memory.

Torch + stdlib only. Training and generation processes share the devices (or one host's
CPU memory in tests). Per batch, on every rank of the refit group, in this order:

1. the batch is described and planned by the engine's own code (``describe.describe_batch``:
   same validation, same ``Planner`` cache, same fingerprint) and this rank's tensors are
   checked (``checks``); with ``agree`` the engine's vote runs (``agree.py``), so bad
   input raises on every rank before any byte moves. A rank whose tensors are the same
   as at the batch's last checked call (``_signature``: address, size, stride, dtype,
   device of every tensor and member, gathered in C and compared in one ``==``) skips
   the per-tensor ``check_local`` of lists of members (its verdict depends on nothing
   else);
2. a training rank waits for its device (the optimizer step's writes are complete: the
   caller's current stream and the refit's stream, seen by a query when idle), shares the
   storages under its source views and, when the views changed since the batch's last
   call, publishes their description under a new generation number
   (``colocated_views``). "Changed" is decided by the same signature: the storages under
   the published views are kept alive, so an equal signature means the same memory as
   the one the generation ranks mapped.
   *Optimistic order*: a training rank whose batch kept its views at the last call
   (Megatron's parameters live in stable buffers) enters the ready barrier with its
   published generation at once and runs step 1's checks and the signature while the
   generation ranks copy; a generation rank enters it at once too and runs step 1's
   checks while it waits there for the training ranks (its copies start only after they
   passed, so its own bad input moves no byte). A rank that finds a change or a problem
   says so in its verdict word, and every rank moves the batch again in the checked order
   (step 1 first): the copies are then redone from the new views, and bad input raises
   there, on every rank. That costs one extra copy of such a batch and takes the checks
   (~1 ms for 1,602 training tensors) off the critical path of every other refit; a
   batch whose views changed is moved in the checked order until they stay unchanged;
3. the *ready* barrier (``host_flags``: one word per rank in a table of shared host
   memory, no network round trip): every rank learns each training rank's generation for
   the batch and whether any rank found a local problem (then all raise). Reads start
   only after it;
4. a generation rank maps what changed (opened storages are kept across refits: a
   training storage is reopened only when it changes), derives its reads from the plan's
   ownerships (each destination piece read once, directly from one holder of each source
   box: replicas spread over generation ranks; no phase-1 exchange between generation
   ranks) and queues them as plain copies (``colocated_copies``) on its stream, with an
   event after them;
5. the *verdict* barrier (the same table): every rank's checks passed, or the batch is
   moved again (step 2);
6. *copied*: each rank reports, in its own word, the last batch whose copies completed
   (batches complete in order); a training rank lets go of a batch's tensors (and may
   then free a pre-hook buffer, or change its sources) only after every rank reported
   it. Without ``overlap`` both sides wait for that inside ``move``. With ``overlap``
   (the refit loop's batches; ``flush`` at the end) a generation rank returns with its
   copies queued, like the process-group transport, and reports them from its next
   waits, and a training rank waits for the batch before this one only, so one batch's
   host work (both sides' describe and checks, the loop's hooks) runs while the previous
   batch's copies run. A rank's waits never stop it from reporting its own copies, so
   the two sides need not agree on ``overlap``.

The commit vote, versions and weight state are the refit loop's, unchanged. A rank that
dies or hangs leaves its peers waiting in a barrier, which never waits blind: it reads the
group's fault board, looks whether the ranks it waits for are alive and keeps the group's
deadline (``host_flags``), so they raise within the group's timeout. After any failure
this transport marks itself failed in the table (a waiting peer raises at once), lets go
of every mapping and refuses further batches, so memory of a dead process is never read
again.
"""

from __future__ import annotations

from operator import attrgetter
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.groups.faults import RefitError, board_of, wait_device

from . import agree as agreement
from .agree import Description, Vote
from .checks import check_local, local_ok
from .colocated_completion import Completions
from .colocated_copies import CopyBatch, read_pairs
from megatron_reshard.layout.permuted_rows import PermutedRows
from .colocated_views import MappedViews, PublishedViews
from .describe import Rejected, describe_batch
from .host_flags import READY, VERDICT, HostFlags
from .ipc_counters import remove_dead_files
from .members import LISTS, is_members
from .plan import Planner
from .p2p import P2PChannel

_CACHE = 64          # copy batches kept per transport (one per batch and generation)
NAP_S = 5e-5         # longest nap of the device waits on a refit's critical path
OVERLAP_DEPTH = 1    # batches a training rank lets be read after its ``move`` returned


class ColocatedTransport:
    """The ``"colocated"`` refit transport of one refit group (see the module docstring)."""

    name = "colocated"

    def __init__(self, group: Any, store: Any, timeout_s: float = 300.0):
        self.group, self.store = group, store
        self.me, self.world = group.rank(), group.size()
        self._control = P2PChannel(group, torch.device("cpu"))
        self._broken: Optional[str] = None
        board = board_of(group)
        self._flags = HostFlags(store, self.me, self.world, board,
                                board.timeout_s if board is not None else timeout_s)
        self._checked: dict = {}     # batch fp -> signature of tensors check_local passed
        # training side
        self._sources = PublishedViews(store, self.me)
        self._stable: dict = {}      # batch fp -> its views did not change at the last call
        # generation side
        self._views = MappedViews(store)
        self._batches: dict = {}     # (fp, generations, dst key) -> CopyBatch
        self._reads = Completions(self._flags)  # reads in flight, reported, waited for

    # -- the interface -------------------------------------------------------------

    def move(self, transfers: Sequence, group: Any, *, stream=None,
             staging_bytes: int = 256 << 20, planner: Optional[Planner] = None,
             agree: bool = True, overlap: bool = False) -> None:
        """Move one batch (``execute.xfer_batch``'s contract). Without ``overlap`` the call
        returns once every rank's reads of the batch are complete (a training rank may
        change its sources after it). With ``overlap`` (the refit loop's batches) a
        generation rank returns once its copies are queued on ``stream`` and a training
        rank once the batch before this one was read, so that one batch's host work runs
        while the previous batch's copies run; ``flush`` completes them all."""
        if group is not self.group:
            raise BadInputError("ColocatedTransport.move: called with another group than its own")
        # not ``planner or Planner()``: an empty Planner is falsy (``__len__``), and a fresh
        # one per call re-planned every batch (plan, fusion) on every refit
        self._guarded(self._move, transfers, stream, staging_bytes,
                      planner if planner is not None else Planner(), agree, overlap)

    def flush(self) -> None:
        """Complete every batch moved with ``overlap``: a generation rank waits for its
        copies and reports them; a training rank waits until every rank has read what it
        published (its sources may change after it)."""
        self._guarded(self._reads.settle)

    def close(self) -> None:
        gone = self._flags.gone_peers() if self._broken is not None else []
        self._reads.clear()  # before the mappings: no copy of this rank still reads them
        self._flags.close()
        self._batches.clear()
        self._views.clear()
        self._sources.clear()
        self._checked.clear()
        self._stable.clear()
        if gone:  # a killed peer's CUDA IPC counter files, once no survivor would unlink
            # them (one listdir; the /proc scan only for a file of theirs)
            remove_dead_files(creators=gone)

    def _guarded(self, fn, *args) -> None:
        if self._broken is not None:
            raise RefitError(f"the colocated transport of this refit group failed earlier "
                             f"({self._broken}); create a new refit group")
        try:
            fn(*args)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            self._flags.mark_failed()  # a peer waiting in a barrier raises at once
            self.close()  # a peer may be dead: never read its memory again
            raise

    # -- one batch -----------------------------------------------------------------

    def _move(self, transfers, stream, staging_bytes: int, planner: Planner,
              agree: bool, overlap: bool, checked_first: bool = False) -> None:
        me, world = self.me, self.world
        reads = self._reads
        reads.report()
        device_type = _device_type(transfers)
        problem = batch = None
        tensors: list = []
        try:
            batch = describe_batch(transfers, world, me, staging_bytes, "python", planner,
                                   self.group)
        except Rejected as rejected:
            problem = rejected.problem
        sources = problem is None and any(t.src is not None for t in transfers)
        dests = problem is None and any(t.dst is not None for t in transfers)
        published = self._sources.of(batch.fp) if sources else None
        # optimistic order: a rank checks its tensors after it entered the ready barrier.
        # A training rank whose batch kept its views at the last call: while the generation
        # ranks copy from them. A generation rank: while it waits for the training ranks
        # (its copies start only once its check passed)
        optimistic = not agree and not checked_first and sources != dests and (
            dests or (published is not None and self._stable.get(batch.fp, False)))
        signature = None
        if problem is None and not optimistic:
            problem, signature = self._check(batch, transfers, tensors, device_type)
        if agree:
            first = (tuple(map(int, transfers[0].global_shape))
                     if transfers and problem is None else None)
            vote = Vote(problem, len(transfers), staging_bytes,
                        batch.fp if batch is not None else None, 0, 0, first)
            pending = agreement.start(vote, self._control)
            agreement.conclude(pending, lambda: _description(batch, transfers),
                               self._control, "the colocated refit")
        sources = problem is None and sources
        if sources:
            self._wait_written(transfers, stream)
        if optimistic and sources:
            generation = published[2]
        else:
            generation = self._sources.publish(batch.fp, transfers, signature) if sources else 0
        flags, report = self._flags, reads.report
        seq = flags.next_batch()
        flags.arrive(READY, generation << 1 | (problem is not None))
        redo = False  # this rank's tensors changed, or are bad, since it entered the barrier
        if optimistic and dests:
            problem, signature = self._check(batch, transfers, tensors, device_type)
            redo = problem is not None  # it copies nothing; the checked pass raises
        words = flags.wait(READY, "the colocated refit's ready barrier", idle=report)
        failed = [r for r in range(world) if words[r] & 1]
        if failed:
            mine = f": {problem.text()}" if problem is not None else ""
            raise BadInputError(f"colocated refit: group ranks {failed} found a problem with "
                             f"their local tensors (this is group rank {me}){mine}")
        event = None
        if dests and not redo:
            copies = self._copy_batch(batch, transfers, tuple(w >> 1 for w in words), signature)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                copies.run()
                if copies.device.type == "cuda":
                    # complete when the reads are: on the stream they ran on (``stream``
                    # when given, made current just above)
                    event = torch.cuda.Event()
                    event.record()
        reads.queued(seq, event)  # a rank with nothing to read: complete now
        if overlap:
            report()
        else:
            reads.complete_own()
        if sources:
            if optimistic:  # meanwhile the generation ranks copy from the published views
                problem, signature = self._check(batch, transfers, tensors, device_type)
                redo = problem is not None or signature is None or signature != published[0]
            # stable: the views are those published before this call (no new generation)
            self._stable[batch.fp] = not redo and published is not None and (
                generation == published[2])
            reads.published(seq, transfers)  # kept (and kept alive) until read
        flags.arrive(VERDICT, int(redo))
        if any(flags.wait(VERDICT, "the colocated refit's verdict barrier", idle=report)):
            # a rank's tensors changed (or are bad) since it entered the ready barrier:
            # every rank completes what is in flight and moves the batch again in the
            # checked order (bad input raises there, on every rank; a training rank's
            # changed views are published anew)
            reads.settle()
            self._move(transfers, stream, staging_bytes, planner, False, False,
                       checked_first=True)
            return
        reads.let_go(OVERLAP_DEPTH if overlap else 0)

    def _check(self, batch, transfers, tensors: list, device_type: str) -> tuple:
        """This rank's tensors checked against the batch's plan: (problem or None, their
        signature or None). The checks (``local_ok``'s fast form, then ``check_local``'s
        per-tensor walk where it fails, as for lists of members) run only when the
        signature differs from the one that passed last time for this batch: their verdict
        depends on nothing else (types, shapes, dtypes, devices are all in it)."""
        tensors.clear()
        tensors += [None] * (2 * len(transfers))
        tensors[0::2] = map(_SRC, transfers)
        tensors[1::2] = map(_DST, transfers)
        signature = _signature(tensors)
        checked = self._checked.get(batch.fp)
        if signature is not None and checked == signature:
            # go on with the stored object, so that the ``==`` against the published
            # signature (the same object when nothing changed) is one identity check
            return None, checked
        ok, _ = local_ok(transfers, batch.expected, device_type, [])
        problem = None if ok else check_local(transfers, batch.plans, self.me, device_type,
                                              permuted_dst=True)[0]
        if problem is None and signature is not None:
            self._checked[batch.fp] = signature
        return problem, signature

    def _wait_written(self, transfers, stream) -> None:
        """The optimizer step's writes (the caller's current stream) and a pre hook's (the
        refit's ``stream``) are complete before any generation rank reads. A stream with
        nothing pending is seen so by a query: recording an event there would hand the
        device work in this process's context, and with two processes time-sharing a GPU
        it then switches contexts, twice (~40-70 µs before the ready barrier, measured on
        one H200, docs/MEASUREMENTS.md)."""
        device = _first_device(t.src for t in transfers)
        if device is None or device.type != "cuda":
            return
        what = "the training side's writes before a colocated refit"
        for s in (torch.cuda.current_stream(device), stream):
            if s is not None and not s.query():
                with torch.cuda.stream(s):
                    wait_device(device, [self.group], what, NAP_S)

    # -- generation side: the reads -----------------------------------------------

    def _copy_batch(self, batch, transfers, generations: tuple, signature: tuple) -> CopyBatch:
        """The batch's copies on this rank, built once per batch, training generations and
        destinations (``signature``: this rank's tensors, the destinations' addresses and
        geometry among them)."""
        key = (batch.fp, generations, signature)
        got = self._batches.get(key)
        if got is not None:
            return got
        sources = {r: self._views.of(r, batch.fp, g) for r, g in enumerate(generations) if g}
        pairs = read_pairs(transfers, batch.plans, self.me, sources)
        got = CopyBatch(pairs, _first_device(t.dst for t in transfers) or torch.device("cpu"))
        if signature is None:  # tensors that cannot be told apart from others: never reused
            return got
        if len(self._batches) >= _CACHE:
            self._batches.clear()
        self._batches[key] = got
        return got


_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride
_SRC, _DST = attrgetter("src"), attrgetter("dst")
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")


def _signature(tensors: list) -> Optional[tuple]:
    """What this rank's tensors of a call (``local_ok``'s list: src, dst per transfer) are
    made of, in a form compared in one ``==``: per entry None, a tensor or a list of
    members (its length); per tensor and member its address, size, stride, dtype and
    device, each gathered by one ``map`` in C. Equal signatures: same checks verdict and
    same views. None when an entry is neither (``check_local`` says what it is)."""
    kinds, flat = [], []
    for x in tensors:
        if x is None:
            kinds.append(-1)
        elif type(x) is PermutedRows:  # a kernel's order: its storage, box and tables
            kinds.append((x.storage.data_ptr(), x.first, x.outer.data_ptr(), x.inner.data_ptr(),
                          x.shape, x.width, x.apart, x.dtype, x.device))
        elif type(x) in LISTS:
            kinds.append(len(x))
            flat += x
        else:
            kinds.append(-2)
            flat.append(x)
    try:
        return (tuple(kinds), tuple(map(_PTR, flat)), tuple(map(_SIZE, flat)),
                tuple(map(_STRIDE, flat)), tuple(map(_DTYPE, flat)), tuple(map(_DEVICE, flat)))
    except (TypeError, AttributeError):  # an entry or member that is no tensor
        return None


def _device_type(transfers) -> str:
    device = _first_device(x for t in transfers for x in (t.src, t.dst))
    return "cpu" if device is None else device.type


def _first_device(items) -> Optional[torch.device]:
    for x in items:
        if x is None:
            continue
        if is_members(x):
            if x:
                return x[0].device
            continue
        if isinstance(x, (torch.Tensor, PermutedRows)):
            return x.device
    return None


def _description(batch, transfers) -> Description:
    if batch is not None:
        return batch.description(transfers)
    return Description([getattr(t, "name", f"#{i}") for i, t in enumerate(transfers)], None, None)
