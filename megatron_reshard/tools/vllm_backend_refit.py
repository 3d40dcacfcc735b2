"""Refits through the ``megatron_reshard`` vLLM weight-transfer backend into vLLM's own models.

One pool job (``backend_refit_job``) plays a whole launch, as ``tools.vllm_refit`` does:
ranks below ``cfg.train_world`` are Megatron training ranks (``tools.e2e.run_training_rank``,
the real ``RefitSender``), the others generation ranks holding vLLM's own model class under
vLLM's own parallel state (``testing.vllm_models``). Each generation rank builds the engine
with vLLM's ``WeightTransferEngineFactory.create_engine`` from
``WeightTransferConfig(backend="megatron_reshard")`` and drives it exactly as vLLM's GPU
worker does (``parse_init_info`` + ``init_transfer_engine``, ``start_weight_update``,
``update_weights(dict)``, ``finish_weight_update()``, ``shutdown``). After each refit the
oracle is a second vLLM instance loaded by vLLM's ``load_weights`` from the full HF tensors.

``driver="trainer"`` plays vLLM's API on both sides instead: each training rank builds the
trainer engine with vLLM's ``WeightTransferTrainerFactory.trainer_init``
(``MegatronReshardTrainerInitInfo``, the source, a client) and refits with
``send_weights()``; training rank 0 drives the generation ranks through the client only.
What stands in for a running ``LLM``: the client (``StoreWeightSyncClient``: vLLM's
``VLLMWeightSyncClient`` protocol, each call fanned out to every generation rank over the
launch's store, as vLLM's engine core fans it out with ``collective_rpc``) and, on each
generation rank, vLLM's own GPU ``Worker`` class built without its device setup (its real
weight-sync methods run: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``, ``shutdown_weight_transfer_engine``, over the
engine from ``WeightTransferEngineFactory``; the model runner is a holder of the model).

Options: ``mismatch_rank`` (driver "worker": a gen rank that asks for a wrong ``version`` in
the last refit: the refit commits, the engine must raise ``WeightVersionMismatch``);
``fail_extra`` (one more refit in which training rank 0 raises part-way: every rank fails,
and each generation rank reports its weight state, checked against the last good oracle;
with driver "trainer" then a ``trainer_init`` the workers refuse (``REFUSED``: every
training rank must raise) and a restarted trainer on fresh groups, whose refit is compared
with vLLM's loading as well); ``retry`` (driver "worker", with ``fail_extra``): vLLM's own
``Worker`` methods drive the engine, the failed update's finish is called again, and the
generation ranks join a restarted trainer (``_restart_through_worker``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
import sys
import time
from datetime import timedelta
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_reshard.tools.vllm_refit import publish_full_hf
from megatron_reshard.tools.e2e import perturb_, run_training_rank
from megatron_reshard.tools.run_config import RefitRunConfig

PLANTED = "planted fault: training rank 0 stops sending part-way"
MISMATCH_OFFSET = 100


def _failing_refit(ctx: dict) -> dict:
    """Training side, after the good refits: one more refit of changed weights; rank 0
    raises from the pre hook of a param half-way through its sends (the sender posts it on
    the fault board)."""
    sender = ctx["sender"]
    perturb_(ctx["model"], ctx["cfg"].refits)  # new weights, so a partial write shows
    if ctx["rank"] == 0:
        specs = sender.loop.local_map.specs
        names = sorted(specs)
        spec = specs[names[len(names) // 2]]
        inner = spec.pre

        def pre(base):
            raise RuntimeError(PLANTED)

        spec.pre = pre
    try:
        if ctx.get("engine") is not None:
            ctx["engine"].send_weights()
        else:
            sender.refit()
    except Exception as exc:  # noqa: BLE001 - the failure is the subject
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if ctx["rank"] == 0:
            spec.pre = inner
    return {"error": None}


def _fail_then_restart(spare_ports):
    """Training side, driver "worker" with ``retry``: the planted failure
    (``_failing_refit``), then a restarted sender on fresh groups at ``spare_ports`` (a
    failed group is never used again) whose full refit of the same weights is published as
    step ``cfg.refits``."""

    def after_refits(ctx: dict) -> dict:
        from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
        from megatron_reshard.megatron.sender import RefitSender

        cfg, source = ctx["cfg"], ctx["source"]
        out = _failing_refit(ctx)
        group = create_refit_group(cfg.host, spare_ports[source.stage], source.stage_local_rank,
                                   cfg.stage_world + cfg.gen_world, cfg.backend, cfg.timeout_s,
                                   who=f"restarted train rank {ctx['rank']}",
                                   transport=cfg.transport)
        out["restarted"] = RefitSender(source, group, num_streams=cfg.num_streams,
                                       staging_bytes=cfg.staging_bytes,
                                       verify_checksums=cfg.verify).refit()
        publish_full_hf({**ctx, "step": cfg.refits})
        destroy_refit_group(group, cfg.timeout_s)
        return out

    return after_refits


def _engine_for(config, model):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_reshard.vllm_api.plugin import register

    register()  # what vLLM's load_general_plugins does with the installed entry point
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="megatron_reshard"), config, torch.device("cpu"), model)


def _error_of(call) -> Optional[str]:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _warnings_of(engine):
    """The WARNING lines the engine's module logs inside the block."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())

    log, keep = logging.getLogger(type(engine).__module__), Keep()
    log.addHandler(keep)
    try:
        yield lines
    finally:
        log.removeHandler(keep)


