"""The refit loop both sides run: walk the payload's params in order and move them.

Torch + stdlib only (the receiver imports it). The training side (``side="src"``) and the
generation side (``side="dst"``) build a ``RefitLoop`` from the same restored refit info,
their own ``HFToLocalParamMap`` and their refit groups (one per training PP stage), and
then call ``run()`` once per refit. Because the transfer order is derived from the payload
alone, every rank of a group issues the same sequence of batches; ``verify_plan()`` proves
it at setup by comparing a fingerprint of the ordered transfer list over each group.

Per stage the loop, on that stage's stream: runs the ``pre`` hooks of a batch
(``LocalParamSpec.begin``), hands the batch to the engine's ``xfer_batch``, then runs the
``post`` hooks. Batches are cut by global bytes so ``pre`` buffers stay bounded, and the cut
points depend on the payload only (identical on every rank). Stages use at most
``num_streams`` CUDA streams round-robin; on CPU there are no streams. A hook-free spec's
``base`` may be a list of tensors, one per index of the param's local dim 0 (the training
side's experts): the engine reads and writes them where they are, so the training side
makes no stacking copy and its extra memory is the engine's staging budget.

Beside it: ``refit.order`` (the transfer order, batches and fingerprint, from the payload
alone), ``refit.local`` (this rank's side of each param, checked), ``refit.checksums``
(the optional end-to-end checksums of a stage).

Decisions:

- Everything that can be checked locally (a spec for every param this rank holds, shapes
  and dtypes of hook-free specs) is checked in the constructor: no communication has
  happened yet when those errors are raised.
- ``groups`` maps stage -> process group for the stages this rank takes part in; a value
  of ``None`` means the default world. A train rank passes only its own stage.
- The engine's per-batch agreement step runs on the first ``run()``; from then on the
  engine is called with ``agree=False`` and skips it for every batch its group's history
  predicts (all but the first batch of each group in the second run, all of them after),
  which removes a host sync per batch. A ``pre`` hook that later returns a differently
  shaped buffer then raises on its own rank only (its peers wait for the group's timeout).
- Which planner plans the params (``planner``, docs/DESIGN.md "Which planner a refit
  uses"): ``"default"`` (today's plans), ``"link"`` (``engine.link_costs``: replicas
  complete per node or are served directly) or ``"auto"`` (link-aware when the group spans
  more than one node). The inputs are agreed in ``verify_plan``'s all-gather, before any
  byte moves: every rank's option (refused by name when they differ) and its node (a hash of
  ``node``, the host name by default); every rank then builds the same ``LinkCosts`` and so
  the same plans, one ``Planner`` per stage (each group has its own ranks' nodes).
- The params outside the bulk path ("other_params") can be made part of the fingerprint
  (``misc_items``) so a disagreement on the packed broadcast's entries is also caught at
  setup; both sides must then pass ``refit.order.misc_items_by_stage(info)``.

The whole refit a side runs around this loop (plan check, bulk, packed other params,
commit vote, the failure latch) is stated once in ``refit.protocol``; the sender and the
receiver both run it.
"""

from __future__ import annotations

import math
import time
from operator import attrgetter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from megatron_reshard.engine import Planner, Transfer
from megatron_reshard.engine.link_costs import LinkCosts
from megatron_reshard.refit.link_choice import choose_costs, node_code, stage_weight
from megatron_reshard.engine.plan import gc_paused, layout_key
from megatron_reshard.engine.refit_transport import transport_of
from megatron_reshard.layout.geometry import box_shape
from megatron_reshard.errors import BadInputError
from megatron_reshard.groups.collectives import all_gather_ints, control_device, group_rank
from megatron_reshard.groups.faults import RefitError, wait_device
from megatron_reshard.refit.checksums import SourceOverlaps, StageChecksums
from megatron_reshard.refit.delta_stage import DeltaStage, merged_tallies
from megatron_reshard.delta.eligible import delta_plans, dst_hooked, record_eligible
from megatron_reshard.delta.mover import DeltaMover
from megatron_reshard.refit.finite import FiniteCheck, all_finite
from megatron_reshard.refit.local import LocalParam, first_tensor_is_cuda, local_params
from megatron_reshard.refit.plan_text import PLANNERS, plan_mismatch_text
from megatron_reshard.refit.order import (MiscItem, BulkTransfer, batch_bounds, bulk_transfers,
                                          misc_items_by_stage, plan_fingerprint, plan_parts)
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec
from megatron_reshard.wire.records import ParamRecord, RefitPayload

