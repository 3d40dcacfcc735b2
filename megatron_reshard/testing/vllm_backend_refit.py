"""Refits through the ``megatron_reshard`` vLLM weight-transfer backend into vLLM's own models.

One pool job (``backend_refit_job``) plays a whole launch, as ``testing.vllm_refit`` does:
ranks below ``cfg.train_world`` are Megatron training ranks (``tools.e2e.run_training_rank``,
the real ``RefitSender``), the others generation ranks holding vLLM's own model class under
vLLM's own parallel state (``testing.vllm_models``). Each generation rank builds the engine
with vLLM's ``WeightTransferEngineFactory.create_engine`` from
``WeightTransferConfig(backend="megatron_reshard")`` and drives it exactly as vLLM's GPU
worker does (``parse_init_info`` + ``init_transfer_engine``, ``start_weight_update``,
``update_weights(dict)``, ``finish_weight_update()``, ``shutdown``). After each refit the
oracle is a second vLLM instance loaded by vLLM's ``load_weights`` from the full HF tensors.

Options: ``mismatch_rank`` (a gen rank that asks for a wrong ``version`` in the last refit:
the refit commits, the engine must raise ``WeightVersionMismatch``); ``fail_extra`` (one
more refit in which training rank 0 raises part-way: every rank fails, and each generation
rank reports its weight state, checked against the last good oracle).
"""

from __future__ import annotations

import io
import sys
import time
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_reshard.testing.vllm_refit import publish_full_hf
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
        sender.refit()
    except Exception as exc:  # noqa: BLE001 - the failure is the subject
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if ctx["rank"] == 0:
            spec.pre = inner
    return {"error": None}


def _engine_for(config, model):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_reshard.vllm_plugin import register

    register()  # what vLLM's load_general_plugins does with the installed entry point
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="megatron_reshard"), config, torch.device("cpu"), model)


def _gen_rank(gen_rank: int, cfg: RefitRunConfig, control, hf_config: Mapping[str, Any],
              vllm_port: int, mismatch_rank: Optional[int], fail_extra: bool,
              progress_s: Optional[float] = None) -> dict:
    from megatron_reshard.megatron.payload import decode_payload
    from megatron_reshard.testing import vllm_models as vm
    from megatron_reshard.vllm_backend import WeightUpdateError, WeightVersionMismatch

    payload = decode_payload(control.get("payload"))
    model_dir = vm.write_model_dir(hf_config)
    new_config = lambda: vm.vllm_config_for(model_dir, cfg.gen_tp, ep=cfg.gen_ep > 1)  # noqa: E731
    config = new_config()
    out: dict[str, Any] = {"role": "gen", "rank": gen_rank, "differences": [], "versions": [],
                           "mismatch": None, "failed": None, "progress": []}
    said_at = time.monotonic()
    with vm.vllm_parallel_state(config, gen_rank, cfg.gen_world, vllm_port):
        model = vm.dummy_loaded_model(config)
        engine = _engine_for(config, model)
        out["engine"] = type(engine).__name__
        init_info = {"host": cfg.host, "ports_by_stage": list(cfg.ports[1:1 + cfg.train_pp]),
                     "group_sizes": cfg.stage_world + cfg.gen_world, "payload": payload,
                     "group_rank": None, "backend": cfg.backend, "timeout_s": cfg.timeout_s,
                     "prepare_options": {"verify_checksums": cfg.verify}}
        engine.init_transfer_engine(engine.parse_init_info(init_info))  # as vLLM's worker
        oracle = None
        for step in range(cfg.refits):
            version = step + 1
            mismatch = mismatch_rank == gen_rank and step == cfg.refits - 1
            engine.start_weight_update()
            try:
                engine.update_weights({"version": version + (MISMATCH_OFFSET if mismatch else 0)})
                engine.finish_weight_update()
            except WeightVersionMismatch as exc:
                if not mismatch:
                    raise
                out["mismatch"] = {"error": str(exc), "weights": exc.weights}
            out["versions"].append(engine.refit_weights_state()["version"])
            full = torch.load(io.BytesIO(control.get(f"full/{step}")), weights_only=True)
            del oracle
            oracle = vm.loaded_model(new_config(), full)
            out["differences"].append(vm.bitwise_differences(model, oracle))
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
            engine.start_weight_update()
            try:
                engine.update_weights({"version": cfg.refits + 1})
            except WeightUpdateError as exc:
                bad = vm.bitwise_differences(model, oracle)  # against the last good refit
                try:
                    engine.finish_weight_update()
                    finish = None
                except WeightUpdateError as fexc:
                    finish = str(fexc)
                out["failed"] = {"error": str(exc), "cause": repr(exc.__cause__),
                                 "weights": exc.weights, "differ_from_last_good": bad,
                                 "finish_error": finish}
        out["weights"] = engine.refit_weights_state()
        engine.shutdown()
    return out


def backend_refit_job(job, cfg: RefitRunConfig, hf_config: Mapping[str, Any],
                      mismatch_rank: Optional[int] = None, fail_extra: bool = False,
                      progress_s: Optional[float] = None) -> dict:
    """Pool job (``WorkerPool.run(..., num_ports=cfg.train_pp + 2)``): process ``job.rank`` of
    a launch of ``train_world + gen_world``; the last port is vLLM's generation world.
    ``progress_s``: generation rank 0 prints a progress line at most that often (and after
    the last refit); None: silent."""
    t0 = time.perf_counter()
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": tuple(job.ports[: 1 + cfg.train_pp])})
    control = dist.TCPStore(cfg.host, cfg.ports[0], cfg.train_world + cfg.gen_world, job.rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if job.rank < cfg.train_world:
        out = run_training_rank(job.rank, cfg, control, torch.device("cpu"),
                                after_each_refit=publish_full_hf,
                                after_refits=_failing_refit if fail_extra else None)
    else:
        out = _gen_rank(job.rank - cfg.train_world, cfg, control, hf_config,
                        job.ports[1 + cfg.train_pp], mismatch_rank, fail_extra, progress_s)
    out["s"] = time.perf_counter() - t0
    return out


__all__ = ["MISMATCH_OFFSET", "PLANTED", "backend_refit_job"]
