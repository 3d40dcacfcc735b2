"""One refit end to end: a Megatron training world and a generation world, joined by refit groups.

Shared by ``megatron-reshard demo`` (CPU, gloo, spawned workers) and the torchrun launchers
(``scripts/refit_torchrun.py``, NCCL, one process per GPU). Process ``rank`` of a launch of
``train_world + gen_world`` processes plays training rank ``rank`` if ``rank < train_world``,
else generation rank ``rank - train_world``. The two sides get separate default worlds
(each built from an explicit store, as two launchers would), and one refit group per
training PP stage is built from its own ``TCPStore`` (``groups.create_refit_group``). What a
run is (presets, ``RefitRunConfig``, its validation and options) lives in ``run_config``.

Verification is independent of the refit path: the training ranks gather the full HF
tensors with the reference oracle (``megatron.reference``), training rank 0 slices the
expected vLLM shard of every generation parameter (``testing.vllm_like.expected_vllm_shard``)
and publishes its SHA-256; each generation rank compares the digests of its live storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_reshard.engine.refit_transport import transport_of
from megatron_reshard.receiver import MegatronReshardWorkerExtension
from megatron_reshard.wire.records import RefitPayload
from megatron_reshard.tools.run_config import RefitRunConfig, model_preset


def _say(cfg: RefitRunConfig, who: str, msg: str) -> None:
    if not cfg.quiet:
        # one write with its newline: print's two writes let another rank's line in between
        sys.stderr.write(f"[{who}] {msg}\n")
        sys.stderr.flush()


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (shape and dtype included): equal digests ⇔ equal bits."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{tuple(t.shape)}|{t.dtype}|".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def _device_for(cfg: RefitRunConfig, rank: int) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"rank {rank}: device 'cuda' asked for, but this machine has no "
                               f"CUDA device; run with --device cpu --backend gloo")
        index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_world(cfg: RefitRunConfig, control: dist.Store, name: str, rank: int, size: int,
                device: torch.device) -> None:
    kwargs = dict(store=dist.PrefixStore(f"world/{name}", control), rank=rank, world_size=size,
                  timeout=timedelta(seconds=cfg.timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(cfg.backend, **kwargs)


@torch.no_grad()
def perturb_(model: torch.nn.Module, step: int) -> None:
    """A deterministic weight change between refits, identical on every replica."""
    for p in model.parameters():
        p.mul_(-1.5).add_(0.125 * step)


def run_rank(rank: int, cfg: RefitRunConfig, *, model_builder=None, after_refits=None) -> dict:
    """Play process ``rank`` of the launch; returns a plain-data summary of this rank.

    Optional hooks (keyword-only; the benchmark uses them, the demo does not):
    ``model_builder(spec, device, dtype) -> model`` replaces ``build_gpt_model(spec).to(...)``
    on the training ranks (it must give replicas equal values); ``after_refits(ctx) -> dict``
    runs on every rank after the refit loop, with ``ctx`` holding ``role``, ``rank``,
    ``cfg``, ``device``, ``group`` (the refit group of stage 0 for generation ranks, of
    the rank's stage for training ranks), ``control`` (the store), ``model`` and ``sender``
    (train) or ``worker`` (gen); its result is stored under the key ``"bench"``.
    """
    problems = cfg.problems()
    if problems:
        raise ValueError("invalid refit run configuration:\n  - " + "\n  - ".join(problems))
    device = _device_for(cfg, rank)
    control = dist.TCPStore(cfg.host, cfg.ports[0], cfg.train_world + cfg.gen_world, rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if rank < cfg.train_world:
        return run_training_rank(rank, cfg, control, device, model_builder, after_refits)
    return _gen_rank(rank - cfg.train_world, cfg, control, device, after_refits)


def run_training_rank(rank: int, cfg: RefitRunConfig, control, device: torch.device,
                      model_builder=None, after_refits=None, after_each_refit=None,
                      trainer_engine=None) -> dict:
    """Training rank ``rank``: join the training world through ``control`` (a store), build
    the model, publish the payload (rank 0, key ``payload``), refit ``cfg.refits`` times and,
    with ``cfg.verify``, publish each refit's expected digests (``expected/{step}/{gen}``).
    ``after_each_refit(ctx)`` runs on every training rank after each refit (``ctx``: ``step``,
    ``rank``, ``model``, ``family``, ``spec``, ``control``); the real-vLLM tests publish the
    full HF tensors with it. ``trainer_engine(source, rank)``: a vLLM trainer engine
    (``vllm_api.trainer``) that owns the refit group and the sender; each refit is then its
    ``send_weights()`` and the end its ``shutdown()``."""
    # megatron-core's notices about optional packages (Apex, TE) and CPU-only settings
    # would repeat once per process and bury the run's own progress lines
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron.core import parallel_state as ps

    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict

    who = f"train {rank}"
    t0 = time.perf_counter()
    _init_world(cfg, control, "train", rank, cfg.train_world, device)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.train_tp,
                                 pipeline_model_parallel_size=cfg.train_pp,
                                 expert_model_parallel_size=cfg.train_ep,
                                 expert_tensor_parallel_size=cfg.train_etp,
                                 distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)))
    preset = model_preset(cfg)
    family = preset.pop("family")
    spec = TinyGPTSpec(dtype=cfg.dtype, **preset)
    # All params in the training dtype, as Float16Module leaves them (the local layer spec
    # keeps norms in fp32 otherwise; vLLM holds them in the model dtype).
    if model_builder is not None:
        model = model_builder(spec, device, getattr(torch, cfg.dtype))
    else:
        model = build_gpt_model(spec).to(device=device, dtype=getattr(torch, cfg.dtype))
    keep_expert_bias_fp32_(model)
    if cfg.train_precision == "fp8_blockwise":
        from megatron_reshard.testing.fp8_training import attach_blockwise_fp8_

        attach_blockwise_fp8_(model)
    if rank == 0:
        _say(cfg, who, f"training world up: tp{cfg.train_tp} pp{cfg.train_pp} ep{cfg.train_ep} "
                       f"on {cfg.train_world} ranks; model built ({cfg.model}, "
                       f"{sum(p.numel() for p in model.parameters())} params on rank 0)")
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": cfg.gen_tp, "ep_size": cfg.gen_ep,
                                                         "pp_size": 1},
                                 gen_world_size=cfg.gen_world, family=family,
                                 vocab_size=spec.vocab_size, packed_params=cfg.packed_params,
                                 gen_quant=cfg.gen_quant)
    if rank == 0:
        payload = source.payload_bytes()
        control.set("payload", payload)
        bulk = sum(1 for _ in source.wire.params())
        packed = len(source.wire.other_params or ())
        _say(cfg, who, f"payload {len(payload)} bytes published: {bulk + packed} refit tensors "
                       f"({bulk} on the exact path, {packed} packed; experts go as one tensor "
                       f"per projection)")
    engine = trainer_engine(source, rank) if trainer_engine is not None else None
    if engine is not None:
        group, sender = engine.group, engine.sender
    else:
        group = create_refit_group(cfg.host, cfg.ports[1 + source.stage], source.stage_local_rank,
                                   cfg.stage_world + cfg.gen_world, cfg.backend, cfg.timeout_s,
                                   device=device if device.type == "cuda" else None,
                                   who=f"train rank {rank} (PP stage {source.stage})",
                                   label=f"refit group of PP stage {source.stage}",
                                   transport=cfg.transport)
        sender = RefitSender(source, group, device=device, num_streams=cfg.num_streams,
                             staging_bytes=cfg.staging_bytes, verify_checksums=cfg.verify,
                             delta=cfg.delta)
    setup_s = time.perf_counter() - t0
    refits = []
    for step in range(cfg.refits):
        if step and cfg.move is not None:  # an RL loop's offload / onload between refits
            from megatron_reshard.testing.moves import move_params_

            move_params_(model, cfg.move, rank)
        if step and cfg.update == "adam":
            from megatron_reshard.testing.optimizer_steps import adam_step_

            adam_step_(model, step)
        elif step:
            perturb_(model, step)
        if step and cfg.train_precision == "fp8_blockwise":  # an optimizer step re-quantizes
            attach_blockwise_fp8_(model)
        if engine is not None:
            engine.send_weights()
            stats = engine.last_refit
        else:
            stats = sender.refit()
        refits.append(stats)
        if cfg.verify:
            full = gather_full_hf_state_dict(model, family=family, vocab_size=spec.vocab_size)
            if rank == 0:
                _publish_expected(cfg, control, source.hf_config, full, step)
        if after_each_refit is not None:
            after_each_refit({"step": step, "rank": rank, "model": model, "family": family,
                              "spec": spec, "control": control})
        if rank == 0:
            _say(cfg, who, f"refit {step + 1}/{cfg.refits} sent in {stats['refit_s'] * 1e3:.1f} ms")
    out = {"role": "train", "rank": rank, "setup_s": setup_s, "refits": refits,
           "transport": transport_of(group).name}
    if after_refits is not None:
        out["bench"] = after_refits({"role": "train", "rank": rank, "cfg": cfg, "device": device,
                                     "group": group, "control": control, "model": model,
                                     "sender": sender, "source": source, "engine": engine,
                                     "family": family, "spec": spec})
    if engine is not None:
        engine.shutdown()
    else:
        destroy_refit_group(group, cfg.timeout_s)
    return out


def _publish_expected(cfg: RefitRunConfig, control, hf_config: dict, full: dict, step: int) -> None:
    from megatron_reshard.testing.fp8_reference import expected_vllm_fp8_params, quantize_full_hf
    from megatron_reshard.testing.vllm_like import expected_vllm_shard, vllm_param_shapes

    # where the sender quantized: torch divides by a scalar differently on CUDA (fp8_reference)
    device_type = next((v.device.type for v in full.values()), "cpu")
    full = {k: v.to("cpu") for k, v in full.items()}
    pow2 = cfg.train_precision == "fp8_blockwise"
    quantized = quantize_full_hf(full, cfg.gen_storage, pow2, device_type) if cfg.gen_quant else None
    for g in range(cfg.gen_world):
        tp_rank = g % cfg.gen_tp
        if cfg.gen_quant:  # the independent quantizer on the full HF tensors, then sliced
            expected = expected_vllm_fp8_params(hf_config, full, tp_rank, cfg.gen_tp, cfg.gen_ep,
                                                pow2=pow2, fmt=cfg.gen_storage, quantized=quantized)
            control.set(f"expected/{step}/{g}",
                        json.dumps({n: tensor_digest(t) for n, t in expected.items()}))
            continue
        names = vllm_param_shapes(hf_config, tp_rank, cfg.gen_tp, cfg.gen_ep)
        digests = {n: tensor_digest(expected_vllm_shard(hf_config, n, full, tp_rank, cfg.gen_tp,
                                                        cfg.gen_ep)) for n in names}
        control.set(f"expected/{step}/{g}", json.dumps(digests))


class ModuleWorker(MegatronReshardWorkerExtension):
    """The vLLM worker extension, with the model given directly instead of by vLLM."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def get_refit_model(self) -> torch.nn.Module:
        return self._model


def _gen_rank(gen_rank: int, cfg: RefitRunConfig, control, device: torch.device,
              after_refits=None) -> dict:
    from megatron_reshard.wire.codec import decode_payload  # msgspec: the launcher decodes
    from megatron_reshard.testing.vllm_like import build_vllm_like_model

    who = f"gen {gen_rank}"
    t0 = time.perf_counter()
    _init_world(cfg, control, "gen", gen_rank, cfg.gen_world, device)
    payload = decode_payload(control.get("payload"))
    tp_rank = gen_rank % cfg.gen_tp
    model = build_vllm_like_model(RefitPayload.of(payload).hf_config, tp_rank, cfg.gen_tp, cfg.gen_ep,
                                  getattr(torch, cfg.dtype), device=device, quant=cfg.gen_storage)
    worker = ModuleWorker(model)
    # group_rank=None: each worker derives it from its rank in the generation world, as
    # vLLM workers do when collective_rpc sends every worker the same arguments
    worker.init_refit_groups(cfg.host, list(cfg.ports[1:1 + cfg.train_pp]), None,
                             cfg.stage_world + cfg.gen_world, cfg.backend, cfg.timeout_s)
    summary = worker.prepare_refit(payload, {"num_streams": cfg.num_streams,
                                             "staging_bytes": cfg.staging_bytes,
                                             "verify_checksums": cfg.verify})
    setup_s = time.perf_counter() - t0
    if gen_rank == 0:
        _say(cfg, who, f"generation world up: tp{cfg.gen_tp} ep{cfg.gen_ep} on {cfg.gen_world} "
                       f"ranks; the refit tensors mapped onto {len(list(model.parameters()))} "
                       f"vLLM-layout model params")
    refits, mismatches = [], []
    for step in range(cfg.refits):
        stats = worker.refit()
        refits.append(stats)
        if cfg.verify:
            expected = json.loads(control.get(f"expected/{step}/{gen_rank}"))
            actual = {n: tensor_digest(p) for n, p in model.named_parameters()}
            bad = sorted(n for n in set(expected) | set(actual) if expected.get(n) != actual.get(n))
            mismatches.append(bad)
            if gen_rank == 0:
                verdict = "bit-exact" if not bad else f"{len(bad)} params differ"
                _say(cfg, who, f"refit {step + 1}/{cfg.refits} received in "
                               f"{stats['refit_s'] * 1e3:.1f} ms, committed as version "
                               f"{stats['version']} (checksums matched): {verdict}")
    # what the same weights take in the training dtype (block scales excluded): the bytes a
    # BF16 refit lands in this rank's storage, to compare an FP8 refit against
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    unquantized = sum(p.numel() * itemsize for n, p in model.named_parameters()
                      if not n.endswith(("_scale_inv", "_scale")))
    out = {"role": "gen", "rank": gen_rank, "setup_s": setup_s, "refits": refits,
           "unquantized_bytes": unquantized, "mismatches": mismatches,
           "report": worker.report(), "summary": summary,
           "verified": cfg.verify and not any(mismatches)}
    if after_refits is not None:
        groups = worker.refit_worker_state.groups
        out["bench"] = after_refits({"role": "gen", "rank": gen_rank, "cfg": cfg, "device": device,
                                     "group": groups[min(groups)], "control": control,
                                     "model": model, "worker": worker})
    worker.destroy_refit_groups(cfg.timeout_s)
    return out


def share_verdict(store, rank: int, world: int, verdict: Optional[str] = None) -> str:
    """Rank 0 publishes ``verdict`` in ``store`` (which it hosts); every rank returns it.

    Rank 0 waits until every rank has read it, so its store outlives the readers.
    """
    if rank == 0:
        store.set("verdict", verdict or "fail")
    value = store.get("verdict").decode()
    store.add("verdict_read", 1)
    if rank == 0:
        deadline = time.monotonic() + 60
        while int(store.add("verdict_read", 0)) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    return value


def summarize(cfg: RefitRunConfig, results: list[dict]) -> dict:
    """One plain-data summary of a run from every rank's result."""
    gens = [r for r in results if r["role"] == "gen"]
    per_gen = []
    for r in gens:
        last = r["refits"][-1] if r["refits"] else {}
        bulk, misc = last.get("bulk_bytes", 0), last.get("misc_bytes", 0)
        per_gen.append({"gen_rank": r["rank"], "params": r["report"]["params"] + r["report"]["misc_params"],
                        "bulk_params": r["report"]["params"], "other_params": r["report"]["misc_params"],
                        "bytes": bulk + misc, "bulk_bytes": bulk, "misc_bytes": misc,
                        "misc_wire_bytes": last.get("misc_wire_bytes", 0),
                        "unquantized_bytes": r.get("unquantized_bytes", bulk + misc),
                        "mismatched": sorted({n for bad in r["mismatches"] for n in bad})})
    total = sum(g["bytes"] for g in per_gen)
    refit_s = [max(r["refits"][i]["refit_s"] for r in results) for i in range(cfg.refits)]
    # per refit, what the training ranks agreed (full or delta, and why full) and the bytes
    # that really reached each generation rank
    trains = [r for r in results if r["role"] == "train"]
    modes = [sorted({r["refits"][i].get("mode", "full") for r in results})
             for i in range(cfg.refits)]
    received = {str(r["rank"]): [s.get("bytes_received") for s in r["refits"]] for r in gens}
    return {
        "verified": bool(cfg.verify) and all(r["verified"] for r in gens),
        "refits": cfg.refits,
        "params": max((g["params"] for g in per_gen), default=0),
        "bytes_per_gen_rank": {str(g["gen_rank"]): g["bytes"] for g in per_gen},
        "exact_path_fraction": (sum(g["bulk_bytes"] for g in per_gen) / total) if total else 0.0,
        "setup_s": max(r["setup_s"] for r in results),
        "refit_s": refit_s,
        "per_gen_rank": per_gen,
        "gen_precision": cfg.gen_precision,
        "modes": ["/".join(m) for m in modes],
        "full_reasons": [trains[0]["refits"][i].get("full_reason") if trains else None
                         for i in range(cfg.refits)],
        "bytes_received": received,
        # bytes received over what the same refit in the training dtype would land
        "bytes_vs_unquantized": (total / sum(g["unquantized_bytes"] for g in per_gen)) if total else 0.0,
        "layout": {"model": cfg.model, "train": {"world": cfg.train_world, "tp": cfg.train_tp,
                                                  "pp": cfg.train_pp, "ep": cfg.train_ep},
                   "gen": {"world": cfg.gen_world, "tp": cfg.gen_tp, "ep": cfg.gen_ep},
                   "backend": cfg.backend, "device": cfg.device, "dtype": cfg.dtype},
    }


def keep_expert_bias_fp32_(model: torch.nn.Module) -> None:
    """The router's score-correction bias stays float32 under a low-precision model, as
    Megatron's router keeps it (``_maintain_float32_expert_bias``) and vLLM holds it."""
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            buf.data = buf.data.float()


__all__ = ["ModuleWorker", "run_rank", "run_training_rank", "summarize", "share_verdict", "tensor_digest",
           "perturb_"]
