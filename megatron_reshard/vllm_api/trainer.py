"""The ``megatron_reshard`` weight-transfer backend of vLLM 0.33 (trainer side).

vLLM's trainer API: ``WeightTransferTrainerFactory.trainer_init(init_info, client=...,
source=...)`` on every training rank picks the engine by ``init_info.backend`` and returns it
rendezvoused with the inference side; ``engine.send_weights()`` then drives one update round
trip through the client (``start_weight_update``, ``update_weights``,
``finish_weight_update``). Here ``init_info`` is ``MegatronReshardTrainerInitInfo`` and the
source is this library's ``MegatronRefitSource`` (not a vLLM ``WeightSource``: the shards
travel as they lie, nothing is gathered to full tensors).

Every training rank sends its own shards (``RefitSender`` over its PP stage's refit group);
only the rank whose ``init_info.rank`` is 0 (vLLM's "sender") calls the client. The worker
side is ``megatron_reshard.vllm_api.backend``; the mapping of one call onto the other:

- ``trainer_init``: rank 0 calls ``client.init_weight_transfer_engine`` with the worker's
  ``MegatronReshardInitInfo`` as a dict (the payload, per-stage ports and group sizes, the
  plan-fingerprint options taken from this init info so the two sides cannot disagree) in a
  thread, while every rank joins its stage's refit group and builds its sender: the workers'
  init joins the same groups.
- ``send_weights(version=None)``: rank 0 ``start_weight_update()``, then
  ``update_weights({"version": v})`` in a thread while every rank runs ``RefitSender.refit(v)``
  (the workers' update is the receiving half of that refit; ``v`` None unless the caller
  gave one: the sender's version check then picks it, the commit vote carries it, and
  workers asked for a version check it), then ``finish_weight_update(weight_version=
  str(committed))`` (vLLM's engine-level version label). Whenever the workers' update is
  open (their ``update_weights`` returned), rank 0 finishes it, unlabelled if the refit
  failed; a finish that raised is called once more, which closes vLLM's update (vLLM's
  workers keep it open after a failed finish and refuse the next start: ``vllm_api.backend``).
  With ``staged=True`` the same calls carry ``{"staged": True}``: the workers'
  ``update_weights`` starts the receive on their own thread and returns, vLLM keeps
  generating from version N while the refit runs and commits, and ``finish_weight_update``
  is the flip (vLLM's engine core runs a worker call between two engine steps, so that call
  is the pause; requests in flight keep their KV from N, as with
  ``pause_generation(mode="keep", clear_cache=False)``). vLLM's client protocol has no pause
  call: for another KV policy, drive the update with ``AsyncLLM`` yourself (README, "Staged
  refits"). The training side sends exactly as without it: ``RefitSender`` needs no option
  for a staged refit.
- ``shutdown()``: rank 0 ``client.shutdown_weight_transfer_engine()`` (where the client has
  it: vLLM's HTTP and Ray clients do) while every rank destroys its refit group.

After the client calls, every rank's outcome (rank 0's client call included) is shared over
the default process group (the training world), so all ranks return or all raise; a failed
``trainer_init`` leaves no refit group behind on either side.

The modules of ``vllm_api`` are the only ones of the package that import vLLM. Importing
this one registers the trainer engine (``plugin.register``), so constructing the
init info is enough for vLLM's factory to find the engine.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from megatron_reshard.errors import BadInputError, BadInputTypeError, MegatronReshardError
from megatron_reshard.groups.comm import TRANSPORT_NAMES, create_refit_group, destroy_refit_group
from megatron_reshard.groups.faults import post_failure
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.megatron.source import MegatronRefitSource
from megatron_reshard.delta import DeltaConfig
from megatron_reshard.refit.loop import DEFAULT_BATCH_BYTES, DEFAULT_STAGING_BYTES, PLANNERS
from megatron_reshard.receiver.worker_state import PrepareOptions
from megatron_reshard.vllm_api import init_checks
from megatron_reshard.vllm_api.backend import MegatronReshardInitInfo
from megatron_reshard.vllm_api.plugin import BACKEND_NAME, register

# the options that enter the plan fingerprint: the trainer's values go to the workers
_SHARED_OPTIONS = ("batch_bytes", "staging_bytes", "verify_checksums", "planner")
_PAYLOAD_FORMATS = ("msgpack", "plain")
# how long rank 0 waits past the refit for the workers' answer: their refit is bounded by the
# group's timeout, so an answer later than that means a worker that never entered it
_ANSWER_MARGIN_S = 30.0


class TrainerWeightTransferError(MegatronReshardError, RuntimeError):
    """A client call of the trainer engine failed (raised on every training rank)."""


def _field_error(name: str, expected: str, value: Any) -> BadInputError:
    return init_checks.field_error("MegatronReshardTrainerInitInfo", name, expected, value)


@dataclass
class MegatronReshardTrainerInitInfo(TrainerInitInfo):
    """What ``WeightTransferTrainerFactory.trainer_init`` takes for this backend, on every
    training rank (``rank``: this process's rank in the training world; rank 0 calls the
    client).

    ``host`` / ``ports_by_stage``: where each PP stage's refit group meets (group rank 0, the
    stage's first training rank, hosts its store). ``group_backend``: the refit groups' torch
    backend ("nccl" or "gloo"); ``transport``: "p2p", "colocated" or None (the library's
    default). ``device``: the sender's device (default: the current CUDA device with NCCL,
    else CPU). ``num_streams``, ``batch_bytes``, ``staging_bytes``, ``verify_checksums``,
    ``planner`` (``"auto"``, ``"link"``, ``"default"``): the sender's options; all but
    ``num_streams`` are sent to the workers too. ``node``: this training rank's node name for
    the planner (None: the host name; docs/DESIGN.md, "Which planner a refit uses"). ``worker_options``: the
    workers' other ``prepare_refit`` options (e.g. ``num_streams``, ``strided_in_place``).
    ``payload_format``: "msgpack" (bytes, the default) or "plain" (the payload as a dict).
    ``delta``: the sender's ``RefitSender(delta=...)`` (experimental; ``False``, ``True`` or a
    ``delta.DeltaConfig``): later updates send only the changed elements where every
    rank can prove the base; the workers need no option for it. ``check_finite``: the
    sender's ``RefitSender(check_finite=...)`` (NaN/Inf in a weight refuses the update on
    every rank before any byte moves, naming the param: the workers keep their version).
    ``staged``: staged updates (issue 53): the workers are
    prepared ``{"staged": True}``, ``update_weights`` returns at once and vLLM keeps
    generating while the shards travel, ``finish_weight_update`` flips (see the module doc);
    the sender itself sends exactly as without it. Refused with a device staging budget
    and a finite host one in ``worker_options`` (params received in place wait for the
    flip, which this engine calls only after the refit: drive such a flip yourself, README).
    """

    backend: ClassVar[str] = BACKEND_NAME

    host: str
    ports_by_stage: Union[Sequence[int], Mapping[int, int]]
    group_backend: str = "nccl"
    transport: Optional[str] = None
    timeout_s: float = 600.0
    device: Optional[str] = None
    num_streams: int = 2
    batch_bytes: int = DEFAULT_BATCH_BYTES
    staging_bytes: int = DEFAULT_STAGING_BYTES
    verify_checksums: bool = False
    worker_options: Optional[dict] = None
    payload_format: str = "msgpack"
    delta: Union[bool, DeltaConfig] = False
    planner: str = "auto"
    node: Optional[str] = None
    check_finite: bool = False
    staged: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise _field_error("rank", "this process's rank in the training world (an int "
                               ">= 0)", self.rank)
        # the fields the workers' init info has too: the same checks, in one place
        cls = type(self).__name__
        init_checks.check_host(cls, self.host)
        init_checks.check_ports_by_stage(cls, self.ports_by_stage)
        init_checks.check_choice(cls, "group_backend", self.group_backend,
                                 init_checks.GROUP_BACKENDS)
        init_checks.check_timeout_s(cls, self.timeout_s)
        init_checks.check_options(cls, "worker_options", self.worker_options,
                                  PrepareOptions.NAMES, reserved=_SHARED_OPTIONS + ("staged",))
        init_checks.check_choice(cls, "transport", self.transport, (None, *TRANSPORT_NAMES))
        if self.transport == "colocated" and self.group_backend != "gloo":
            raise _field_error("group_backend", "'gloo' with transport='colocated' (its data "
                               "never crosses the group)", self.group_backend)
        init_checks.check_choice(cls, "payload_format", self.payload_format, _PAYLOAD_FORMATS)
        for name in ("num_streams", "batch_bytes", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _field_error(name, "an int >= 1", value)
        if self.planner not in PLANNERS:
            raise _field_error("planner", f"one of {list(PLANNERS)}", self.planner)
        if self.node is not None and not isinstance(self.node, str):
            raise _field_error("node", "a node name (str) or None", self.node)
        if not (isinstance(self.delta, (bool, DeltaConfig))):
            raise _field_error("delta", "False, True or a megatron_reshard.delta.DeltaConfig",
                               self.delta)
        if not isinstance(self.check_finite, bool):
            raise _field_error("check_finite", "True or False", self.check_finite)
        if not isinstance(self.staged, bool):
            raise _field_error("staged", "True or False", self.staged)
        options = self.worker_options or {}
        if self.staged and options.get("staging_budget_bytes") is not None and \
                options.get("host_staging_budget_bytes", 0) is not None:
            raise _field_error(
                "staged", "False with worker_options staging_budget_bytes and "
                "host_staging_budget_bytes both bounded (a param beyond them is received "
                "in the pause, which this engine starts only after the refit returns; set one "
                "budget to None, or drive the flip yourself: README, 'Staged refits')", True)

    def port_of(self, stage: int) -> int:
        ports = self.ports_by_stage
        if isinstance(ports, Mapping):
            port = ports.get(stage, ports.get(str(stage)))
        else:
            port = ports[stage] if 0 <= stage < len(ports) else None
        if port is None:
            raise _field_error("ports_by_stage", f"a port for PP stage {stage} (one per stage)",
                               ports)
        return int(port)

    def worker_init_info(self, source: MegatronRefitSource) -> MegatronReshardInitInfo:
        """The workers' init info for ``source``, checked as the workers will check it."""
        stage_world = source.layout.world_size // source.layout.pp
        for stage in range(source.layout.pp):
            self.port_of(stage)
        payload = source.payload_bytes() if self.payload_format == "msgpack" else source.payload
        options = {**(self.worker_options or {}),
                   **{name: getattr(self, name) for name in _SHARED_OPTIONS},
                   "staged": self.staged}
        ports = (dict(self.ports_by_stage) if isinstance(self.ports_by_stage, Mapping)
                 else list(self.ports_by_stage))
        return MegatronReshardInitInfo(
            host=self.host, ports_by_stage=ports,
            group_sizes=stage_world + int(source.gen_world_size), payload=payload,
            group_rank=None, backend=self.group_backend, timeout_s=self.timeout_s,
            prepare_options=options)


