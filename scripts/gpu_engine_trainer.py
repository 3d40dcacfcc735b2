"""The training processes of ``gpu_engine_loop.py``: real megatron-core, GPUs shared with vLLM.

One process per GPU (``cfg["rank"]`` of ``cfg["world"]``, Megatron TP over all of them, and
Megatron EP over them for an MoE model),
spawned by the loop (``torch.multiprocessing``, spawn) before the ``LLM`` starts, so their
memory is in place when vLLM measures what is free. Each builds its part of a Qwen3-shaped
megatron-core GPT model (local layer spec, BF16; ``testing.megatron_models``), its
``MegatronRefitSource`` (vLLM TP = the training world) and, once told to connect, joins the
refit group (the training ranks, then the vLLM workers; ``transport="colocated"``: the
workers copy out of the training processes' memory over CUDA IPC) with a ``RefitSender``. Then it serves the loop's commands from ``cmd`` and answers on
``res`` (``(kind, value)`` tuples; any exception is answered as ``("error", traceback)``):

- ``("step", k)``: one AdamW step over FP32 masters (``testing.optimizer_steps``, learning
  rate ``cfg["lr"]``);
- ``("refit", version)``: ``sender.refit(version)`` while the loop drives vLLM's
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``;
- ``("full",)``: the full HF tensors of the current weights (``megatron_reference``'s
  gather, an oracle independent of the refit path; a collective of the training world),
  on the CPU, for vLLM's own loader (rank 0 answers them, the others None);
- ``("ipc",)``: the same weights through vLLM's ``ipc`` backend, as its trainer side sends
  them (``IPCWeightTransferEngine.trainer_send_weights`` over the full HF tensors on each
  rank's GPU; rank 0 hands each update to the loop, which calls ``LLM.update_weights`` and
  answers ``("ipc_done",)``);
- ``("stop",)``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
import types
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist


def import_ipc_engine():
    """vLLM's ``ipc_engine`` module. It imports ``ray`` at its top for its Ray send mode,
    which this loop does not use and the GPU image lacks: an empty stand-in module is
    placed for that import alone and removed again (other vLLM modules test for Ray)."""
    stub = None
    if "ray" not in sys.modules:
        try:
            import ray  # noqa: F401
        except ImportError:
            stub = sys.modules["ray"] = types.ModuleType("ray")
    try:
        from vllm.distributed.weight_transfer import ipc_engine
    finally:
        if stub is not None and sys.modules.get("ray") is stub:
            del sys.modules["ray"]
    return ipc_engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trainer_main(cfg: dict, cmd, res) -> None:
    try:
        _serve(cfg, cmd, res)
    except BaseException:  # noqa: BLE001 - the loop must learn of it, then we exit
        res.put(("error", traceback.format_exc()))
        raise


def _serve(cfg: dict, cmd, res) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron.core import parallel_state as ps

    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.testing.optimizer_steps import adam_step_

    t0 = time.perf_counter()
    rank, world = cfg.get("rank", 0), cfg.get("world", 1)
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", cfg["world_port"], world, rank == 0,
                          timeout=timedelta(seconds=60))
    # one GPU: gloo (nothing crosses devices); more: NCCL for the TP gathers of CUDA tensors
    backend = "nccl" if world > 1 and device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            **({"device_id": device} if backend == "nccl" else {}))
    # experts: Megatron EP over the TP ranks, whole experts per rank (Megatron's default
    # expert TP = TP, which the refit source refuses)
    experts = {"expert_model_parallel_size": world, "expert_tensor_parallel_size": 1} \
        if cfg["spec"].get("num_moe_experts") else {}
    ps.initialize_model_parallel(tensor_model_parallel_size=world, pipeline_model_parallel_size=1,
                                 **experts)
    spec = TinyGPTSpec(dtype="bfloat16", **cfg["spec"])
    model = build_gpt_model(spec).to(device=device, dtype=torch.bfloat16)
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": world, "ep_size": 1,
                                                         "pp_size": 1},
                                 gen_world_size=world, family=cfg["family"],
                                 vocab_size=spec.vocab_size, gen_quant=cfg["gen_quant"])
    params = sum(p.numel() for p in model.parameters())
    res.put(("payload", {"payload": source.payload_bytes(), "params": params,
                         "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                         "build_s": time.perf_counter() - t0}))

    def full_hf() -> dict:
        return gather_full_hf_state_dict(model, family=cfg["family"], vocab_size=spec.vocab_size)

    group = sender = None
    while True:
        kind, *rest = cmd.get()
        if kind == "stop":
            break
        if kind == "connect":  # blocks until the vLLM worker joins (its init_weight_transfer_engine)
            group = create_refit_group("127.0.0.1", cfg["refit_port"], rank, 2 * world, "gloo",
                                       cfg["timeout_s"], who=f"megatron-core trainer rank {rank}",
                                       label="colocated refit group", transport="colocated")
            sender = RefitSender(source, group, device=device)
            res.put(("ready", None))
        elif kind == "step":
            adam_step_(model, rest[0], lr=cfg["lr"])
            _sync(device)
            res.put(("stepped", rest[0]))
        elif kind == "refit":
            _sync(device)
            start = time.perf_counter()
            stats = sender.refit(rest[0])
            end = time.perf_counter()
            res.put(("refitted", {"t0": start, "t1": end, **{k: v for k, v in stats.items()
                                                             if isinstance(v, (int, float, str))}}))
        elif kind == "full":
            full = full_hf()
            res.put(("full", {k: v.detach().to("cpu").clone() for k, v in full.items()}
                     if rank == 0 else None))
        elif kind == "ipc":
            _send_ipc(full_hf, cmd, res, device)
        else:
            raise ValueError(f"trainer: unknown command {kind!r}")
    if group is not None:
        destroy_refit_group(group, cfg["timeout_s"])


def _send_ipc(full_hf, cmd, res, device) -> None:
    """One update through vLLM's ipc backend: the full HF tensors (here the gather is a
    conversion, TP1), then vLLM's own trainer-side send with a callable transport."""
    engine = import_ipc_engine().IPCWeightTransferEngine
    _sync(device)
    start = time.perf_counter()
    # the oracle's gather returns CPU tensors: on the GPU again, where a trainer holds them
    full = {k: v.to(device) for k, v in full_hf().items()}
    _sync(device)
    gathered = time.perf_counter()

    def send(update_info) -> None:  # rank 0 (vLLM's trainer side sends from rank 0 only)
        res.put(("ipc_update", dataclasses.asdict(update_info)))
        kind, *_ = cmd.get()  # the loop's update_weights returned: the handles may go
        if kind != "ipc_done":
            raise RuntimeError(f"trainer: expected ipc_done, found {kind!r}")

    engine.trainer_send_weights(iter(full.items()), {"send_mode": send})
    end = time.perf_counter()
    del full
    res.put(("ipc_sent", {"t0": start, "gathered": gathered, "t1": end}))