def _unstuck(worker) -> Optional[str]:
    """vLLM's refusal to start an update while its session stays open (None: it is closed);
    an open one is then dropped as only a restart of vLLM would, so the launch goes on."""
    if not worker._weight_update_active:
        return None
    refused = _error_of(worker.start_weight_update)
    worker._weight_update_active = False
    return refused or "start_weight_update was accepted with the session open"


def _restart_through_worker(worker, engine, init_info: dict, ports: Sequence[int],
                            version: int) -> dict:
    """Generation side of ``_fail_then_restart``, after the failed update, through vLLM's
    ``Worker`` only: release the groups, join the restarted trainer's (in place, not staged),
    an update without a refit (its finish raises; the same call again closes it), then a
    full refit of ``version``."""
    out = {"stuck_after_failure": _unstuck(worker),
           # the engine's own update was closed by the failed finish and its retry
           "finish_again": _error_of(engine.finish_weight_update)}
    release = getattr(worker, "shutdown_weight_transfer_engine", engine.shutdown)  # 0.25.1: none
    release()
    worker.init_weight_transfer_engine({**init_info, "ports_by_stage": list(ports),
                                        "prepare_options": {k: v for k, v in
                                                            init_info["prepare_options"].items()
                                                            if k != "staged"}})
    worker.start_weight_update()
    out["no_refit"] = _error_of(worker.finish_weight_update)
    out["open_after_no_refit"] = worker._weight_update_active
    with _warnings_of(engine) as warned:
        out["no_refit_retry"] = _error_of(worker.finish_weight_update)
    out["no_refit_retry_warnings"] = warned
    out["stuck_after_no_refit"] = _unstuck(worker)
    worker.start_weight_update()
    worker.update_weights({"version": version})
    worker.finish_weight_update()
    out["weights"] = engine.refit_weights_state()
    return out