SIDES = ("src", "dst")
DEFAULT_BATCH_BYTES = 512 << 20
DEFAULT_STAGING_BYTES = 256 << 20


class PlanMismatchError(RefitError):
    """Ranks of one refit group derived different transfer lists from their payloads (a
    failed refit setup, hence a ``RefitError``; still a ``RuntimeError`` as before)."""


@dataclass
class StageStats:
    stage: int
    params: int = 0          # params this rank holds a side of
    local_bytes: int = 0     # bytes of this rank's side of those params
    batches: int = 0
    seconds: float = 0.0     # host time to issue the stage (no device sync)


@dataclass
class RefitStats:
    stages: list[StageStats] = field(default_factory=list)
    seconds: float = 0.0     # wall time of run(), device work included when synchronize=True
    # destination side with checksums on: params whose received bytes differ from the sources'
    checksum_mismatches: list[str] = field(default_factory=list)
    # training side with check_finite: stage -> indexes of the params holding NaN or Inf
    nonfinite: dict[int, list[int]] = field(default_factory=dict)
    mode: str = "full"       # "delta": the eligible params moved as deltas (the delta package)
    delta: Optional[dict] = None  # delta refit: what the delta transport moved on this rank

    @property
    def params(self) -> int:
        return sum(s.params for s in self.stages)

    @property
    def local_bytes(self) -> int:
        return sum(s.local_bytes for s in self.stages)

    def as_dict(self) -> dict:
        return {"params": self.params, "local_bytes": self.local_bytes, "seconds": self.seconds,
                "stages": [vars(s).copy() for s in self.stages]}


