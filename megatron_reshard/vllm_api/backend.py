"""The ``megatron_reshard`` weight-transfer backend of vLLM 0.33 (worker side).

Selected with ``WeightTransferConfig(backend="megatron_reshard")`` once the plugin
(``megatron_reshard.vllm_api.plugin``, entry point group ``vllm.general_plugins``) registered
it. vLLM's GPU worker builds one engine per worker with the model it holds
(``model_runner.get_model()``) and forwards its weight-update calls to it. The engine
holds one ``receiver.worker_state.RefitWorkerState`` (groups, session, options, weight
state; the ``collective_rpc`` worker extension holds the same), so every refit step below
is that state's code, with the engine's model as the target; its typed results become
dicts only where vLLM's RPCs return them (``refit_weights_state``, ``report``).

Lifecycle (vLLM worker call → engine → receiver):

- ``init_weight_transfer_engine(init_info)`` → ``parse_init_info`` (``MegatronReshardInitInfo``)
  → ``init_transfer_engine``: join one refit group per training PP stage
  (``RefitWorkerState.join_groups``), then validate the whole payload against this rank's storage and
  map every HF name onto it (``RefitWorkerState.prepare``: a param the payload does not write is
  refused unless ``prepare_options["keep_as_loaded"]`` lists it); an error there is posted
  on the groups' fault boards, so the training ranks raise it too.
- ``start_weight_update()`` → opens one update (refuses a second one while open).
- ``update_weights(update_info)`` → ``parse_update_info`` (``MegatronReshardUpdateInfo``) →
  ``receive_weights``: one refit (receive every param, then the commit vote over all
  groups: the weights' version advances only if every rank of every group got every
  param). With ``update_info["version"]`` the committed version must equal it. A
  version that does not increase the weights' version is refused on every rank before
  any byte moves (``refit.version``), the weights untouched.
  On failure it raises ``WeightUpdateError`` carrying the weight state.
- ``finish_weight_update()`` → requires a refit committed in this update and consistent
  weights; ``finish_weight_update(weight_version=N)`` (direct callers; vLLM's worker passes
  none) checks the committed version too. It closes the engine's update whether or not it
  raises, but vLLM's worker keeps its own session open after a finish that raised (0.34.0
  unless ``VLLM_RELOAD_MODE=direct``; 0.25.1 always) and refuses ``start_weight_update``
  and ``shutdown_weight_transfer_engine`` until a finish returns. So the next
  ``finish_weight_update`` after one that raised, with no update open, returns once,
  logging at WARNING what the weights hold; any other finish without an open update raises.
  (A failed ``update_weights`` needs no retry: vLLM's worker ends its session itself.)
- ``shutdown_weight_transfer_engine()`` → ``RefitWorkerState.destroy_groups``.

Staged refits (``prepare_options={"staged": True}``, ``receiver.staging``):
``update_weights({"staged": True})`` starts the receive into staging tensors on the worker's
own thread and returns, so vLLM's engine loop keeps generating from the live weights;
``finish_weight_update()`` (called inside ``pause_generation(mode="keep")``) flips the
staged version into vLLM's storage in place. A failure before the flip leaves the live
weights consistent at their version (README, "Staged refits").

The weight state (``refit_weights_state()``: ``consistent``/``inconsistent``, ``version``,
``started_from``, ``overwritten``, ...) belongs to the engine and outlives refit groups, so a
restarted trainer (``shutdown`` + ``init_transfer_engine`` on new ports) is seen to restore
consistency.

vLLM's own weight-update flow does not touch the scheduler's prefix cache; this engine runs
inside the worker and cannot reach it. After a committed refit the caller must drop every
KV block computed from the old weights (README, "vLLM weight-transfer backend").

The modules of ``vllm_api`` are the only ones of the package that import vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_reshard.errors import BadInputError, CallOrderError, MegatronReshardError
from megatron_reshard.receiver.misc_transport import receive_misc_packed
from megatron_reshard.vllm_api.compat import WorkerEngineCompat
from megatron_reshard.receiver.worker_state import (
    PrepareOptions,
    PrepareSummary,
    RefitResult,
    RefitWorkerState,
    model_device,
    vllm_gen_coords,
    vllm_tp_coords,
)
from megatron_reshard.vllm_api import init_checks
from megatron_reshard.vllm_api.init_checks import field_error as _field_error
from megatron_reshard.vllm_api.init_checks import is_int as _is_int
from megatron_reshard.wire.codec import decode_payload

logger = logging.getLogger(__name__)


class WeightUpdateError(MegatronReshardError, RuntimeError):
    """A weight update through the backend failed; ``weights`` is the weight state after it
    (``WeightState.as_dict()``)."""

    def __init__(self, message: str, weights: Mapping[str, Any]):
        super().__init__(message)
        self.weights = dict(weights)


class WeightVersionMismatch(WeightUpdateError):
    """The refit committed a version other than the one the caller expected."""


@dataclass
class MegatronReshardInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine(init_info)`` takes (plain data: dicts over HTTP).

    The first six fields are ``RefitWorkerState.join_groups``'s arguments (as the worker
    extension's ``init_refit_groups`` takes them); ``payload`` is the training side's refit
    payload (``MegatronRefitSource.payload`` as a plain dict, or its msgpack bytes
    ``payload_bytes()``); ``prepare_options`` are ``receiver.worker_state.PrepareOptions``'
    fields (``num_streams``, ``batch_bytes``, ``staging_bytes``,
    ``strided_in_place``, ``verify_checksums``, ``keep_as_loaded``; ``verify_checksums``
    must match the sender's; ``keep_as_loaded`` lists the vLLM params the payload does not
    write that may keep what was loaded, any other such param is refused at init;
    ``staged``, ``staging_budget_bytes``: staged refits, ``receiver.staging``).
    """

    host: str
    ports_by_stage: Union[Sequence[int], Mapping[int, int]]
    group_sizes: Union[int, Sequence[int], Mapping[int, int]]
    payload: Union[dict, bytes]
    group_rank: Optional[int] = None
    backend: str = "nccl"
    timeout_s: float = 600.0
    prepare_options: Optional[dict] = field(default=None)

    def __post_init__(self) -> None:
        cls = type(self).__name__
        init_checks.check_host(cls, self.host)
        init_checks.check_ports_by_stage(cls, self.ports_by_stage)
        init_checks.check_per_stage_ints(cls, "group_sizes", self.group_sizes, lo=2,
                                         scalar_ok=True)
        init_checks.check_payload(cls, self.payload, decode_payload)
        if self.group_rank is not None and (not _is_int(self.group_rank) or self.group_rank < 0):
            raise _field_error(cls, "group_rank", "None (derive from vLLM's rank) or an int >= 0",
                               self.group_rank)
        init_checks.check_choice(cls, "backend", self.backend, init_checks.GROUP_BACKENDS)
        init_checks.check_timeout_s(cls, self.timeout_s)
        init_checks.check_options(cls, "prepare_options", self.prepare_options,
                                  PrepareOptions.NAMES)