def _gen_rank(gen_rank: int, cfg: RefitRunConfig, control, hf_config: Mapping[str, Any],
              vllm_port: int, mismatch_rank: Optional[int], fail_extra: bool,
              moe_backend: Optional[str] = None, progress_s: Optional[float] = None,
              quantization: Optional[str] = None, staged: bool = False,
              write_outside: Optional[tuple[int, str]] = None,
              retry_ports: Optional[Sequence[int]] = None) -> dict:
    from megatron_reshard.tools.e2e import tensor_digest
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.testing import vllm_models as vm
    from megatron_reshard.vllm_api.backend import WeightUpdateError, WeightVersionMismatch

    payload = decode_payload(control.get("payload"))
    model_dir = vm.write_model_dir(hf_config)
    new_config = lambda: vm.vllm_config_for(model_dir, cfg.gen_tp, ep=cfg.gen_ep > 1,  # noqa: E731
                                            moe_backend=moe_backend, quantization=quantization)
    config = new_config()
    out: dict[str, Any] = {"role": "gen", "rank": gen_rank, "differences": [], "versions": [],
                           "mismatch": None, "failed": None, "progress": []}
    said_at = time.monotonic()
    with vm.vllm_parallel_state(config, gen_rank, cfg.gen_world, vllm_port):
        model = vm.dummy_loaded_model(config)
        engine = _engine_for(config, model)
        out["engine"] = type(engine).__name__
        # retry: vLLM's own Worker methods drive the engine, with their session flag
        worker = None if retry_ports is None else _vllm_worker(config, gen_rank, engine, model)
        api = engine if worker is None else worker  # start/update/finish_weight_update
        init_info = {"host": cfg.host, "ports_by_stage": list(cfg.ports[1:1 + cfg.train_pp]),
                     "group_sizes": cfg.stage_world + cfg.gen_world, "payload": payload,
                     "group_rank": None, "backend": cfg.backend, "timeout_s": cfg.timeout_s,
                     "prepare_options": {"verify_checksums": cfg.verify,
                                         **({"staged": True} if staged else {})}}
        if worker is None:
            engine.init_transfer_engine(engine.parse_init_info(init_info))  # as vLLM's worker
        else:
            worker.init_weight_transfer_engine(init_info)
        oracle = None
        for step in range(cfg.refits):
            version = step + 1
            mismatch = mismatch_rank == gen_rank and step == cfg.refits - 1
            if write_outside is not None and step == write_outside[0]:
                with torch.no_grad():  # two elements written outside the refits
                    flat = dict(model.named_parameters())[write_outside[1]].view(-1)
                    flat[7:9] = flat[7:9] * 2 + 1
            api.start_weight_update()
            try:
                before = ({n: tensor_digest(p) for n, p in model.named_parameters()}
                          if staged else {})
                api.update_weights({"version": version + (MISMATCH_OFFSET if mismatch else 0),
                                       **({"staged": True} if staged else {})})
                if staged:  # update_weights returned at once; staged, the live params are N
                    engine.state.require_stager().wait(cfg.timeout_s)
                    out.setdefault("changed_before_flip", []).append(
                        [n for n, p in model.named_parameters() if tensor_digest(p) != before[n]])
                api.finish_weight_update()
            except WeightVersionMismatch as exc:
                if not mismatch:
                    raise
                out["mismatch"] = {"error": str(exc), "weights": exc.weights}
            out["versions"].append(engine.refit_weights_state()["version"])
            out.setdefault("reports", []).append(  # the report keys of delta refits
                {k: engine.report().get(k) for k in ("mode", "full_bytes", "bytes_received",
                                                     "full_reason", "written_outside")})
            full = torch.load(io.BytesIO(control.get(f"full/{step}")), weights_only=True)
            fp8 = "quantization_config" in hf_config  # vLLM loads the block-FP8 checkpoint
            del oracle
            oracle = vm.loaded_model(new_config(), vm.fp8_checkpoint(full) if fp8 else full)
            out["differences"].append([n for n in vm.bitwise_differences(model, oracle)
                                       if not (fp8 and n.endswith(vm.KV_CACHE_SCALES))])
            # a long run says how far it got (every progress_s, on generation rank 0)
            if progress_s is not None and gen_rank == 0 and (
                    time.monotonic() - said_at >= progress_s or version == cfg.refits):
                said_at = time.monotonic()
                bad = sum(1 for d in out["differences"] if d)
                line = (f"[gen 0] refit {version}/{cfg.refits} committed; {bad} of {version} "
                        f"differed from vLLM's load_weights")
                out["progress"].append(line)
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        if fail_extra:
            api.start_weight_update()
            try:
                api.update_weights({"version": cfg.refits + 1,
                                    **({"staged": True} if staged else {})})
                if staged:  # the failure comes out of the flip
                    api.finish_weight_update()
            except WeightUpdateError as exc:
                bad = vm.bitwise_differences(model, oracle)  # against the last good refit
                # vLLM's worker keeps its session open after a failed finish (not after a
                # failed update_weights): the same call again must close it
                open_after = getattr(worker, "_weight_update_active", None)
                with _warnings_of(engine) as warned:
                    finish = _error_of(api.finish_weight_update)
                out["failed"] = {"error": str(exc), "cause": repr(exc.__cause__),
                                 "weights": exc.weights, "differ_from_last_good": bad,
                                 "finish_error": finish, "open_after_failure": open_after,
                                 "retry_warnings": warned}
            if worker is not None:
                out["retry"] = _restart_through_worker(worker, engine, init_info, retry_ports,
                                                       cfg.refits + 1)
                full = torch.load(io.BytesIO(control.get(f"full/{cfg.refits}")),
                                  weights_only=True)
                del oracle
                oracle = vm.loaded_model(new_config(), full)
                out["retry"]["differences"] = vm.bitwise_differences(model, oracle)
        out["weights"] = engine.refit_weights_state()
        engine.shutdown()
    return out


# ---- vLLM's API on both sides (driver "trainer") ----------------------------------------

