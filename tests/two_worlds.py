"""Set-up shared by the multi-process refit tests: the two worlds of one launch, and the
dense PP2 training source they refit from (tests only)."""

from __future__ import annotations

from datetime import timedelta

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
    from megatron_reshard.tools.tiny_source import tiny_source

    return tiny_source("dense", gen, pp=2, **overrides)