@dataclass
class MegatronReshardUpdateInfo(WeightTransferUpdateInfo):
    """What ``update_weights(update_info)`` takes: nothing is needed (the payload fixed the
    transfer at init); ``version``, if given, is the weight version the training side's
    ``RefitSender.refit(version=...)`` sends, checked against the committed one.
    ``staged``: start a staged refit and return (the engine was prepared with
    ``prepare_options={"staged": True}``); ``finish_weight_update`` flips it."""

    version: Optional[int] = None
    staged: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.version, str) and self.version.lstrip("-").isdigit():
            self.version = int(self.version)
        if self.version is not None and not _is_int(self.version):
            raise _field_error(type(self).__name__, "version", "None or an int (the trainer's "
                               "refit version)", self.version)
        if not isinstance(self.staged, bool):
            raise _field_error(type(self).__name__, "staged", "True or False", self.staged)


def _fields_text(cls) -> str:
    return ", ".join(f.name + ("" if f.default is dataclasses.MISSING
                               and f.default_factory is dataclasses.MISSING else "?")
                     for f in dataclasses.fields(cls))


class MegatronReshardWeightTransferEngine(
        WorkerEngineCompat,
        WeightTransferEngine[MegatronReshardInitInfo, MegatronReshardUpdateInfo]):
    """vLLM weight-transfer engine over megatron_reshard's receiver (see module doc).
    ``WorkerEngineCompat``: what the running vLLM's base class asks beyond this class
    (``vllm_api.compat``)."""

    init_info_cls = MegatronReshardInitInfo
    update_info_cls = MegatronReshardUpdateInfo
    # the payload describes one model's shards; a draft model would need its own payload
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        # groups, session, options, weights; the target is always ``self.model`` (vLLM may
        # retarget the engine between updates: ``set_weight_update_target``)
        self.state = RefitWorkerState()
        self.summary: Optional[PrepareSummary] = None  # of the payload prepared at init
        self.last_refit: Optional[RefitResult] = None
        self._timeout_s = 60.0
        self._update: Optional[list[int]] = None  # the open update: versions committed in it
        self._staged: Optional[MegatronReshardUpdateInfo] = None  # started, not flipped yet
        # the last finish_weight_update raised, having closed the update: vLLM's worker keeps
        # its session open then, and only a finish that returns ends it (module doc)
        self._finish_failed = False

    # -- typed infos -------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> MegatronReshardInitInfo:
        if not isinstance(init_dict, Mapping):
            raise BadInputError(f"Invalid init_info for {type(self).__name__}: expected a dict with "
                             f"fields {_fields_text(self.init_info_cls)}, found "
                             f"{type(init_dict).__name__}")
        try:
            return super().parse_init_info(dict(init_dict))
        except ValueError as exc:
            raise BadInputError(f"{exc} (fields: {_fields_text(self.init_info_cls)}; ? = optional)") \
                from exc.__cause__ or exc

    def parse_update_info(self, update_dict: dict[str, Any]) -> MegatronReshardUpdateInfo:
        if update_dict is None:
            update_dict = {}
        if not isinstance(update_dict, Mapping):
            raise BadInputError(f"Invalid update_info for {type(self).__name__}: expected a dict "
                             f"with fields {_fields_text(self.update_info_cls)}, found "
                             f"{type(update_dict).__name__}")
        return super().parse_update_info(dict(update_dict))

    # -- lifecycle ---------------------------------------------------------------------

    def init_transfer_engine(self, init_info: MegatronReshardInitInfo) -> None:
        if not isinstance(init_info, MegatronReshardInitInfo):
            init_info = self.parse_init_info(init_info)
        payload = init_info.payload
        if isinstance(payload, (bytes, bytearray)):
            from megatron_reshard.wire.codec import decode_payload

            payload = decode_payload(bytes(payload))
        if self._update is not None:
            raise CallOrderError("init_transfer_engine called during a weight update; finish it "
                               "(or let it fail) first")
        self._timeout_s = float(init_info.timeout_s)
        self.summary = None
        self.state.join_groups(init_info.host, init_info.ports_by_stage, init_info.group_rank,
                               init_info.group_sizes, init_info.backend, init_info.timeout_s,
                               gen_coords=vllm_gen_coords)
        self.summary = self.state.prepare(self.model, payload, init_info.prepare_options,
                                          receive_misc=self._receive_misc, vllm_tp=vllm_tp_coords())
        logger.info("megatron_reshard: refit groups joined, payload mapped (%s params)",
                    self.summary.params)

    def _receive_misc(self, stage: int, group: Any, items: list) -> Mapping[str, torch.Tensor]:
        """The stage's packed params: one broadcast from its first train rank."""
        return receive_misc_packed(stage, group, items, model_device(self.model))

    def start_weight_update(self) -> None:
        if self.summary is None:
            raise CallOrderError("start_weight_update before init_weight_transfer_engine: the "
                               "engine has no refit groups or payload yet")
        if self._update is not None:
            raise CallOrderError("start_weight_update while a weight update is open; call "
                               "finish_weight_update first")
        self._update = []
        self._finish_failed = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises without an
        # accelerator; the refit already waited for its device work before the commit vote
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: MegatronReshardUpdateInfo) -> None:
        if self._update is None:
            raise CallOrderError("update_weights outside a weight update: call start_weight_update "
                               "first")
        if self._staged is not None:
            raise CallOrderError("update_weights while a staged refit of this update waits for "
                                 "its flip: call finish_weight_update (inside the pause) first")
        if update_info.staged:
            self.state.require_stager().start(self.state.require_session())
            self._staged = update_info
            return
        try:
            result = self.state.refit(self.model, getattr(self.model_config, "dtype", None))
        except Exception as exc:
            raise self._update_failed("refit", exc) from exc
        self._committed(result, update_info)

    def _update_failed(self, what: str, exc: Exception, then: str = "") -> WeightUpdateError:
        """The update ends here: the error, carrying the weight state the failure left."""
        self._update = None
        weights = self.refit_weights_state()
        return WeightUpdateError(f"megatron_reshard {what} failed ({type(exc).__name__}: {exc}); "
                                 f"the weights are {_state_text(weights)}{then}", weights)

    def _committed(self, result: RefitResult, update_info: MegatronReshardUpdateInfo,
                   then: str = "") -> None:
        self.last_refit = result
        self._update.append(result.version)
        if update_info.version is not None and result.version != update_info.version:
            self._update = None
            weights = self.refit_weights_state()
            raise WeightVersionMismatch(
                f"update_info.version: expected {update_info.version}, the trainer committed "
                f"version {result.version}; the weights are {_state_text(weights)}{then}",
                weights)

    def _flip(self) -> None:
        """The staged refit of this update goes live (waits for its transfer first)."""
        info, self._staged = self._staged, None
        try:
            result = self.state.flip_staged(self.model, getattr(self.model_config, "dtype", None))
        except Exception as exc:
            raise self._update_failed("staged refit", exc, _RETRY) from exc
        self._committed(result, info, _RETRY)

    def finish_weight_update(self, weight_version: Union[int, str, None] = None) -> None:
        retry, self._finish_failed = self._finish_failed, False
        if self._update is None:
            weights = self.refit_weights_state()
            if retry:  # vLLM's worker closing the session the failed finish left open
                logger.warning("megatron_reshard: finish_weight_update again after it failed: "
                               "the weight update is closed; the weights are %s",
                               _state_text(weights))
                return
            raise WeightUpdateError("finish_weight_update without an open weight update (none "
                                    "started, or its refit failed); the weights are "
                                    f"{_state_text(weights)}", weights)
        self._finish_failed = True  # until it returns: this call closes the update either way
        self._finish(weight_version)
        self._finish_failed = False

    def _finish(self, weight_version: Union[int, str, None]) -> None:
        if self._staged is not None:
            self._flip()  # inside the caller's pause: local copies only
        update, self._update = self._update, None
        state = self.state.weights
        weights = state.as_dict()  # what the errors carry
        if not update:
            raise WeightUpdateError("finish_weight_update: no refit committed since "
                                    "start_weight_update (call update_weights while the trainer "
                                    f"sends); the weights are {_state_text(weights)}{_RETRY}",
                                    weights)
        if not state.consistent:  # a later failed refit of this update
            raise WeightUpdateError(f"finish_weight_update: the weights are "
                                    f"{_state_text(weights)}{_RETRY}", weights)
        if weight_version is not None:
            want = MegatronReshardUpdateInfo(version=weight_version).version
            if state.version != want:
                raise WeightVersionMismatch(
                    f"finish_weight_update(weight_version={weight_version!r}): the committed "
                    f"version is {state.version}; the weights are {_state_text(weights)}"
                    f"{_RETRY}", weights)

    def shutdown(self) -> None:
        self._update = self._staged = None
        if self.state.groups is not None:
            self.state.destroy_groups(self._timeout_s)
        self.summary = None

    # -- what the weights hold (reached through vLLM's RPCs: plain dicts) -----------------

    def refit_weights_state(self) -> dict:
        """``WeightState.as_dict()`` (as the worker extension's); reach it through vLLM with
        ``llm.collective_rpc(lambda w: w.weight_transfer_engine.refit_weights_state())``."""
        return self.state.weights_state()

    def check_refit_weights_consistent(self) -> None:
        self.state.weights.require_consistent()

    def report(self) -> dict:
        return self.state.report()


# what each error a finish raises adds (vLLM's worker keeps its session open after it)
_RETRY = (". Calling finish_weight_update again closes this update (vLLM's worker keeps it "
          "open after a failed finish)")


def _state_text(w: Mapping[str, Any]) -> str:
    if w["state"] == "consistent":
        kept = w.get("not_refitted") or []
        also = (f"; {len(kept)} params kept as loaded, not refitted: {', '.join(kept[:4])}"
                + (", ..." if len(kept) > 4 else "")) if kept else ""
        return f"consistent at version {w['version']} ({w['refits']} refits committed{also})"
    names = w["overwritten"]
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    return (f"inconsistent: {len(names)} params ({shown}) may hold the failed refit's bytes, "
            f"the rest version {w['started_from']}")


__all__ = ["MegatronReshardInitInfo", "MegatronReshardUpdateInfo",
           "MegatronReshardWeightTransferEngine", "WeightUpdateError", "WeightVersionMismatch"]