# a weight-sync call waits for the other side's whole turn (a refit, a model build, a gather)
_RPC_TIMEOUT_FACTOR = 8


class StoreWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (plus ``shutdown_weight_transfer_engine``, as
    vLLM's HTTP and Ray clients have) over the launch's store: each call is posted once and
    every generation rank answers; the call returns when all did and raises with every
    worker's error, as a ``collective_rpc`` of vLLM's engine core would."""

    def __init__(self, host: str, port: int, gen_world: int, timeout_s: float):
        self.store = dist.TCPStore(host, port, None, False, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s * _RPC_TIMEOUT_FACTOR))
        self.gen_world = gen_world

    def _call(self, method: str, *args: Any) -> None:
        call = int(self.store.add("rpc/count", 1))  # one sequence for every client of a launch
        self.store.set(f"rpc/{call}", pickle.dumps((method, args)))
        errors = [f"gen rank {g}: {err}" for g in range(self.gen_world)
                  if (err := pickle.loads(self.store.get(f"rpc/{call}/{g}"))) is not None]
        if errors:
            raise RuntimeError(f"{method} failed on {len(errors)} of {self.gen_world} workers: "
                               + "; ".join(errors))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def stop(self) -> None:
        """The end of the launch (what stopping the ``LLM`` would be): the workers return."""
        self._call("stop")


def _trainer_init(cfg: RefitRunConfig, source, rank: int, ports, **options):
    """The trainer engine from vLLM's trainer factory, its groups meeting at ``ports``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo

    info = MegatronReshardTrainerInitInfo(
        host=cfg.host, ports_by_stage=list(ports), group_backend=cfg.backend,
        transport=cfg.transport, timeout_s=cfg.timeout_s, num_streams=cfg.num_streams,
        staging_bytes=cfg.staging_bytes, verify_checksums=cfg.verify, rank=rank, **options)
    client = StoreWeightSyncClient(cfg.host, cfg.ports[0], cfg.gen_world, cfg.timeout_s)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _trainer_engine(cfg: RefitRunConfig, **options):
    """``run_training_rank``'s ``trainer_engine`` (``options``: the init info's others)."""
    return lambda source, rank: _trainer_init(cfg, source, rank, cfg.ports[1:1 + cfg.train_pp],
                                              **options)


REFUSED = {"num_streams": 0}  # the workers refuse it in prepare_refit, after joining the groups


def _fail_refuse_restart(spare_ports):
    """Training side through vLLM's API, after the good refits: the planted failure
    (``_failing_refit``) and ``shutdown``; a ``trainer_init`` the workers refuse (every
    training rank must raise); a restarted trainer on fresh groups whose
    ``send_weights(version=...)`` brings the weights back (compared with vLLM's loading as
    refit ``cfg.refits``)."""

    def after_refits(ctx: dict) -> dict:
        cfg, pp = ctx["cfg"], ctx["cfg"].train_pp
        out = _failing_refit(ctx)
        ctx["engine"].shutdown()
        try:
            _trainer_init(cfg, ctx["source"], ctx["rank"], spare_ports[:pp],
                          worker_options=REFUSED)
            out["refused"] = None
        except Exception as exc:  # noqa: BLE001 - the refusal is the subject
            out["refused"] = f"{type(exc).__name__}: {exc}"
        # the restarted trainer keeps a delta base (init info's delta= reaches RefitSender)
        engine = _trainer_init(cfg, ctx["source"], ctx["rank"], spare_ports[pp:2 * pp],
                               delta=True)
        engine.send_weights(version=cfg.refits + 2)
        out["restarted"] = engine.last_refit
        publish_full_hf({**ctx, "step": cfg.refits})
        engine.shutdown()
        return out

    return after_refits


class _ModelRunner:
    """What vLLM's ``Worker`` weight-sync methods ask of its model runner."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model

    def get_draft_model(self) -> None:
        return None

    def reset_lora_state(self) -> None:
        pass


def _vllm_worker(config, gen_rank: int, engine, model):
    """vLLM's GPU ``Worker`` without its ``__init__`` (which claims a device and builds the
    model runner): the fields its weight-sync methods read, set as ``__init__`` and
    ``init_device`` set them."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)
    worker.vllm_config = config
    worker.rank = gen_rank
    worker.weight_transfer_engine = engine
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    # vLLM 0.34: the targets a started update may leave incomplete, and the KV-cache loan
    # its start enters (none here: the stand-in model runner has no extensible KV cache)
    worker._incomplete_weight_updates = set()
    worker._kv_cache_reclaimable = False
    worker._weight_update_kv_cache_loan = contextlib.ExitStack()
    worker.model_runner = _ModelRunner(model)
    return worker