class RefitLoop:
    """One side of the refit of all stages this rank takes part in (see module docstring)."""

    def __init__(
        self,
        refit_info: Union[RefitPayload, Mapping[str, Any]],
        local_map: HFToLocalParamMap,
        side: str,
        groups: Union[Mapping[int, Optional[Any]], Sequence[Optional[Any]]],
        *,
        num_streams: int = 2,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        misc_items: Optional[Mapping[int, Sequence[MiscItem]]] = None,
        xfer_batch: Optional[Callable[..., None]] = None,
        verify_checksums: bool = False,
        planner: str = "auto",
        node: Optional[str] = None,
        check_finite: bool = False,
    ):
        """``check_finite`` (training side): every buffer sent is checked for NaN and Inf
        (``refit.finite``; in the checksums' pass where they run); the run's stats list the
        params that hold one (``RefitStats.nonfinite``)."""
        if side not in SIDES:
            raise BadInputError(f"side must be one of {SIDES}, got {side!r}")
        if num_streams < 1:
            raise BadInputError(f"num_streams must be >= 1, got {num_streams}")
        if batch_bytes < 1:
            raise BadInputError(f"batch_bytes must be >= 1, got {batch_bytes}")
        if planner not in PLANNERS:
            raise BadInputError(f"planner must be one of {PLANNERS}, got {planner!r}")
        self.planner = planner
        self._node = node_code(node)
        self.side = side
        self.local_map = local_map
        self.num_streams = num_streams
        self.batch_bytes = batch_bytes
        self.staging_bytes = staging_bytes
        self._xfer_batch = xfer_batch
        self.groups: dict[int, Optional[Any]] = (
            dict(groups) if isinstance(groups, Mapping) else dict(enumerate(groups)))
        info = RefitPayload.of(refit_info)  # records (a refit info dict is parsed here)
        all_stages = self._all_stages = info.stage_params()
        self._all_misc = misc_items_by_stage(info)
        bulk_names = {s: tuple(p.name for p in ps) for s, ps in all_stages.items()}
        with_other = {s: bulk_names.get(s, ()) + tuple(n for n, _, _ in self._all_misc.get(s, ()))
                      for s in sorted({*bulk_names, *self._all_misc})}
        self._names = (bulk_names, with_other)  # param_names(other=False / True)
        pp_size = info.pp_size
        self._dst_weight = stage_weight(all_stages)
        for stage in self.groups:
            if not 0 <= stage < pp_size:
                raise BadInputError(f"refit group given for stage {stage}, but the payload has "
                                 f"pp_size={pp_size}")
        self.stages: dict[int, list[ParamRecord]] = {s: all_stages.get(s, []) for s in sorted(self.groups)}
        self.misc_items = None if misc_items is None else {
            s: list(misc_items.get(s, [])) for s in self.stages}
        self._ranks = {s: group_rank(g) for s, g in self.groups.items()}
        self._batches = {s: batch_bounds(ps, batch_bytes) for s, ps in self.stages.items()}
        self._mine: dict[int, list[Optional[LocalParam]]] = {
            s: local_params(ps, local_map, side, self._ranks[s], s)
            for s, ps in self.stages.items()}
        self._transfers: dict[int, list[BulkTransfer]] = {
            s: bulk_transfers(ps) for s, ps in self.stages.items()}
        self._owned = self._owned_bytes()
        self._hook_free: dict[tuple[int, int], _KeptBatch] = {}  # (stage, start) -> batch
        # batch cut points and staging size shape the engine calls: they must match too
        must_match = {"batch_bytes": batch_bytes, "staging_bytes": staging_bytes,
                      "checksums": int(verify_checksums),
                      "planner": PLANNERS.index(planner)}
        self.verify_checksums = verify_checksums
        self.check_finite = check_finite and side == "src"
        self._overlaps = SourceOverlaps(self.stages, self._ranks)
        self.fingerprints = {s: plan_fingerprint(ps, None if self.misc_items is None
                                                 else self.misc_items[s], must_match)
                             for s, ps in self.stages.items()}
        # compared with the fingerprint, so that a mismatch names what differs
        self._plan_parts = {s: plan_parts(ps, None if self.misc_items is None
                                          else self.misc_items[s], must_match)
                            for s, ps in self.stages.items()}
        self._verified = False
        # one planner per stage: its group's nodes shape its plans (set in verify_plan)
        self._planners: dict[int, Planner] = {s: Planner() for s in self.stages}
        self.costs: dict[int, Optional[LinkCosts]] = {s: None for s in self.stages}
        self._make_base: Optional[Callable[..., Any]] = None
        # stages whose batches went through once on every rank of the group: later runs
        # skip the engine's agreement (until a plan check there says a rank is new)
        self._agreed_stages: set[int] = set()
        self._stream_pool: Optional[list] = None
        # delta refits (the delta package): off until enable_delta; plans of the eligible params
        self.delta_plans: Optional[dict[int, list]] = None
        self.delta_bases: Optional[dict[int, Any]] = None  # src: stage -> TrainBase
        # dst: told every delta write once applied (``delta.mover``: a staged refit's flip)
        self.on_delta_apply: Optional[Callable[[list], None]] = None

    def enable_delta(self, make_base: Optional[Callable[..., Any]] = None) -> None:
        """Plan which params can move as deltas (payload-derived, alike on every rank);
        ``make_base(stage, records, plans, rank, dtypes)``: the training side's base keeper."""
        self._make_base = make_base
        self._plan_delta()

    def _plan_delta(self) -> None:
        """Delta plans (and the training side's bases) from the stages' planners: again
        once ``verify_plan`` picked the link-aware planner, before any byte moved."""
        self.delta_plans = {}
        for s, transfers in self._transfers.items():
            plans = self._planners[s].plan_all([layout_key(
                t.global_shape, t.src_mesh, t.src_placements, t.dst_mesh, t.dst_placements,
                f"delta: {t.name}") for t in transfers])
            self.delta_plans[s] = delta_plans(self.stages[s], plans)
        if self._make_base is not None:
            self.delta_bases = {s: self._make_base(s, self.stages[s], self.delta_plans[s],
                                                   self._ranks[s],
                                                   [t.dtype for t in self._transfers[s]])
                                for s in self.stages}

    def held_in_place(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every bulk param this rank holds as a plain tensor of its
        storage and that may take deltas (``delta.eligible.record_eligible``): what a delta
        writes into on the generation side (its base, ``delta.base_digest``)."""
        out = []
        for stage, mine in self._mine.items():
            for record, held in zip(self.stages[stage], mine):
                if held is not None and held.spec.pre is None and record_eligible(record) \
                        and isinstance(held.spec.base, torch.Tensor):
                    out.append((record.name, held.spec.base))
        return out

    def param_names(self, other: bool = False) -> dict[int, tuple[str, ...]]:
        """The bulk param names of each stage of the payload, in its order (the same on
        every rank: a stage index names a param everywhere); ``other``: each stage's other
        params follow (payload ``other_params``, ``order.misc_items_by_stage``)."""
        return dict(self._names[other])  # payload-derived: built once (tuples, shared)

    def rebind(self, local_map: HFToLocalParamMap) -> None:
        """Take this rank's params from ``local_map`` from now on (the training side's
        tensors moved: ``megatron.live_views``), checked as in the constructor. The next
        run checks the plan again, so every rank of the group agrees its batches anew
        (the version check's vote tells the peers; ``refit.protocol``)."""
        mine = {s: local_params(ps, local_map, self.side, self._ranks[s], s)
                for s, ps in self.stages.items()}
        self.local_map, self._mine = local_map, mine
        self._owned, self._hook_free = self._owned_bytes(), {}
        self._verified = False

    def _owned_bytes(self) -> dict[int, list[int]]:
        """Per stage and param: the bytes of this rank's owned box (0: none; a padded
        shard's padding rows do not travel), for the stats: counted once, not per refit."""
        return {s: [0 if held is None else
                    math.prod(box_shape(held.box)) * bulk.dtype.itemsize
                    for held, bulk in zip(self._mine[s], self._transfers[s])]
                for s in self.stages}

    def delta_held(self) -> bool:
        """Whether this rank holds a param other than as its storage in place (no plans
        needed: the params a record sends full are skipped, ``delta.eligible.dst_hooked``)."""
        return dst_hooked(self._mine, self.stages)

    @property
    def verified(self) -> bool:
        """Whether the plan fingerprints were compared already (``verify_plan``)."""
        return self._verified

    def verify_plan(self, stages: Optional[Sequence[int]] = None) -> None:
        """Compare plan fingerprints over the groups of ``stages`` (None: every group);
        PlanMismatchError on all ranks if they differ.

        A small all-gather per group, issued in stage order: every rank of a group reaches
        it, so a mismatch is reported everywhere instead of hanging in a transfer.
        The same all-gather carries each rank's node code: with the planner option agreed,
        every rank derives the same ``LinkCosts`` (``choose_costs``), hence the same plans.
        """
        for stage, group in self.groups.items():
            if stages is not None and stage not in stages:
                continue
            parts = self._plan_parts[stage]
            mine = [self.fingerprints[stage], len(self.stages[stage]), *parts.values()]
            seen = all_gather_ints([*mine, self._node], group)
            if any(row[:-1] != mine for row in seen):
                raise PlanMismatchError(
                    f"refit plan mismatch in the group of PP stage {stage} (seen from {self.side} "
                    f"group rank {self._ranks[stage]}): "
                    f"{plan_mismatch_text(list(parts), [row[1:-1] for row in seen])}")
            costs = choose_costs(self.planner, [row[-1] for row in seen], self._dst_weight)
            if costs != self.costs[stage]:
                self.costs[stage], self._planners[stage] = costs, Planner(costs)
            # a rank that checks the plan anew has no call history and has not agreed on any
            # batch: on every rank of the group the next engine calls vote again
            self._planners[stage].forget_calls()  # this stage's planner serves only its group
            self._agreed_stages.discard(stage)
        if self.delta_plans is not None and any(c is not None for c in self.costs.values()):
            self._plan_delta()  # planned before the check (the sender's base): again
        self._verified = True

    def planner_of(self, stage: int) -> Planner:
        """The planner of a stage's group (link-aware once ``verify_plan`` chose it)."""
        return self._planners[stage]

    # -- run -----------------------------------------------------------------------

    def _engine(self) -> tuple[Callable[..., None], type]:
        """The batch transfer callable, bound to this loop's options, and the Transfer type.

        The engine's ``xfer_batch`` gets the stage stream, the staging bound and this loop's
        planner (plans and schedules cached for the loop's lifetime); a substitute such as
        ``xfer_batch_reference`` takes the same keywords.
        """
        # without a substitute, each group's own transport moves its batches (p2p or
        # colocated, chosen when the group was made: engine.refit_transport)
        fn = self._xfer_batch
        # The engine's agreement step (a small all-reduce and a host sync per batch) guards
        # the first run; once every batch went through on every rank, later runs repeat
        # the same batches in the same order, so the engine skips it for each batch its
        # group's history predicts and the host can queue batches ahead of the GPU.
        agreed = self._agreed_stages

        def call(transfers, stage, stream):
            group, planner = self.groups[stage], self._planners[stage]
            agree = stage not in agreed
            if fn is not None:
                fn(transfers, group, stream=stream, staging_bytes=self.staging_bytes,
                   planner=planner, agree=agree)
                return
            # overlap: a stage's batches run back to back (``_run`` flushes after the last),
            # so the colocated transport lets one batch's host work run during the copies
            # of the one before; the sources do not change in between (pre-hook buffers are
            # kept alive by the transport until read)
            transport_of(group).move(transfers, group, stream=stream,
                                     staging_bytes=self.staging_bytes,
                                     planner=planner, agree=agree, overlap=True)

        return call, Transfer

    def _streams(self) -> list:
        """The loop's CUDA streams (created once, reused by every run); none on CPU."""
        if self._stream_pool is None:
            if torch.cuda.is_available() and self._uses_cuda():
                count = min(self.num_streams, max(1, len(self.stages)))
                self._stream_pool = [torch.cuda.Stream() for _ in range(count)]
            else:
                self._stream_pool = []
        return self._stream_pool

    def _uses_cuda(self) -> bool:
        held = first_tensor_is_cuda(e for mine in self._mine.values() for e in mine)
        if held is not None:
            return held
        return any(control_device(g).type == "cuda" for g in self.groups.values())

    def run(self, synchronize: bool = True,
            on_write: Optional[Callable[[list[str]], None]] = None,
            mode: str = "full") -> RefitStats:
        """Move every stage's params once. Verifies the plan first if not done yet.

        ``on_write(names)`` (destination side) is called before the engine may write the
        named params' storage: a failure after that leaves those params overwritten.
        ``mode="delta"`` (agreed on every rank by the version check) moves the eligible
        params through ``delta.mover``, the others through the engine.
        """
        if not self._verified:
            self.verify_plan()
        if mode == "delta" and self.delta_plans is None:
            if self.side == "src":
                raise BadInputError("a delta refit on a training-side loop without enable_delta()")
            self.enable_delta()  # the generation side plans on its first delta refit
        with gc_paused():  # many small objects per param; GC passes would walk the caches
            return self._run(synchronize, on_write, mode)

    def release_staging(self) -> None:
        """Give back the engine's CUDA staging slots kept between refits (at most two of
        ``staging_bytes / 2`` per stage stream); the next refit allocates them again."""
        for planner in self._planners.values():
            planner.release_staging()

    def _run(self, synchronize: bool, on_write, mode: str = "full") -> RefitStats:
        xfer, transfer_cls = self._engine()
        t0 = time.perf_counter()
        streams = self._streams()
        current = torch.cuda.current_stream() if streams else None
        stats = RefitStats()
        delta_runs = []
        for index, (stage, params) in enumerate(self.stages.items()):
            stream = streams[index % len(streams)] if streams else None
            if stream is not None:
                stream.wait_stream(current)
            finite = FiniteCheck() if self.check_finite else None
            checks = StageChecksums(self.side, stage, self.groups[stage], self._ranks[stage],
                                    params, self._overlaps, finite) if self.verify_checksums else None
            run = _StageRun(stage, params, stream, xfer, transfer_cls, StageStats(stage), on_write,
                            checks, self._delta_stage(stage, mode),
                            finite if checks is None else None)
            if run.delta is not None and run.delta.mover is not None:
                delta_runs.append(run.delta)
            ts = time.perf_counter()
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for start, stop in self._batches[stage]:
                    self._send_batch(run, self._open_batch(run, start, stop))
                if self._xfer_batch is None:
                    transport_of(self.groups[stage]).flush()
                if run.checks is not None:
                    stats.checksum_mismatches += run.checks.check()
                if finite is not None:
                    stats.nonfinite[stage] = finite.bad()
            run.stats.seconds = time.perf_counter() - ts
            stats.stages.append(run.stats)
        for stream in streams:
            current.wait_stream(stream)
        if synchronize and streams:
            wait_device(current.device, self.groups.values(), "the end of the refit")
        self._agreed_stages.update(self.groups)
        stats.seconds = time.perf_counter() - t0
        stats.mode = mode
        if mode == "delta":
            stats.delta = merged_tallies([r.mover.tally.as_dict() for r in delta_runs])
        return stats

    def _delta_stage(self, stage: int, mode: str) -> Optional[DeltaStage]:
        """What a stage's run does for delta refits: move (delta mode) or keep the base
        (full mode, training side); None when delta refits are off."""
        if self.delta_plans is None:
            return None
        base = None if self.delta_bases is None else self.delta_bases.get(stage)
        mover = DeltaMover(self.side, self.groups[stage], self._ranks[stage],
                           self.delta_plans[stage], base,
                           on_apply=self.on_delta_apply if self.side == "dst" else None
                           ) if mode == "delta" else None
        return DeltaStage(self.delta_plans[stage], mover, base)

    def _send_batch(self, run: "_StageRun", batch: "_OpenBatch") -> None:
        """Hand an opened batch to the engine, checksum it if asked, run its post hooks."""
        if run.on_write is not None and self.side == "dst" and batch.opened:
            run.on_write([run.params[o.index].name for o in batch.opened])
        transfers = batch.transfers
        if run.delta is not None:  # delta refit: the eligible params move here, not below
            transfers = run.delta.move(batch, run.params)
        if transfers:
            run.xfer(transfers, run.stage, run.stream)
        if run.delta is not None:
            run.delta.keep(batch)
        run.stats.batches += 1
        if run.checks is not None:
            mine = self._mine[run.stage]
            for o in batch.opened:
                run.checks.add(o.index, mine[o.index].box, o.ctx.buf)
        elif run.finite is not None:  # no checksum pass to share: a pass of its own
            for o in batch.opened:
                run.finite.add(o.index, all_finite(o.ctx.buf))
        if batch.hooks:
            for o in batch.opened:
                o.spec.finish(o.ctx)

    def _open_batch(self, run: "_StageRun", start: int, stop: int) -> "_OpenBatch":
        """Run the pre hooks of one batch; its open contexts and its engine transfers. A
        batch whose params this rank holds have no hooks is opened once and handed out
        again while each spec keeps its tensor and stays hook-free (one ``==`` of their
        states: a hook or tensor set on a spec later is seen; ``rebind`` forgets them)."""
        kept = self._hook_free.get((run.stage, start))
        if kept is not None and _spec_state(kept.specs) == kept.state:
            run.stats.params += len(kept.specs)
            run.stats.local_bytes += kept.nbytes
            return kept.batch
        mine = self._mine[run.stage]
        transfers = self._transfers[run.stage]
        owned = self._owned[run.stage]
        batch = _OpenBatch([], [], start)
        for i in range(start, stop):
            local = None
            held, bulk = mine[i], transfers[i]
            if held is not None:
                ctx = held.spec.begin()
                batch.opened.append(_Opened(i, held.spec, ctx))
                # a pre-hook buffer of the wrong shape or dtype is left to the engine, which
                # rejects it on every rank of the group at once (raising here would strand
                # the peers inside this batch's collectives)
                local = ctx.buf
                run.stats.params += 1
                run.stats.local_bytes += owned[i]
            batch.transfers.append(run.transfer_cls(
                name=bulk.name, global_shape=bulk.global_shape, dtype=bulk.dtype,
                src_mesh=bulk.src_mesh, src_placements=bulk.src_placements,
                dst_mesh=bulk.dst_mesh, dst_placements=bulk.dst_placements,
                src=local if self.side == "src" else None,
                dst=local if self.side == "dst" else None))
        specs = tuple(o.spec for o in batch.opened)
        state = _spec_state(specs)
        if not any(state[0]) and not any(state[1]):  # no pre or post hook: kept
            batch.hooks = False
            self._hook_free[(run.stage, start)] = _KeptBatch(
                batch, specs, state, sum(owned[o.index] for o in batch.opened))
        return batch


@dataclass
class _StageRun:
    """What one stage's part of one run works with."""

    stage: int
    params: list
    stream: Any
    xfer: Callable
    transfer_cls: type
    stats: StageStats
    on_write: Optional[Callable[[list[str]], None]]
    checks: Optional[StageChecksums]  # with checksums on
    delta: Optional[DeltaStage] = None  # delta refits enabled (the delta package)
    finite: Optional[FiniteCheck] = None  # check_finite without checksums (refit.finite)


class _Opened(NamedTuple):
    """A local param of a batch whose pre hook ran."""

    index: int
    spec: LocalParamSpec
    ctx: Any


@dataclass
class _OpenBatch:
    """A batch whose pre hooks ran: its opened local params, and its engine transfers."""

    opened: list[_Opened]
    transfers: list
    start: int = 0  # the stage index of the batch's first param
    hooks: bool = True  # False: no param of it has a pre or post hook (kept, reused)


class _KeptBatch(NamedTuple):
    """A hook-free batch kept for the next refits: its specs and their state when opened
    (``_spec_state``), and its owned bytes."""

    batch: _OpenBatch
    specs: tuple
    state: tuple
    nbytes: int


_PRE, _POST, _BASE = attrgetter("pre"), attrgetter("post"), attrgetter("base")


def _spec_state(specs: tuple) -> tuple:
    """What a kept batch depends on, compared in one ``==``: each spec's hooks and the
    identity of its tensor (held by the kept batch, so no other object takes its id)."""
    return (tuple(map(_PRE, specs)), tuple(map(_POST, specs)),
            tuple(map(id, map(_BASE, specs))))
