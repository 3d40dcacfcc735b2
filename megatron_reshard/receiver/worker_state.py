"""One generation worker's refit state, and the typed results of its phases.

``RefitWorkerState`` owns what a worker keeps between calls: its refit groups (one per
training PP stage) and its rank in them, the ``ReceiverSession`` of the payload it
prepared with the ``PrepareOptions`` it was prepared with, and the weights' state
(``WeightState``, which belongs to the model: it outlives groups and sessions). Both vLLM
adapters compose it: the worker extension (``receiver.worker``, mixed into vLLM's worker
by ``worker_extension_cls``) and the weight-transfer engine (``vllm_api.backend``). The
phases return frozen records (``GroupsJoined``, ``PrepareSummary``, ``RefitResult``); the
adapters turn them into dicts only where they cross an RPC (``as_dict``).

Torch + stdlib only (runs inside vLLM workers).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

import torch

from megatron_reshard.errors import BadInputError, BadInputTypeError, CallOrderError
from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.groups.faults import fault_scope
from megatron_reshard.receiver.coverage import parse_keep_as_loaded
from megatron_reshard.receiver.derived import (
    DerivedWeightsError,
    derived_param_names,
    may_derive,
    refresh_derived_weights,
)
from megatron_reshard.receiver.kernel_layouts import kv_cache_scale_names, storage_orders
from megatron_reshard.receiver.online_quant import OnlineBlockFp8, OnlineQuantError
from megatron_reshard.receiver.session import ReceiverSession
from megatron_reshard.receiver.staged_conversion import (
    StagedConversionError,
    StagedConversions,
    check_online_payload,
    online_quantizers,
    staged_layers,
)
from megatron_reshard.receiver.staging import StagedRefits, check_budget, check_delta_flip
from megatron_reshard.receiver.state import WeightState
from megatron_reshard.refit.loop import DEFAULT_BATCH_BYTES, DEFAULT_STAGING_BYTES

# (stage, group, items) -> {name: full tensor}: how a worker receives the packed params
MiscReceiver = Callable[[int, Optional[Any], list], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class PrepareOptions:
    """``prepare_refit``'s options. ``verify_checksums``, ``batch_bytes`` and
    ``staging_bytes`` enter the plan fingerprint: they must match the sender's.
    ``keep_as_loaded``: vLLM param names or fnmatch patterns the payload does not write
    and that may keep what was loaded (``receiver.coverage``). ``planner`` (``"auto"``,
    ``"link"``, ``"default"``) must match the sender's; ``node``: this rank's node name
    (None: the host name; docs/DESIGN.md, "Which planner a refit uses"). ``staged``: refits
    land in staging tensors and go live at a flip (``receiver.staging``), at most
    ``staging_budget_bytes`` of them on the params' device (None: all), then at most
    ``host_staging_budget_bytes`` in pinned host memory (default 0; None: all); the rest
    written in place in the pause (``receiver.staging_tiers``); ``staged_delta_flip``:
    the flip of a delta refit applies its payloads (``"apply"``) or copies (``"copy"``)."""

    num_streams: int = 2
    batch_bytes: int = DEFAULT_BATCH_BYTES
    staging_bytes: int = DEFAULT_STAGING_BYTES
    strided_in_place: bool = True
    verify_checksums: bool = False
    keep_as_loaded: tuple[str, ...] = ()
    planner: str = "auto"
    node: Optional[str] = None
    staged: bool = False
    staging_budget_bytes: Optional[int] = None
    host_staging_budget_bytes: Optional[int] = 0
    staged_delta_flip: str = "apply"

    NAMES: ClassVar[tuple[str, ...]] = ("num_streams", "batch_bytes", "staging_bytes",
                                        "strided_in_place", "verify_checksums", "keep_as_loaded",
                                        "planner", "node", "staged", "staging_budget_bytes",
                                        "host_staging_budget_bytes", "staged_delta_flip")
    _NOT_SESSION: ClassVar[tuple[str, ...]] = ("staged", "staging_budget_bytes",
                                               "host_staging_budget_bytes", "staged_delta_flip")

    @classmethod
    def unknown(cls, options: Mapping) -> list:
        """The keys of ``options`` that are no option (sorted)."""
        return sorted(set(options) - set(cls.NAMES), key=str)

    @classmethod
    def of(cls, options: Optional[Mapping], where: str = "prepare_refit") -> "PrepareOptions":
        """Checked options from a plain dict (None: the defaults)."""
        options = dict(options or {})
        unknown = cls.unknown(options)
        if unknown:
            raise BadInputError(f"unknown {where} options {unknown}; known: {list(cls.NAMES)}")
        if "keep_as_loaded" in options:
            options["keep_as_loaded"] = parse_keep_as_loaded(options["keep_as_loaded"])
        if not isinstance(options.get("staged", False), bool):
            raise BadInputError(f"{where} option staged: expected True or False, found "
                                f"{options['staged']!r}")
        check_budget(options.get("staging_budget_bytes"))
        check_budget(options.get("host_staging_budget_bytes", 0), "host_staging_budget_bytes")
        check_delta_flip(options.get("staged_delta_flip", "apply"))
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def session_options(self) -> dict[str, Any]:
        """The options ``ReceiverSession`` takes (the staged ones are the worker's)."""
        return {k: v for k, v in self.as_dict().items() if k not in self._NOT_SESSION}


@dataclass(frozen=True)
class GroupsJoined:
    """``join_groups``' result: the PP stages joined and this worker's rank in each group."""

    stages: tuple[int, ...]
    group_rank: int

    def as_dict(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "group_rank": self.group_rank}


_SUMMARY_KEYS = ("rank_in_group", "gen_rank", "tp_rank", "tp_size", "ep_rank", "ep_size", "params",
                 "misc_params", "plan_fingerprints", "uncovered_targets", "kept_as_loaded")


@dataclass(frozen=True)
class PrepareSummary:
    """``prepare``'s result: where this worker sits and what it will receive."""

    rank_in_group: int
    gen_rank: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    params: int                          # bulk params
    misc_params: int                     # params of the packed broadcast
    plan_fingerprints: Mapping[str, Any]  # per stage
    uncovered_targets: Mapping[str, int]  # params the payload does not write: elements
    kept_as_loaded: tuple[str, ...]

    @classmethod
    def of_report(cls, report: Mapping[str, Any]) -> "PrepareSummary":
        values = {k: report[k] for k in _SUMMARY_KEYS}
        values["plan_fingerprints"] = MappingProxyType(dict(values["plan_fingerprints"]))
        values["uncovered_targets"] = MappingProxyType(dict(values["uncovered_targets"]))
        values["kept_as_loaded"] = tuple(values["kept_as_loaded"])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _SUMMARY_KEYS}
        out.update(plan_fingerprints=dict(self.plan_fingerprints),
                   uncovered_targets=dict(self.uncovered_targets),
                   kept_as_loaded=list(self.kept_as_loaded))
        return out