def _served_gen_rank(gen_rank: int, cfg: RefitRunConfig, control, hf_config: Mapping[str, Any],
                     vllm_port: int) -> dict:
    """A generation rank serving the client's calls with vLLM's worker methods until
    ``stop``; after each finished update its model is compared with vLLM's own loading of
    that step's weights."""
    from megatron_reshard.testing import vllm_models as vm
    from megatron_reshard.vllm_api.backend import WeightUpdateError

    model_dir = vm.write_model_dir(hf_config)
    new_config = lambda: vm.vllm_config_for(model_dir, cfg.gen_tp, ep=cfg.gen_ep > 1)  # noqa: E731
    config = new_config()
    out: dict[str, Any] = {"role": "gen", "rank": gen_rank, "differences": [], "versions": [],
                           "asked_versions": [], "labels": [], "calls": [], "failed": None,
                           "payload_type": None, "errors": [], "after_shutdown": [],
                           "closed_after_failure": []}
    wait = timedelta(seconds=cfg.timeout_s * _RPC_TIMEOUT_FACTOR)
    oracle = None
    with vm.vllm_parallel_state(config, gen_rank, cfg.gen_world, vllm_port):
        model = vm.dummy_loaded_model(config)
        engine = _engine_for(config, model)
        out["engine"] = type(engine).__name__
        worker = _vllm_worker(config, gen_rank, engine, model)
        call, finish_failed = 0, False
        while True:
            call += 1
            control.wait([f"rpc/{call}"], wait)
            method, args = pickle.loads(control.get(f"rpc/{call}"))
            out["calls"].append(method)
            error = None
            # the same finish again after a failed one: it closes vLLM's update, no refit
            closing = method == "finish_weight_update" and finish_failed
            try:
                if method == "init_weight_transfer_engine":
                    out["payload_type"] = type(args[0]["payload"]).__name__
                    worker.init_weight_transfer_engine(args[0])
                elif method == "update_weights":
                    out["asked_versions"].append(args[0].get("version"))
                    worker.update_weights(args[0])
                    # "idle" unless the update is staged (still receiving, or staged)
                    out.setdefault("phase_after_update", []).append(
                        engine.refit_weights_state().get("staged", {}).get("phase"))
                elif method == "finish_weight_update" and closing:
                    worker.finish_weight_update()
                    out["closed_after_failure"].append([args[0], engine.refit_weights_state()])
                elif method == "finish_weight_update":
                    worker.finish_weight_update()
                    out["labels"].append(args[0])  # the LLM's weight version (Ray client)
                elif method == "shutdown_weight_transfer_engine":
                    worker.shutdown_weight_transfer_engine()
                    out["after_shutdown"].append(engine.refit_weights_state())
                elif method != "stop":
                    getattr(worker, method)(*args)
            except WeightUpdateError as exc:
                error = f"{type(exc).__name__}: {exc}"
                out["failed"] = {"error": str(exc), "cause": repr(exc.__cause__),
                                 "weights": exc.weights,
                                 "differ_from_last_good": None if oracle is None
                                 else vm.bitwise_differences(model, oracle)}
            except Exception as exc:  # noqa: BLE001 - the client raises it on training rank 0
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                out["errors"].append([method, error])
            control.set(f"rpc/{call}/{gen_rank}", pickle.dumps(error))
            if method == "stop":
                break
            if method == "finish_weight_update":
                finish_failed = error is not None
            if method == "finish_weight_update" and error is None and not closing:
                step = len(out["labels"]) - 1
                out["versions"].append(engine.refit_weights_state()["version"])
                full = torch.load(io.BytesIO(control.get(f"full/{step}")), weights_only=True)
                del oracle
                oracle = vm.loaded_model(new_config(), full)
                out["differences"].append(vm.bitwise_differences(model, oracle))
        out["weights"] = engine.refit_weights_state()
    return out