class MegatronReshardTrainerWeightTransferEngine(
        TrainerWeightTransferEngine[MegatronReshardTrainerInitInfo]):
    """vLLM trainer engine over ``RefitSender`` (see the module doc)."""

    init_info_cls = MegatronReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: MegatronRefitSource, is_sender: bool, rank: int,
                 init_info: MegatronReshardTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.init_info = init_info
        self.device = _device_of(init_info)
        self.group: Any = None
        self.sender: Optional[RefitSender] = None
        self.version = 0          # of the last update committed
        self.last_refit: Optional[dict] = None  # RefitSender.refit's stats

    @classmethod
    def trainer_init(cls, init_info: MegatronReshardTrainerInitInfo, *, client: Any,
                     source: Optional[MegatronRefitSource] = None
                     ) -> "MegatronReshardTrainerWeightTransferEngine":
        if not isinstance(init_info, MegatronReshardTrainerInitInfo):
            raise BadInputTypeError(f"{cls.__name__}.trainer_init: expected a "
                            f"MegatronReshardTrainerInitInfo, found {type(init_info).__name__}")
        if not isinstance(source, MegatronRefitSource):
            raise BadInputTypeError(f"{cls.__name__}.trainer_init(source=...): expected a "
                            f"megatron_reshard MegatronRefitSource (the backend sends Megatron "
                            f"shards as they lie), found {type(source).__name__}")
        if dist.is_initialized() and dist.get_rank() != init_info.rank:
            raise BadInputError(f"MegatronReshardTrainerInitInfo.rank: expected this process's "
                             f"rank in the training world ({dist.get_rank()}), found "
                             f"{init_info.rank}")
        # identical on every rank (same init info, same payload): all raise alike, before any
        # collective
        worker_info = dataclasses.asdict(init_info.worker_init_info(source))
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     rank=init_info.rank, init_info=init_info)
        connect_error: Optional[BaseException] = None
        with _calls() as pool:
            answer = (pool.submit(client.init_weight_transfer_engine, worker_info)
                      if engine.is_sender else None)
            try:
                engine._connect()
            except Exception as exc:  # noqa: BLE001 - raised after the ranks agreed
                connect_error = exc
            error = engine._answer_of(answer, "init_weight_transfer_engine")
        try:
            engine._agree(error, "trainer_init", connect_error)
        except Exception:
            engine._release_after_failed_init()
            raise
        finally:
            connect_error = None  # this frame, in its traceback, would hold it: a cycle (issue 52)
        return engine

    def _release_after_failed_init(self) -> None:
        """A failed ``trainer_init`` leaves no group behind on either side: the workers may
        have joined theirs before refusing the payload."""
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - the init's own error is the one to raise
            pass

    def _connect(self) -> None:
        info, source = self.init_info, self.source
        stage_world = source.layout.world_size // source.layout.pp
        self.group = create_refit_group(
            info.host, info.port_of(source.stage), source.stage_local_rank,
            stage_world + int(source.gen_world_size), info.group_backend, info.timeout_s,
            device=self.device if self.device.type == "cuda" else None,
            who=f"train rank {self.rank} (PP stage {source.stage})",
            label=f"refit group of PP stage {source.stage}", transport=info.transport)
        self.sender = RefitSender(source, self.group, device=self.device,
                                  num_streams=info.num_streams, batch_bytes=info.batch_bytes,
                                  staging_bytes=info.staging_bytes,
                                  verify_checksums=info.verify_checksums, delta=info.delta,
                                  planner=info.planner, node=info.node,
                                  check_finite=info.check_finite)

    def send_weights(self, version: Optional[int] = None) -> None:
        """One weight update: every rank sends its shards; rank 0 drives the workers through
        the client. ``version``, if given, must be the same on every rank; the workers check
        they committed it. Default: the sender's own (one more than the higher of its last
        version and the version the workers' weights hold, so a restarted trainer continues
        after them). vLLM labels the weights with the committed version."""
        if self.sender is None:
            raise TrainerWeightTransferError("send_weights after shutdown (or before "
                                             "trainer_init): no refit group")
        version = None if version is None else int(version)
        refit_error: Optional[BaseException] = None
        client_error: Optional[str] = None
        with _calls() as pool:
            answer = None
            if self.is_sender:
                try:
                    self.client.start_weight_update()
                    # staged: returns at once, the workers receive beside generation
                    answer = pool.submit(self.client.update_weights, {
                        "version": version, **({"staged": True} if self.init_info.staged else {})})
                    answer.add_done_callback(self._post_if_failed)
                except Exception as exc:  # noqa: BLE001 - the peers must learn of it
                    post_failure([self.group], exc)
                    client_error = _text(exc, "start_weight_update")
            try:
                self.last_refit = self.sender.refit(version)
                version = self.version = self.last_refit["version"]
            except Exception as exc:  # noqa: BLE001 - raised after the ranks agreed
                refit_error = exc
            if answer is not None:
                client_error = self._answer_of(answer, "update_weights")
                if client_error is None:  # the workers' update is open: end it either way
                    client_error = self._finish(None if refit_error else version)
            try:
                self._agree(client_error, "send_weights (version "
                            f"{version if version is not None else 'the sender picks'})", refit_error)
            finally:
                refit_error = None  # this frame, in its traceback, would hold it: a cycle (issue 52)

    def shutdown(self) -> None:
        """Destroy this rank's refit group; rank 0 has the workers release theirs."""
        if self.group is None:
            return
        release = getattr(self.client, "shutdown_weight_transfer_engine", None)
        with _calls() as pool:
            answer = (pool.submit(release) if self.is_sender and callable(release) else None)
            group, self.group, self.sender = self.group, None, None
            destroy_refit_group(group, self.init_info.timeout_s)
            error = self._answer_of(answer, "shutdown_weight_transfer_engine")
        if error is not None:
            raise TrainerWeightTransferError(error)

    # -- rank 0's client calls, shared ----------------------------------------------------

    def _finish(self, version: Optional[int]) -> Optional[str]:
        """Rank 0 ends the workers' update, labelled ``version`` unless None (the refit
        failed: a staged one fails at the workers' flip). vLLM's workers keep their update
        open after a finish that raised, so that one is called again, unlabelled: the
        workers' engine closes it then (``vllm_api.backend``); the first error stands."""
        try:
            self.client.finish_weight_update(
                weight_version=None if version is None else str(version))
            return None
        except Exception as exc:  # noqa: BLE001 - a text every rank can raise
            error = _text(exc, "finish_weight_update")
        try:
            self.client.finish_weight_update()
        except Exception as exc:  # noqa: BLE001
            error += (f"; calling it again to close the update failed too "
                      f"({_text(exc, 'finish_weight_update')})")
        return error

    def _post_if_failed(self, answer) -> None:
        """A worker refusing the update never joins the refit: tell the group at once."""
        exc = answer.exception()
        if exc is not None and self.group is not None:
            post_failure([self.group], exc)

    def _answer_of(self, answer, call: str) -> Optional[str]:
        if answer is None:
            return None
        try:
            answer.result(timeout=self.init_info.timeout_s + _ANSWER_MARGIN_S)
        except Exception as exc:  # noqa: BLE001 - a text every rank can raise
            return _text(exc, call)
        return None

    def _agree(self, client_error: Optional[str], during: str,
               own_error: Optional[BaseException] = None) -> None:
        """Every training rank learns every rank's outcome (rank 0's client call included),
        so all raise or none does: a rank with its own error raises it, the others name the
        first failed rank."""
        mine = client_error or (None if own_error is None else
                                f"{type(own_error).__name__}: {own_error}")
        outcomes = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            outcomes = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, mine)
        if own_error is not None:
            raise own_error
        failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
        if failed:
            rank, text = failed[0]
            raise TrainerWeightTransferError(
                f"{during}: training rank {rank} failed ({len(failed)} of {len(outcomes)} "
                f"ranks did): {text}")


@contextmanager
def _calls():
    """One thread for rank 0's blocking client call. Left without waiting for it: a call
    that outlived its bound answers nobody, and waiting would turn the error into a hang."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron-reshard-client")
    try:
        yield pool
    finally:
        pool.shutdown(wait=False)


def _device_of(info: MegatronReshardTrainerInitInfo) -> torch.device:
    if info.device is not None:
        return torch.device(info.device)
    if info.group_backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _text(exc: BaseException, call: str) -> str:
    return f"client.{call}: {type(exc).__name__}: {exc}"


register()  # the factory finds the engine once its init info exists (no plugin loader needed)

__all__ = ["MegatronReshardTrainerInitInfo", "MegatronReshardTrainerWeightTransferEngine",
           "TrainerWeightTransferError"]