@dataclass(frozen=True)
class RefitResult:
    """``refit``'s result: the version committed, how (``"full"`` / ``"delta"``), the bytes
    that arrived, the time it took, the derived weights recomputed after it; ``stats``:
    every number of the session's refit (``ReceiverSession.refit``)."""

    version: int
    mode: Optional[str]
    bytes_received: int
    refit_s: float
    derived_refreshed: tuple[str, ...]
    stats: Mapping[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {**self.stats, "derived_refreshed": list(self.derived_refreshed)}


def _per_stage(value: Union[Sequence, Mapping, int], what: str) -> dict[int, Any]:
    if isinstance(value, Mapping):
        return {int(k): v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return dict(enumerate(value))
    raise BadInputTypeError(f"{what} must be a list (index = PP stage) or a dict stage -> value, "
                            f"got {type(value).__name__}")


def vllm_tp_coords() -> Optional[tuple[int, int]]:
    """``(tp_rank, tp_size)`` from vLLM's parallel state if vLLM already loaded it (no
    import here); None if unknown."""
    ps = sys.modules.get("vllm.distributed.parallel_state")
    if ps is None:
        return None
    try:
        return int(ps.get_tensor_model_parallel_rank()), int(ps.get_tensor_model_parallel_world_size())
    except Exception:
        return None


def vllm_gen_coords() -> tuple[int, int]:
    """``(gen_rank, gen_world)``: vLLM's world group where vLLM is loaded, else the default
    torch.distributed world (one generation world per launch)."""
    ps = sys.modules.get("vllm.distributed.parallel_state")
    if ps is not None:
        world = ps.get_world_group()
        return int(world.rank_in_group), int(world.world_size)
    import torch.distributed as dist

    if not dist.is_initialized():
        raise CallOrderError("init_refit_groups(group_rank=None) needs vLLM's or the default "
                             "torch.distributed world to derive this worker's rank; pass "
                             "group_rank or override get_refit_gen_coords()")
    return dist.get_rank(), dist.get_world_size()


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class RefitWorkerState:
    """A generation worker's refit groups, prepared session (with its options) and weight
    state; see the module doc. Each phase checks it follows the one it needs."""

    def __init__(self) -> None:
        self.groups: Optional[dict[int, Any]] = None  # PP stage -> refit group
        self.group_rank: Optional[int] = None
        self.session: Optional[ReceiverSession] = None
        self.options: Optional[PrepareOptions] = None  # the session's
        self.staged: Optional[StagedConversions] = None  # the session's layers vLLM converts
        self.stager: Optional[StagedRefits] = None  # staging tensors (``staged`` option)
        self.online = OnlineBlockFp8({})  # the session's online block-FP8 params, if any
        self.weights = WeightState()  # the model's: outlives groups and sessions
        # the model prepared last, when it has no MLA layer: nothing derived to refresh
        self._underived: Optional[torch.nn.Module] = None

    def require_groups(self) -> dict[int, Any]:
        if self.groups is None:
            raise CallOrderError("prepare_refit called before init_refit_groups")
        return self.groups

    def require_no_staged_refit(self, what: str) -> None:
        """Refuse ``what`` while a staged refit's thread runs (it uses the groups and session)."""
        if self.stager is not None and self.stager.phase in ("receiving", "waiting_for_pause"):
            raise CallOrderError(f"{what} while a staged refit is running; flip or discard it "
                                 f"first")

    def require_session(self) -> ReceiverSession:
        if self.session is None:
            raise CallOrderError("refit called before prepare_refit(payload)")
        return self.session

    def join_groups(self, host: str, ports_by_stage: Union[Sequence[int], Mapping],
                    group_rank: Optional[int], group_sizes: Union[int, Sequence[int], Mapping],
                    backend: str, timeout_s: float,
                    gen_coords: Callable[[], tuple[int, int]] = vllm_gen_coords) -> GroupsJoined:
        """Join one refit group per PP stage (stage -> TCPStore port); same rank in each.
        ``group_rank=None``: ``group_size - gen_world + gen_rank`` from ``gen_coords()``,
        the training ranks of a stage coming first in its group. Drops the session."""
        ports = _per_stage(ports_by_stage, "ports_by_stage")
        self.require_no_staged_refit("init_refit_groups")
        sizes = ({s: int(group_sizes) for s in ports} if isinstance(group_sizes, int)
                 else _per_stage(group_sizes, "group_sizes"))
        if set(sizes) != set(ports):
            raise BadInputError(f"ports_by_stage has stages {sorted(ports)}, group_sizes has "
                                f"{sorted(sizes)}")
        if group_rank is None:
            gen_rank, gen_world = gen_coords()
            derived = {s: n - gen_world + gen_rank for s, n in sizes.items()}
            if len(set(derived.values())) != 1:
                raise BadInputError(f"group_sizes {sizes} give this worker (gen rank {gen_rank} of "
                                    f"{gen_world}) different ranks per stage {derived}; every stage "
                                    f"group needs the same number of training ranks")
            group_rank = next(iter(derived.values()))
        groups = {}
        for stage in sorted(ports):
            groups[stage] = create_refit_group(
                host, int(ports[stage]), int(group_rank), int(sizes[stage]), backend,
                float(timeout_s), who=f"generation worker at refit group rank {group_rank}",
                label=f"refit group of PP stage {stage}")
        self.groups, self.group_rank = groups, int(group_rank)
        self.session = self.options = self.stager = None
        return GroupsJoined(tuple(sorted(groups)), int(group_rank))

    def prepare(self, model: torch.nn.Module, payload: Any, options: Optional[Mapping] = None, *,
                receive_misc: MiscReceiver, vllm_tp: Optional[tuple[int, int]]) -> PrepareSummary:
        """Map ``payload`` onto ``model``'s storage (no communication). A refusal is posted
        on the groups' fault boards, so the training ranks raise it too. Params vLLM derives
        itself (MLA's absorbed weights) are never targets."""
        groups = self.require_groups()
        self.require_no_staged_refit("prepare_refit")
        unknown = PrepareOptions.unknown(options or {})
        if unknown:  # a caller's typo: refused here, before the groups hear of it
            raise BadInputError(f"unknown prepare_refit options {unknown}; known: "
                                f"{list(PrepareOptions.NAMES)}")
        self.session = self.options = self.staged = self.stager = None
        self._underived = None if may_derive(model) else model
        derived = derived_param_names(model)  # recomputed after each refit, never received
        derived |= kv_cache_scale_names(model)  # no weights: vLLM 0.34 keeps them as params
        with fault_scope(groups.values()):  # a refusal reaches the training ranks too
            checked = PrepareOptions.of(options)
            # layers vLLM's post-load converts by computing (block FP8): received in
            # checkpoint order, converted by vLLM's code after each refit
            staged = staged_layers(model, skip=derived)
            check_online_payload(staged, payload)  # vLLM's online block FP8: planned for it?
            orders = storage_orders(model, skip=derived,  # how vLLM's post-load stored them
                                    staged={layer.name for layer in staged})
            # a staged param vLLM re-allocated in a kernel's shape is received through a
            # checkpoint-shaped view of its storage
            views = {n: v for layer in staged for n, v in layer.receive_views().items()}
            targets = [(n, views.get(n, p)) for n, p in model.named_parameters()
                       if n not in derived]
            stager = self._stager(checked, staged, targets, model)
            # vLLM's online block FP8: its matrices quantized by vLLM's function (online_quant)
            online = OnlineBlockFp8(online_quantizers(staged))
        session = ReceiverSession(payload, stager.targets(targets) if stager else targets,
                                  groups, receive_misc=receive_misc, vllm_tp=vllm_tp,
                                  weights=stager.weights if stager else self.weights,
                                  storage_orders=orders, model=model, block_quantizers=online,
                                  **checked.session_options())
        if online:  # each online matrix written whole, exactly once (else no session)
            with fault_scope(groups.values()):
                plans = list(session.bulk_plans) + [p for ps in session.misc_plans.values()
                                                    for p in ps]
                online.check_coverage(session.targets.params, plans, session.targets.where())
        self.session, self.online = session, online
        if stager is not None:
            stager.session_prepared(self.session)
        self.options, self.stager = checked, stager
        self.staged = StagedConversions(staged)
        return PrepareSummary.of_report(self.session.report())

    def _stager(self, checked: PrepareOptions, staged: list, targets: list,
                model: Optional[torch.nn.Module] = None) -> Optional[StagedRefits]:
        """The staging tensors of a ``staged`` session (None otherwise)."""
        if not checked.staged:
            return None
        if staged:
            names = ", ".join(sorted(layer.name for layer in staged)[:4])
            raise BadInputError(f"prepare_refit option staged: layers vLLM converts after "
                                f"loading ({names}) are converted in their storage after each "
                                f"refit; a staged refit cannot stage that (docs/DESIGN.md, "
                                f"'Staged refits')")
        return StagedRefits(dict(targets), self.weights, checked.staging_budget_bytes,
                            host_budget_bytes=checked.host_staging_budget_bytes,
                            delta_flip=checked.staged_delta_flip, model=model,
                            where=f"generation worker at refit group rank {self.group_rank}")

    def require_stager(self) -> StagedRefits:
        self.require_session()
        if self.stager is None:
            raise CallOrderError("a staged refit needs prepare_refit(payload, "
                                 "{'staged': True, ...})")
        return self.stager

    def refit(self, model: torch.nn.Module, act_dtype: Optional[torch.dtype]) -> RefitResult:
        """Receive every param once and commit, then recompute the weights vLLM derives
        from them (``receiver.derived``); if that fails the weights are marked
        inconsistent. A ``staged`` session stages, then flips at once."""
        session = self.require_session()
        if self.stager is not None:
            self.stager.start(session)
            return self.flip_staged(model, act_dtype)
        self.online.begin()
        stats = session.refit()
        self._convert_staged(session, stats)  # before MLA's refresh, as vLLM's loader orders them
        return self._refreshed(model, session.targets.params.values(), act_dtype, stats)

    def flip_staged(self, model: torch.nn.Module, act_dtype: Optional[torch.dtype]
                    ) -> RefitResult:
        """Inside vLLM's pause: the staged version goes live (``StagedRefits.flip``), then
        the weights vLLM derives from it are recomputed."""
        stager = self.require_stager()
        stats = stager.flip()
        return self._refreshed(model, stager.live.values(), act_dtype, stats)

    def _refreshed(self, model: torch.nn.Module, written, act_dtype: Optional[torch.dtype],
                   stats: dict) -> RefitResult:
        try:
            stats["derived_staging"] = {}
            t0 = time.perf_counter()
            refreshed = [] if model is self._underived else refresh_derived_weights(
                model, written, act_dtype, stats=stats["derived_staging"])
            stats["derived_s"] = time.perf_counter() - t0
        except DerivedWeightsError as err:
            self.weights.writing(n for n, _ in model.named_parameters() if "kv_b_proj" in n)
            self.weights.failed(str(err))
            raise
        return RefitResult(version=stats["version"], mode=stats.get("mode"),
                           bytes_received=stats.get("bytes_received", 0),
                           refit_s=stats["refit_s"], derived_refreshed=tuple(refreshed),
                           stats=MappingProxyType(dict(stats)))

    def _convert_staged(self, session: ReceiverSession, stats: dict) -> None:
        """vLLM's own conversion of the layers the refit wrote in checkpoint order
        (``receiver.staged_conversion``), layer by layer into the same storage."""
        if self.staged is None or not self.staged.layers:
            return
        try:
            self.online.finish(session.targets.where())
            self.staged.received(session.targets.params.values())
            stats["staged_converted"] = self.staged.convert()
        except (StagedConversionError, OnlineQuantError) as err:
            session.forget_delta_base()
            self.weights.writing(sorted(self.staged.param_names))
            self.weights.failed(str(err))
            raise
        except BaseException:
            session.forget_delta_base()
            raise
        if self.staged.rewrote:  # converted bytes are no base for a delta; an identity's are
            session.forget_delta_base()
        stats["staged_conversion"] = self.staged.report()
        if self.online:
            stats["online_quant"] = self.online.report()

    def release_staging(self) -> None:
        if self.session is not None:
            self.session.release_staging()

    def destroy_groups(self, timeout_s: float) -> None:
        """Shut the groups down (every rank of each group does the same) and drop the session."""
        groups, self.groups, self.session, self.options = self.groups or {}, None, None, None
        self._underived = None
        if self.stager is not None:
            self.stager.discard(timeout_s)
        self.staged = self.stager = None
        for stage in sorted(groups):
            destroy_refit_group(groups[stage], timeout_s)

    def report(self) -> dict:
        """Plain-data summary: params, bytes received, timings, target params left unwritten."""
        if self.session is None:
            return {"prepared": False, "weights": self.weights.as_dict()}
        staged = self.staged
        return {"prepared": True, **self.session.report(),
                **({"staged_conversion": staged.report()} if staged and staged.layers else {}),
                **({"staged_refit": self.stager.state()} if self.stager else {})}

    def weights_state(self) -> dict:
        """The live weights' state; with a staged session also ``staged`` (its phase and
        staged version: ``StagedRefits.state``)."""
        out = self.weights.as_dict()
        if self.stager is not None:
            out["staged"] = self.stager.state()
        return out


__all__ = ["GroupsJoined", "MiscReceiver", "PrepareOptions", "PrepareSummary", "RefitResult",
           "RefitWorkerState", "model_device", "vllm_gen_coords", "vllm_tp_coords"]