def backend_refit_job(job, cfg: RefitRunConfig, hf_config: Mapping[str, Any],
                      mismatch_rank: Optional[int] = None, fail_extra: bool = False,
                      driver: str = "worker", moe_backend: Optional[str] = None,
                      progress_s: Optional[float] = None, quantization: Optional[str] = None,
                      staged: bool = False,
                      write_outside_on: Optional[tuple[int, int, str]] = None,
                      retry: bool = False) -> dict:
    """Pool job (``WorkerPool.run(..., num_ports=cfg.train_pp + 2)``, ``3 * train_pp + 2`` for
    driver "trainer" with ``fail_extra``, ``2 * train_pp + 2`` with ``retry``): process
    ``job.rank`` of a launch of ``train_world + gen_world``; port ``1 + train_pp`` is vLLM's
    generation world, the ones after it the restarted trainers' groups.
    ``driver``: "worker" (each generation rank drives its engine) or "trainer" (vLLM's
    trainer API on the training side, the client's calls on the generation side).
    ``moe_backend``: vLLM's ``--moe-backend`` of the generation model (driver "worker");
    ``progress_s``: generation rank 0 prints a progress line at most that often (and after
    the last refit); None: silent. ``quantization``: vLLM's ``--quantization`` of the
    generation model (driver "worker"; ``"fp8_per_block"``: quantized online from BF16).
    ``staged``: staged refits (``update_weights({"staged": True})``, then
    ``finish_weight_update`` flips; driver "trainer": the init info's ``staged=True``); ``changed_before_flip`` lists, per refit, the live params
    that changed before the flip (none may). ``write_outside_on``: (gen rank, refit index,
    vLLM param name), driver "worker": before that refit, that gen rank writes two elements
    of the param outside the refits. ``retry`` (driver "worker", ``fail_extra``): vLLM's
    ``Worker`` methods drive the engine; after the failed update the same finish again, then
    a restarted trainer (``_fail_then_restart``; ``retry`` in each generation rank's result)."""
    if driver not in ("worker", "trainer") or (driver == "trainer" and mismatch_rank is not None):
        raise ValueError(f"backend_refit_job: driver must be 'worker' or 'trainer' (the trainer "
                         f"sends the version it commits: no mismatch_rank), found {driver!r}, "
                         f"mismatch_rank={mismatch_rank!r}")
    spare = job.ports[2 + cfg.train_pp:]
    if retry and (driver != "worker" or not fail_extra or len(spare) < cfg.train_pp):
        raise ValueError(f"backend_refit_job: retry needs driver 'worker', fail_extra and "
                         f"num_ports 2 * train_pp + 2 = {2 * cfg.train_pp + 2}; found driver "
                         f"{driver!r}, fail_extra={fail_extra!r}, {len(job.ports)} ports")
    t0 = time.perf_counter()
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": tuple(job.ports[: 1 + cfg.train_pp])})
    control = dist.TCPStore(cfg.host, cfg.ports[0], cfg.train_world + cfg.gen_world, job.rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if job.rank < cfg.train_world:
        if fail_extra and driver == "trainer" and len(spare) < 2 * cfg.train_pp:
            raise ValueError(f"backend_refit_job: driver 'trainer' with fail_extra restarts the "
                             f"trainer twice: num_ports must be 3 * train_pp + 2 = "
                             f"{3 * cfg.train_pp + 2}, found {len(job.ports)}")
        after_refits = ((_fail_refuse_restart(spare) if driver == "trainer" else
                         _fail_then_restart(spare) if retry else _failing_refit)
                        if fail_extra else None)
        out = run_training_rank(job.rank, cfg, control, torch.device("cpu"),
                                after_each_refit=publish_full_hf, after_refits=after_refits,
                                trainer_engine=_trainer_engine(
                                    cfg, **({"staged": True} if staged else {}))
                                if driver == "trainer" else None)
        out["driver"] = driver
        if driver == "trainer" and job.rank == 0:
            StoreWeightSyncClient(cfg.host, cfg.ports[0], cfg.gen_world, cfg.timeout_s).stop()
    elif driver == "trainer":
        out = _served_gen_rank(job.rank - cfg.train_world, cfg, control, hf_config,
                               job.ports[1 + cfg.train_pp])
    else:
        out = _gen_rank(job.rank - cfg.train_world, cfg, control, hf_config,
                        job.ports[1 + cfg.train_pp], mismatch_rank, fail_extra, moe_backend,
                        progress_s, quantization, staged,
                        write_outside=write_outside_on[1:] if write_outside_on and
                        write_outside_on[0] == job.rank - cfg.train_world else None,
                        retry_ports=spare[:cfg.train_pp] if retry else None)
    out["s"] = time.perf_counter() - t0
    return out


__all__ = ["MISMATCH_OFFSET", "PLANTED", "REFUSED", "StoreWeightSyncClient", "backend_refit_job"]
