"""One generation rank's refit session: payload in, targets mapped, refit run on demand.

Torch + stdlib only. ``ReceiverSession`` does all local work in its constructor (the
payload parsed once into records, ``incoming``; every HF name this rank receives mapped
onto the model's storage, ``param_map``; the params outside the bulk path planned,
``full_weights``); every error it raises names the param and the
rank, and no communication has happened yet. ``refit()`` then runs the bulk transfer
(``RefitLoop``, side ``"dst"``) and receives the other params (packed broadcast per stage,
from the stage's group rank 0).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.groups.collectives import group_rank, group_size
from megatron_reshard.groups.faults import RefitError, fault_scope
from megatron_reshard.wire.metadata import SUPPORTED_SCHEMA_VERSIONS
from megatron_reshard.receiver.coverage import kept_as_loaded, parse_keep_as_loaded
from megatron_reshard.receiver.full_weights import apply_full_weights, coverage_gaps, plan_full_weights
from megatron_reshard.receiver.incoming import check_gen_tp, gen_ep_size, restore_payload
from megatron_reshard.receiver.live_targets import LiveTargets
from megatron_reshard.receiver.misc_transport import MiscReceiver, receive_misc_packed
from megatron_reshard.receiver.param_map import build_receiver_param_map
from megatron_reshard.receiver.state import WeightState
from megatron_reshard.receiver.targets import TargetError, VllmTargets
from megatron_reshard.delta.base_digest import HeldBase, base_changes, take_base
from megatron_reshard.refit.delta_vote import dst_ready_code, dst_vote
from megatron_reshard.refit.loop import DEFAULT_BATCH_BYTES, DEFAULT_STAGING_BYTES, RefitLoop
from megatron_reshard.refit.order import misc_items_by_stage
from megatron_reshard.refit.protocol import RefitProtocol
from megatron_reshard.refit.version import Refusal
from megatron_reshard.wire.records import RefitPayload
from megatron_reshard.wire.check import RefitPayloadError


class ReceiverSession:
    """A generation rank's refit state for one payload (see module docstring)."""

    def __init__(
        self,
        payload: Union[dict, RefitPayload],
        named_parameters: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
        groups: Mapping[int, Optional[Any]],
        *,
        num_streams: int = 2,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        strided_in_place: bool = True,
        receive_misc: Optional[MiscReceiver] = None,
        xfer_batch: Optional[Callable[..., None]] = None,
        vllm_tp: Optional[tuple[int, int]] = None,
        verify_checksums: bool = False,
        weights: Optional[WeightState] = None,
        keep_as_loaded: Optional[Iterable[str]] = None,
        storage_orders: Optional[Mapping[str, Any]] = None,
        planner: str = "auto",
        node: Optional[str] = None,
        model: Optional[torch.nn.Module] = None,
        block_quantizers: Optional[Mapping[str, Any]] = None,
    ):
        """``vllm_tp``: ``(tp_rank, tp_size)`` as the serving engine reports it, if known; the
        payload's placement of this rank must agree (else data would land on the wrong rank).
        ``verify_checksums`` must match the training side's choice (it is part of the plan
        fingerprint). ``weights``: the state of the model's weights, kept by the caller
        across sessions (new refit groups, new payloads) of the same model.
        ``keep_as_loaded``: vLLM param names (or fnmatch patterns) the payload does not
        write and that may keep what was loaded (``receiver.coverage``); any other param
        the payload leaves unwritten is refused here.
        ``planner`` (``"auto"``, ``"link"``, ``"default"``) must match the training side's;
        ``node`` names this rank's node (default: the host name; docs/DESIGN.md, "Which
        planner a refit uses").
        ``storage_orders``: the targets vLLM stores in a kernel's order
        (``receiver.kernel_layouts.storage_orders`` of the model).
        ``model``: vLLM's model, if known: each refit reads its params again from their
        modules (``receiver.live_targets``; without it, from the objects given), re-binds
        the targets vLLM re-allocated and refuses the refit where one changed beyond that.
        ``block_quantizers``: vLLM's own quantizer of each FP8 param of a layer vLLM
        quantizes online (``receiver.online_quant``), by param name.

        Any error here is posted on the groups' fault boards: the training ranks, waiting
        for the first refit, raise it too instead of waiting for their timeout."""
        t0 = time.perf_counter()
        self.groups = dict(groups)
        self.weights = weights if weights is not None else WeightState()
        with fault_scope(self.groups.values()):
            self._prepare(payload, named_parameters, num_streams=num_streams,
                          batch_bytes=batch_bytes, staging_bytes=staging_bytes,
                          strided_in_place=strided_in_place, xfer_batch=xfer_batch,
                          vllm_tp=vllm_tp, verify_checksums=verify_checksums,
                          keep_as_loaded=parse_keep_as_loaded(keep_as_loaded),
                          storage_orders=storage_orders, planner=planner, node=node,
                          model=model, block_quantizers=block_quantizers)
        self.receive_misc = receive_misc or receive_misc_packed
        self.staging_bytes = staging_bytes
        self.protocol = RefitProtocol("dst", self.loop, self.groups, self.misc_items,
                                      staging_bytes, self.pp_size)
        self._misc_plan_of = {stage: dict(zip((name for name, _, _ in items), self.misc_plans[stage]))
                              for stage, items in self.misc_items.items()}
        # delta refits (the delta package): the version this session last committed (its storage
        # is then the base of a delta cut from it), and whether it holds a bulk param
        # other than in place (the loop plans the deltas on its first delta refit)
        self._delta_version: Optional[int] = None
        self._delta_hooked: Optional[bool] = None
        self._delta_rewritten = False  # vLLM's conversion rewrote the committed bytes
        # the names and digests of the storage a delta writes into, taken at the last
        # commit of a refit whose sender asks for deltas (delta.base_digest); checked,
        # by name, before the next
        self._base_digests: Optional[HeldBase] = None
        self._written_outside: list[str] = []  # what the last check found changed
        self._held_changed: list[str] = []  # params that entered or left the held set
        self.stats: dict[str, Any] = {"refits": 0, "prepare_s": time.perf_counter() - t0,
                                      "verify_s": None, "last": None, "total_refit_s": 0.0}

    def _prepare(self, payload, named_parameters, *, num_streams, batch_bytes, staging_bytes,
                 strided_in_place, xfer_batch, vllm_tp, verify_checksums,
                 keep_as_loaded, storage_orders, planner="auto", node=None, model=None,
                 block_quantizers=None) -> None:
        ranks = {s: group_rank(g) for s, g in self.groups.items()}
        if len(set(ranks.values())) > 1:
            raise BadInputError(f"this generation rank has different ranks in the refit groups: {ranks}")
        self.rank_in_group = next(iter(ranks.values())) if ranks else 0
        where = f"refit group rank {self.rank_in_group}"
        self.where = where
        # the boundary: checked and parsed once; ``self.payload`` is a frozen RefitPayload
        self.payload = restore_payload(payload, where)
        if not isinstance(named_parameters, Mapping):  # read twice: a generator would not be
            named_parameters = dict(named_parameters)
        check_gen_tp(self.payload, named_parameters, vllm_tp, where)
        pp_size = self.payload.pp_size
        missing = sorted(set(range(pp_size)) - set(self.groups))
        if missing:
            raise BadInputError(f"{where}: no refit group for PP stage(s) {missing} (payload has "
                             f"pp_size={pp_size}; a generation rank takes part in every stage)")
        stage_world = self.payload.train_world_size // pp_size
        gen_world = self.payload.gen_world_size
        for stage, group in self.groups.items():
            if group_size(group) != stage_world + gen_world:
                raise BadInputError(f"{where}: the group of stage {stage} has {group_size(group)} ranks, "
                                 f"the payload needs {stage_world} train + {gen_world} gen ranks")
        self.gen_rank = self.rank_in_group - stage_world
        if not 0 <= self.gen_rank < gen_world:
            raise BadInputError(f"{where} is not a generation rank (train ranks are 0..{stage_world - 1}, "
                             f"generation ranks {stage_world}..{stage_world + gen_world - 1})")
        tp = self.payload.gen_tp_size
        ep = gen_ep_size(self.payload)
        if vllm_tp is not None and tuple(vllm_tp) != (self.gen_rank % tp, tp):
            raise BadInputError(f"{where}: the payload places gen rank {self.gen_rank} at TP rank "
                             f"{self.gen_rank % tp} of {tp}, but vLLM reports TP rank {vllm_tp[0]} "
                             f"of {vllm_tp[1]} here; the refit group ranks must follow vLLM's TP order")
        try:
            self._map_targets(tp, ep, named_parameters, strided_in_place, storage_orders,
                              block_quantizers)
        except (IndexError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
            # a payload that passed the structural checks but describes shapes that do not
            # fit this model: say so as a payload error, not as an internal failure
            raise RefitPayloadError(f"refit payload on {where}: its params do not fit this "
                                    f"rank's model ({type(exc).__name__}: {exc})") from exc
        # vLLM's params as the targets were bound to them: checked at every refit
        self.live = LiveTargets(self.targets.params, named_parameters, model,
                                f"gen rank {self.gen_rank} ({where})")
        self._strided_in_place = strided_in_place
        # no param may keep stale bytes behind a committed version unless the user said so
        self.kept_as_loaded = kept_as_loaded(coverage_gaps(self.targets, self._plans()),
                                             keep_as_loaded, f"{where} (gen rank {self.gen_rank})")
        self.loop = RefitLoop(self.payload, self.local_map, "dst", self.groups,
                              num_streams=num_streams, batch_bytes=batch_bytes,
                              staging_bytes=staging_bytes, misc_items=self.misc_items,
                              xfer_batch=xfer_batch, verify_checksums=verify_checksums,
                              planner=planner, node=node)
        self.pp_size = pp_size
        # the weight state names the model's own (vLLM) params: what the storage holds
        self._targets_of = {plan.hf_name: sorted({piece.target for piece in plan.pieces}
                                                 | {pc.target for pc in plan.scales.values()})
                            for plan in list(self.bulk_plans) +
                            [p for ps in self.misc_plans.values() for p in ps]}

    def _map_targets(self, tp: int, ep: int, named_parameters, strided_in_place: bool,
                     storage_orders=None, block_quantizers=None) -> None:
        """Map every param this rank receives onto the model's storage (local work)."""
        self.targets = VllmTargets.from_named_parameters(
            named_parameters, self.payload.hf_config, tp_rank=self.gen_rank % tp,
            tp_size=tp, ep_size=ep, ep_rank=self.gen_rank % ep, label=f"gen rank {self.gen_rank}",
            orders=storage_orders, quantizers=block_quantizers)
        self.local_map, self.bulk_plans = build_receiver_param_map(
            self.payload, self.targets, self.rank_in_group, strided_in_place)
        misc = misc_items_by_stage(self.payload)
        self.misc_items = {s: misc.get(s, []) for s in range(self.payload.pp_size)}
        self.misc_plans = {s: plan_full_weights(self.targets, items)
                           for s, items in self.misc_items.items()}

    def targets_written_by(self, hf_names: Iterable[str]) -> set:
        """The model's params (vLLM names) that the named HF params write on this rank."""
        return {t for n in hf_names for t in self._targets_of.get(n, ())}

    def _plans(self) -> list:
        return list(self.bulk_plans) + [p for ps in self.misc_plans.values() for p in ps]

    def verify_plan(self) -> None:
        """Compare plan fingerprints with the training side (communication: one small all-gather)."""
        self.stats["verify_s"] = self.protocol.verify_plan()

    @property
    def _broken(self) -> Optional[str]:
        """Why the groups cannot be used again (None while they can)."""
        return self.protocol.broken

    def refit(self) -> dict:
        """Receive every param once (the bulk params, then each stage's other params), then
        commit (``refit.protocol`` states the order): the weight version advances only if
        every rank of every group got there.

        On any failure the error is posted on the groups' boards (every peer raises it
        within a poll), ``self.weights`` says what the storage now holds, and the groups
        are not used again (a new session on new groups is needed). A checksum mismatch
        raises after the vote on every rank; the groups stay usable. So does a version that
        does not increase the weights' version (``refit.version.VersionRefused``, raised
        on every rank before any byte moves; the weights are untouched).
        """
        self.protocol.check_usable(lambda why: f"{self.where}: the refit groups failed in an "
                                   f"earlier refit ({why}); create new refit groups and a new "
                                   f"session (init_refit_groups + prepare_refit) to refit again")
        t0 = time.perf_counter()
        rebound, refusal = self._follow_targets()
        follow_s = time.perf_counter() - t0
        names: list[str] = []
        tally = {"misc_bytes": 0, "misc_wire_bytes": 0}

        def writing(batch_names: list[str]) -> None:
            targets = [t for n in batch_names for t in self._targets_of.get(n, ())]
            names.extend(targets)
            self.weights.writing(targets)

        def receive_chunk(stage: int, chunk: list) -> None:
            tensors = self.receive_misc(stage, self.groups[stage], chunk)
            tally["misc_wire_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
            writing([n for n, _, _ in chunk])
            tally["misc_bytes"] += apply_full_weights(
                self.targets, [self._misc_plan_of[stage][n] for n, _, _ in chunk], tensors)

        on_cuda = torch.cuda.is_available() and any(t.is_cuda for t in self.targets.params.values())

        def failed(reason: str) -> None:
            self._delta_version = self._base_digests = None  # the storage is no base any more
            self.weights.failed(reason)

        try:
            done = self.protocol.run(
                receive_chunk, held_version=self.weights.version, on_write=writing,
                on_failure=failed, delta_vote=self._delta_vote(), refusal=refusal,
                device=torch.device("cuda", torch.cuda.current_device()) if on_cuda else None)
        except RefitError:
            self._delta_version = self._base_digests = None
            raise
        if done.verify_s is not None:
            self.stats["verify_s"] = done.verify_s
        bad = list(done.bulk.checksum_mismatches)
        if not done.outcome.ok:
            reason = done.outcome.reason
            if bad:
                reason = (f"{self.where} (gen rank {self.gen_rank}): checksums differ for "
                          f"{bad}; {reason}")
            failed(reason)
            raise RefitError(f"refit failed its commit: {reason}. The weights are "
                             f"{self.weights.as_dict()['state']}")
        self.weights.committed(done.outcome.version, names, not_refitted=self.kept_as_loaded)
        # the base of the next delta: kept only where the training side asks for deltas
        self._base_digests = take_base(self.loop.held_in_place()) if done.delta_wanted else None
        self._delta_version = done.outcome.version if done.delta_wanted else None
        self._delta_rewritten = False
        full_bytes = done.bulk.local_bytes + tally["misc_bytes"]
        last = {"mode": done.mode, "full_reason": done.full_reason,
                "written_outside": list(self._written_outside),
                "held_changed": list(self._held_changed),
                "bytes_received": done.bulk_bytes_moved + tally["misc_bytes"],
                "full_bytes": full_bytes, "delta": done.bulk.delta,"bulk_params": done.bulk.params, "bulk_bytes": done.bulk.local_bytes,
                "misc_params": sum(len(i) for i in self.misc_items.values()), **tally,
                "bulk_s": done.bulk_s, "misc_s": done.misc_s,
                # the rest of refit_s: re-reading vLLM's params, the two votes
                "follow_s": follow_s, "version_s": done.version_s, "commit_s": done.commit_s,
                "stages": done.bulk.as_dict()["stages"],
                "checksums": self.loop.verify_checksums,
                "planners": {s: "default" if c is None else "link"
                             for s, c in self.loop.costs.items()},
                "version": done.outcome.version, "refit_s": time.perf_counter() - t0,
                "rebound": rebound}  # vLLM params re-allocated since the last refit
        self.stats["refits"] += 1
        self.stats["total_refit_s"] += last["refit_s"]
        self.stats["last"] = last
        return dict(last)

    def _follow_targets(self) -> tuple[int, Optional[Refusal]]:
        """What the refit writes into must still be vLLM's storage (``receiver.live_targets``):
        the payload mapped again onto the params vLLM re-allocated since the last refit;
        (how many, None), or (0, the refusal) where one changed beyond that. Local: the
        version check's vote carries the refusal, and the plan check a re-bind asks for,
        to every rank of every group."""
        changed = self.live.check()
        if changed is None:
            return 0, None
        problems, refused = changed.refusals, set(changed.refused)
        if not refused:
            for name, param in changed.moved.items():
                self.targets.params[name] = param.detach()
            try:
                local_map, plans = build_receiver_param_map(
                    self.payload, self.targets, self.rank_in_group, self._strided_in_place)
            except BadInputError as exc:  # mapped as at prepare: said the same way
                problems, refused = (str(exc),), set(changed.moved)
            else:
                self.loop.rebind(local_map)
                self.local_map, self.bulk_plans, self._delta_hooked = local_map, plans, None
                self.live.accept()
                return len(changed.moved), None
        stage, index = -1, -1
        for s, names in self.loop.param_names().items():
            index = next((i for i, n in enumerate(names)
                          if refused & set(self._targets_of.get(n, ()))), -1)
            if index >= 0:
                stage = s
                break
        return 0, Refusal(f"refit refused before any byte moved: vLLM's params on "
                          f"{self.live.where} changed since prepare_refit: "
                          + "; ".join(problems) + ". Call prepare_refit again for the model "
                          f"as it is now", index, "targets", stage)

    def _delta_vote(self) -> list:
        """This rank's columns of the delta/full vote (``refit.delta_vote``)."""
        gone = self._base_gone()
        if gone:  # this rank's base is gone: the refit goes full
            self._delta_version = self._base_digests = None
            return dst_vote(gone, None)
        hooked = False
        if self._delta_version is not None:
            if self._delta_hooked is None:
                self._delta_hooked = self.loop.delta_held()
            hooked = self._delta_hooked
        code = dst_ready_code(self._delta_version, self.weights, hooked, self._delta_rewritten)
        return dst_vote(code, self._delta_version)

    def _base_gone(self) -> int:
        """0 while the storage a delta would write into is what the last commit left there
        (``delta.base_digest``: one pass over it, one host sync), else the vote's code: 7
        where the params held in place are not those of the base (a re-bind, a hook put
        on since), 6 where one's bytes differ. The params are kept for the report."""
        self._written_outside, self._held_changed = [], []
        if self._delta_version is None or self._base_digests is None:
            return 0
        found = base_changes(self._base_digests, self.loop.held_in_place())
        self._written_outside, self._held_changed = found.written_outside, found.held_changed
        if found.held_changed:
            self._delta_hooked = None  # a spec changed: whether one is hooked is asked again
            return 7
        return 6 if found.written_outside else 0

    @property
    def delta_base(self) -> Optional[HeldBase]:
        """The digests of what the next delta refit writes into, as the last commit left it
        (None: no base). A staged refit keeps the one of its start for its flip
        (``receiver.flip_base``): its own commit replaces it."""
        return self._base_digests

    def forget_delta_base(self) -> None:
        """The storage no longer holds the committed bytes as they arrived (vLLM's own
        conversion rewrote some: ``receiver.staged_conversion``): the next refit is full."""
        self._delta_version = None
        self._delta_rewritten = True

    def release_staging(self) -> None:
        """Give back the CUDA staging memory kept between refits (see RefitLoop)."""
        self.loop.release_staging()

    def report(self) -> dict:
        """Plain-data summary: what this rank receives, bytes, timings, target params left
        unwritten, and the state of the weights (version, consistent or not)."""
        plans = self._plans()
        last = self.stats["last"] or {}
        return {
            "rank_in_group": self.rank_in_group,
            "gen_rank": self.gen_rank,
            "tp_rank": self.targets.tp_rank, "tp_size": self.targets.tp_size,
            "ep_rank": self.targets.ep_rank, "ep_size": self.targets.ep_size,
            "params": len(self.bulk_plans),
            "misc_params": sum(len(i) for i in self.misc_items.values()),
            # bytes that land in this rank's storage per refit (bulk regions + misc slices);
            # misc_wire_bytes: the full misc tensors this rank received to cut them from
            # a delta refit: the bytes that really arrived; full_bytes: a full refit's
            "bytes_received": last.get("bytes_received", 0),
            "full_bytes": last.get("full_bytes", 0),
            "mode": last.get("mode"),
            # why the last refit was full (None: a delta refit, or none yet)
            "full_reason": last.get("full_reason"),
            # params whose storage was written outside the refits before the last one
            # (found by the base digests: that refit went full)
            "written_outside": last.get("written_outside", []),
            # params that entered or left the set held in place for deltas since the
            # commit before the last refit (a re-bind, a hook): that refit went full
            "held_changed": last.get("held_changed", []),
            "misc_wire_bytes": last.get("misc_wire_bytes", 0),
            "refits": self.stats["refits"],
            # refits that found vLLM's params re-allocated and re-bound the targets
            "rebinds": self.live.rebinds,
            "weights": self.weights.as_dict(),
            "groups_usable": self._broken is None,
            "timings": {"prepare_s": self.stats["prepare_s"], "verify_s": self.stats["verify_s"],
                        "last_refit_s": last.get("refit_s"), "last_bulk_s": last.get("bulk_s"),
                        "last_misc_s": last.get("misc_s"),
                        "last_version_s": last.get("version_s"),
                        "last_commit_s": last.get("commit_s"),
                        "total_refit_s": self.stats["total_refit_s"]},
            "plan_fingerprints": {str(s): fp for s, fp in self.loop.fingerprints.items()},
            # params the payload does not write (each listed in keep_as_loaded, else
            # prepare refused): {name: elements left as loaded}
            "uncovered_targets": coverage_gaps(self.targets, plans),
            "kept_as_loaded": sorted(self.kept_as_loaded),
        }


# ``ReceiverSession`` is this module's job; the other names stay importable from here for
# callers of the earlier single-module receiver
__all__ = ["ReceiverSession", "TargetError", "build_receiver_param_map", "gen_ep_size",
           "receive_misc_packed", "restore_payload", "SUPPORTED_SCHEMA_VERSIONS"]
