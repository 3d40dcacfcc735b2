"""One generation rank's refit session: payload in, targets mapped, refit run on demand.

Torch + stdlib only. ``ReceiverSession`` does all local work in its constructor (restore
and validate the payload, map every HF name this rank receives onto the model's storage,
plan the params outside the bulk path); every error it raises names the param and the
rank, and no communication has happened yet. ``refit()`` then runs the bulk transfer
(``RefitLoop``, side ``"dst"``) and receives the other params (packed broadcast per stage,
from the stage's group rank 0).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch.distributed.tensor import Shard

from megatron_reshard.commit import commit_refit
from megatron_reshard.engine.geometry import box_index, rank_box
from megatron_reshard.engine.transport import control_device, group_rank, group_size
from megatron_reshard.faults import RefitError, fault_scope, wait_device
from megatron_reshard.layout import BlockShard, PaddedShard, is_expert_param
from megatron_reshard.metadata import SUPPORTED_SCHEMA_VERSIONS, restore_refit_info_placements
from megatron_reshard.packed import broadcast_packed, chunk_items, packed_layout
from megatron_reshard.receiver.fp8_targets import fp8_receive_spec
from megatron_reshard.receiver.payload_check import RefitPayloadError, validate_payload
from megatron_reshard.receiver.state import WeightState
from megatron_reshard.refit_loop import DEFAULT_BATCH_BYTES, DEFAULT_STAGING_BYTES, RefitLoop
from megatron_reshard.refit_order import MiscItem, misc_items_by_stage, stage_params, wire_dtype
from megatron_reshard.receiver.full_weights import apply_full_weights, coverage_gaps, plan_full_weights
from megatron_reshard.receiver.targets import (
    TargetError,
    TargetPlan,
    VllmTargets,
    bulk_receive_plan,
    receive_spec,
)
from megatron_reshard.spec import HFToLocalParamMap, LocalParamSpec
from megatron_reshard.vllm_layout.dense import is_qkv_per_group

# receive_misc(stage, group, items) -> {hf_name: full tensor} for the stage's other params
MiscReceiver = Callable[[int, Optional[Any], list[MiscItem]], Mapping[str, torch.Tensor]]


def restore_payload(payload: dict, where: str = "this rank") -> dict:
    """Validate the schema version and restore meshes/placements in place; returns the payload."""
    if not isinstance(payload, dict):
        raise TypeError(f"refit payload on {where} is a {type(payload).__name__}, expected a dict")
    version = payload.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ValueError(f"refit payload on {where}: unsupported schema_version {version!r} "
                         f"(this receiver reads {list(SUPPORTED_SCHEMA_VERSIONS)})")
    for key in ("layer_names", "per_layer_params", "train_world_size", "gen_world_size", "gen_tp_size"):
        if key not in payload:
            raise ValueError(f"refit payload on {where}: missing key {key!r}")
    return restore_refit_info_placements(payload)


def gen_ep_size(payload: Mapping[str, Any]) -> int:
    """Generation EP size: ``gen_layout["ep"]`` (or ``"ep_size"``) if given, else read off the
    expert placements."""
    layout = payload.get("gen_layout")
    if isinstance(layout, Mapping):
        for key in ("ep", "ep_size"):
            if layout.get(key):
                return int(layout[key])
    for params in payload["per_layer_params"].values():
        for p in params:
            if is_expert_param(p["name"]):
                for axis, pl in enumerate(p["dst_placements"]):
                    if isinstance(pl, (Shard, BlockShard)) and pl.dim == 0:
                        return int(p["dst_mesh_info"].shape[axis])
                return 1
    return 1


def build_receiver_param_map(payload: Mapping[str, Any], targets: VllmTargets, rank_in_group: int,
                             strided_in_place: bool = True
                             ) -> tuple[HFToLocalParamMap, list[TargetPlan]]:
    """``hf_name -> LocalParamSpec`` for every bulk param this rank receives, and their plans.

    ``rank_in_group`` is this rank's rank in the refit groups (the same in every stage's
    group). Each spec's base is the live target box (``receive_spec``), except for a padded
    vocab shard (the whole local tensor, padding zeroed here once) and q/k/v sent per KV
    group (the target's row block viewed as ``[groups, rows, H]``).
    """
    specs = HFToLocalParamMap()
    plans = []
    fp8_storage = any(t.dtype == torch.float8_e4m3fn for t in targets.params.values())
    for params in stage_params(payload).values():
        for p in params:
            region = rank_box(p["global_shape"], p["dst_mesh_info"], p["dst_placements"],
                                  rank_in_group)
            if region is None:
                continue
            fp8 = (fp8_receive_spec(targets, p, rank_in_group, strided_in_place)
                   if fp8_storage or p.get("gen_quant") else None)
            if fp8 is not None:  # block-FP8 storage: FP8 bytes, their scales, or quantize on write
                specs.specs[p["name"]], plan = fp8
                plans.append(plan)
                continue
            padded = any(isinstance(pl, PaddedShard) for pl in p["dst_placements"])
            per_group = is_qkv_per_group(p["name"], p["global_shape"])
            shape, rows = p["global_shape"], region
            if per_group:
                shape, rows = _per_group_as_rows(p["name"], shape, region)
            plan = bulk_receive_plan(targets, p["name"], shape, rows,
                                     wire_dtype(p["dtype"]), padded=padded)
            if per_group:  # q/k/v per KV group: the target row block seen as [groups, rows, H]
                block = targets.view(plan.pieces[0])
                specs.specs[p["name"]] = LocalParamSpec(
                    base=block.view([b - a for a, b in region]))
            elif padded:
                # the engine fills the owned rows at the top of the whole local tensor; the
                # padding rows after them never travel: zero them once, here
                for target, box in plan.zero:
                    targets.params[target][box_index(box)].zero_()
                specs.specs[p["name"]] = LocalParamSpec(base=targets.params[plan.pieces[0].target])
            else:
                specs.specs[p["name"]] = receive_spec(targets, plan.pieces[0], strided_in_place)
            plans.append(plan)
    return specs, plans


def _per_group_as_rows(name: str, shape, region) -> tuple[tuple[int, int], tuple]:
    """A q/k/v weight (bias) sent per KV group, ``[nkv, rows per group, H]`` (``[nkv, rows
    per group]``; a row-major reshape of the HF tensor), back to HF rows: the region must
    be one contiguous row block."""
    (g0, g1), (a, b), *rest = region
    per_group = int(shape[1])
    if g1 - g0 > 1 and (a, b) != (0, per_group):
        raise TargetError(f"{name}: region {list(region)} of the per-group form "
                          f"{list(shape)} is not one block of HF rows")
    rows = (g0 * per_group + a, (g1 - 1) * per_group + b) if g1 > g0 else (0, 0)
    return (int(shape[0]) * per_group, *(int(n) for n in shape[2:])), (rows, *rest)


def receive_misc_packed(stage: int, group: Optional[Any], items: list[MiscItem],
                        device: Optional[torch.device] = None) -> Mapping[str, torch.Tensor]:
    """Default misc transport: the stage's group rank 0 broadcasts one flat uint8 buffer of
    the stage's other params in payload order (``megatron_reshard.packed``)."""
    return broadcast_packed(packed_layout(items), group, 0, device or control_device(group))


class ReceiverSession:
    """A generation rank's refit state for one payload (see module docstring)."""

    def __init__(
        self,
        payload: dict,
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
    ):
        """``vllm_tp``: ``(tp_rank, tp_size)`` as the serving engine reports it, if known; the
        payload's placement of this rank must agree (else data would land on the wrong rank).
        ``verify_checksums`` must match the training side's choice (it is part of the plan
        fingerprint). ``weights``: the state of the model's weights, kept by the caller
        across sessions (new refit groups, new payloads) of the same model.

        Any error here is posted on the groups' fault boards: the training ranks, waiting
        for the first refit, raise it too instead of waiting for their timeout."""
        t0 = time.perf_counter()
        self.groups = dict(groups)
        self.weights = weights if weights is not None else WeightState()
        self._broken: Optional[str] = None  # why the groups cannot be used again
        with fault_scope(self.groups.values()):
            self._prepare(payload, named_parameters, num_streams=num_streams,
                          batch_bytes=batch_bytes, staging_bytes=staging_bytes,
                          strided_in_place=strided_in_place, xfer_batch=xfer_batch,
                          vllm_tp=vllm_tp, verify_checksums=verify_checksums)
        self.receive_misc = receive_misc or receive_misc_packed
        self.staging_bytes = staging_bytes
        self.stats: dict[str, Any] = {"refits": 0, "prepare_s": time.perf_counter() - t0,
                                      "verify_s": None, "last": None, "total_refit_s": 0.0}

    def _prepare(self, payload, named_parameters, *, num_streams, batch_bytes, staging_bytes,
                 strided_in_place, xfer_batch, vllm_tp, verify_checksums) -> None:
        ranks = {s: group_rank(g) for s, g in self.groups.items()}
        if len(set(ranks.values())) > 1:
            raise ValueError(f"this generation rank has different ranks in the refit groups: {ranks}")
        self.rank_in_group = next(iter(ranks.values())) if ranks else 0
        where = f"refit group rank {self.rank_in_group}"
        self.where = where
        validate_payload(payload, where)
        self.payload = restore_payload(payload, where)
        pp_size = int(self.payload.get("pp_size", 1))
        missing = sorted(set(range(pp_size)) - set(self.groups))
        if missing:
            raise ValueError(f"{where}: no refit group for PP stage(s) {missing} (payload has "
                             f"pp_size={pp_size}; a generation rank takes part in every stage)")
        stage_world = int(self.payload["train_world_size"]) // pp_size
        gen_world = int(self.payload["gen_world_size"])
        for stage, group in self.groups.items():
            if group_size(group) != stage_world + gen_world:
                raise ValueError(f"{where}: the group of stage {stage} has {group_size(group)} ranks, "
                                 f"the payload needs {stage_world} train + {gen_world} gen ranks")
        self.gen_rank = self.rank_in_group - stage_world
        if not 0 <= self.gen_rank < gen_world:
            raise ValueError(f"{where} is not a generation rank (train ranks are 0..{stage_world - 1}, "
                             f"generation ranks {stage_world}..{stage_world + gen_world - 1})")
        tp = int(self.payload["gen_tp_size"])
        ep = gen_ep_size(self.payload)
        if vllm_tp is not None and tuple(vllm_tp) != (self.gen_rank % tp, tp):
            raise ValueError(f"{where}: the payload places gen rank {self.gen_rank} at TP rank "
                             f"{self.gen_rank % tp} of {tp}, but vLLM reports TP rank {vllm_tp[0]} "
                             f"of {vllm_tp[1]} here; the refit group ranks must follow vLLM's TP order")
        try:
            self._map_targets(tp, ep, named_parameters, strided_in_place)
        except (IndexError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
            # a payload that passed the structural checks but describes shapes that do not
            # fit this model: say so as a payload error, not as an internal failure
            raise RefitPayloadError(f"refit payload on {where}: its params do not fit this "
                                    f"rank's model ({type(exc).__name__}: {exc})") from exc
        self.loop = RefitLoop(self.payload, self.local_map, "dst", self.groups,
                              num_streams=num_streams, batch_bytes=batch_bytes,
                              staging_bytes=staging_bytes, misc_items=self.misc_items,
                              xfer_batch=xfer_batch, verify_checksums=verify_checksums)
        self.pp_size = pp_size
        # the weight state names the model's own (vLLM) params: what the storage holds
        self._targets_of = {plan.hf_name: sorted({piece.target for piece in plan.pieces}
                                                 | {pc.target for pc in plan.scales.values()})
                            for plan in list(self.bulk_plans) +
                            [p for ps in self.misc_plans.values() for p in ps]}

    def _map_targets(self, tp: int, ep: int, named_parameters, strided_in_place: bool) -> None:
        """Map every param this rank receives onto the model's storage (local work)."""
        self.targets = VllmTargets.from_named_parameters(
            named_parameters, self.payload.get("hf_config") or {}, tp_rank=self.gen_rank % tp,
            tp_size=tp, ep_size=ep, ep_rank=self.gen_rank % ep, label=f"gen rank {self.gen_rank}")
        self.local_map, self.bulk_plans = build_receiver_param_map(
            self.payload, self.targets, self.rank_in_group, strided_in_place)
        self.misc_items = {s: misc_items_by_stage(self.payload).get(s, [])
                           for s in range(int(self.payload.get("pp_size", 1)))}
        self.misc_plans = {s: plan_full_weights(self.targets, items)
                           for s, items in self.misc_items.items()}

    def verify_plan(self) -> None:
        """Compare plan fingerprints with the training side (communication: one small all-gather)."""
        t0 = time.perf_counter()
        self.loop.verify_plan()
        self.stats["verify_s"] = time.perf_counter() - t0

    def refit(self) -> dict:
        """Receive every param once (the bulk params, then each stage's other params), then
        commit: the weight version advances only if every rank of every group got there.

        On any failure the error is posted on the groups' boards (every peer raises it
        within a poll), ``self.weights`` says what the storage now holds, and the groups
        are not used again (a new session on new groups is needed). A checksum mismatch
        raises after the vote on every rank; the groups stay usable.
        """
        if self._broken is not None:
            raise RefitError(f"{self.where}: the refit groups failed in an earlier refit "
                             f"({self._broken}); create new refit groups and a new session "
                             f"(init_refit_groups + prepare_refit) to refit again")
        t0 = time.perf_counter()
        names: list[str] = []
        try:
            with fault_scope(self.groups.values()):
                if self.stats["verify_s"] is None:
                    self.verify_plan()
                last = self._receive(names)
                bad = last.pop("checksum_mismatches")
                outcome = commit_refit(self.groups, side="dst", version=None,
                                       checksum_failed=bool(bad), pp_size=self.pp_size)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            self.weights.failed(self._broken)
            raise
        if not outcome.ok:
            reason = outcome.reason
            if bad:
                reason = (f"{self.where} (gen rank {self.gen_rank}): checksums differ for "
                          f"{bad}; {reason}")
            self.weights.failed(reason)
            raise RefitError(f"refit failed its commit: {reason}. The weights are "
                             f"{self.weights.as_dict()['state']}")
        self.weights.committed(outcome.version, names)
        last["version"] = outcome.version
        last["refit_s"] = time.perf_counter() - t0
        self.stats["refits"] += 1
        self.stats["total_refit_s"] += last["refit_s"]
        self.stats["last"] = last
        return dict(last)

    def _receive(self, names: list[str]) -> dict:
        """The data phase of one refit; ``names`` collects every model param it writes."""
        t0 = time.perf_counter()

        def writing(batch_names: list[str]) -> None:
            targets = [t for n in batch_names for t in self._targets_of.get(n, ())]
            names.extend(targets)
            self.weights.writing(targets)

        bulk = self.loop.run(on_write=writing)
        t1 = time.perf_counter()
        misc_bytes = misc_wire_bytes = 0
        on_cuda = torch.cuda.is_available() and any(t.is_cuda for t in self.targets.params.values())
        for stage, items in self.misc_items.items():
            plans = dict(zip((name for name, _, _ in items), self.misc_plans[stage]))
            # one packed buffer of at most staging_bytes alive at a time (same cuts as the sender)
            for chunk in chunk_items(items, self.staging_bytes):
                tensors = self.receive_misc(stage, self.groups[stage], chunk)
                misc_wire_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
                writing([n for n, _, _ in chunk])
                misc_bytes += apply_full_weights(self.targets, [plans[n] for n, _, _ in chunk],
                                                 tensors)
                del tensors
                if on_cuda:  # NCCL holds the freed buffer until its stream is past it
                    wait_device(torch.device("cuda", torch.cuda.current_device()),
                                self.groups.values(), "a packed broadcast")
        t2 = time.perf_counter()
        return {"bulk_params": bulk.params, "bulk_bytes": bulk.local_bytes,
                "misc_params": sum(len(i) for i in self.misc_items.values()),
                "misc_bytes": misc_bytes, "misc_wire_bytes": misc_wire_bytes, "bulk_s": t1 - t0,
                "misc_s": t2 - t1, "stages": bulk.as_dict()["stages"],
                "checksums": self.loop.verify_checksums,
                "checksum_mismatches": list(bulk.checksum_mismatches)}

    def release_staging(self) -> None:
        """Give back the CUDA staging memory kept between refits (see RefitLoop)."""
        self.loop.release_staging()

    def report(self) -> dict:
        """Plain-data summary: what this rank receives, bytes, timings, target params left
        unwritten, and the state of the weights (version, consistent or not)."""
        plans = list(self.bulk_plans) + [p for ps in self.misc_plans.values() for p in ps]
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
            "bytes_received": last.get("bulk_bytes", 0) + last.get("misc_bytes", 0),
            "misc_wire_bytes": last.get("misc_wire_bytes", 0),
            "refits": self.stats["refits"],
            "weights": self.weights.as_dict(),
            "groups_usable": self._broken is None,
            "timings": {"prepare_s": self.stats["prepare_s"], "verify_s": self.stats["verify_s"],
                        "last_refit_s": last.get("refit_s"), "last_bulk_s": last.get("bulk_s"),
                        "last_misc_s": last.get("misc_s"),
                        "total_refit_s": self.stats["total_refit_s"]},
            "plan_fingerprints": {str(s): fp for s, fp in self.loop.fingerprints.items()},
            "uncovered_targets": coverage_gaps(self.targets, plans),
        }


__all__ = ["ReceiverSession", "TargetError", "build_receiver_param_map", "gen_ep_size",
           "receive_misc_packed", "restore_payload", "SUPPORTED_SCHEMA_VERSIONS"]
