"""Set-up shared by the multi-process refit tests: the two worlds of one launch, and the
dense PP2 training source they refit from (tests only)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def join_world(job, train: int, gen: int):
    """The launch's control store (process 0 hosts it) and this process's own world, training
    (processes ``0..train-1``) or generation (the rest): returns (control, side, rank in it)."""
    control = dist.TCPStore(job.host, job.ports[0], job.nprocs, job.rank == 0,
                            timeout=timedelta(seconds=120))
    side, rank, size = ("train", job.rank, train) if job.rank < train else \
        ("gen", job.rank - train, gen)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{side}", control), rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))
    return control, side, rank


def dense_pp2_source(gen: int, **overrides):
    """Under a training world of 2: the demo's dense model (bf16, ``overrides`` applied) over
    PP2 and its ``MegatronRefitSource`` for gen TP ``gen``; returns (model, source, family,
    vocab_size)."""
    from megatron.core import parallel_state as ps

    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.tools.run_config import MODEL_PRESETS

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                 distributed_timeout_minutes=1)
    preset = dict(MODEL_PRESETS["dense"], **overrides)
    family = preset.pop("family")
    spec = TinyGPTSpec(dtype="bfloat16", **preset)
    model = build_gpt_model(spec).to(dtype=torch.bfloat16)
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": gen, "ep_size": 1, "pp_size": 1},
                                 gen_world_size=gen, family=family, vocab_size=spec.vocab_size)
    return model, source, family, spec.vocab_size
