"""What the framework-adapter tests share (tests only): a 2 + 2 launch (real megatron-core
dense model on PP2 training ranks, vLLM-layout model on 2 generation ranks, TP2), the
metadata exchange the frameworks' drivers do (every worker's ``prepare()`` result, in
training-then-rollout order, handed to every worker), and the reference each refit is
checked against bit for bit (full HF tensors gathered on the training side, sliced by the
vLLM layout)."""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch

from megatron_reshard.adapters import clear_hand_off
from two_worlds import dense_pp2_source, join_world

TRAIN, GEN = 2, 2
TIMEOUT_S = 60.0
_TARGET: Optional[torch.nn.Module] = None  # this generation process's vLLM-layout model


def current_target() -> torch.nn.Module:
    """The ``target`` option's function (``"adapter_worlds:current_target"``): the model a
    generation process built, as a vLLM worker holds its own."""
    return _TARGET


def engine_options(job, family: Optional[str] = None, vocab_size: Optional[int] = None) -> dict:
    """The options both sides get (the same dict, as the frameworks pass it)."""
    return {"gen_tp": GEN, "family": family, "vocab_size": vocab_size, "group_backend": "gloo",
            "host": job.host, "ports": list(job.ports[1:3]), "timeout_s": TIMEOUT_S,
            "target": "adapter_worlds:current_target"}


def start(job) -> tuple[Any, str, int, dict]:
    """Join this process's world. Training ranks build the Megatron model; generation ranks
    their vLLM-layout model (NaN-filled: a param left unwritten shows), as a vLLM worker
    holds its own before any refit. Returns (control, side, rank in side, facts): ``model``,
    ``family``, ``vocab_size`` (the generation side learns the last two through the store,
    as the framework's config would give them)."""
    clear_hand_off()  # a pool process runs many jobs: nothing handed by an earlier one stays
    control, side, rank = join_world(job, TRAIN, GEN)
    if side == "train":
        model, source, family, vocab = dense_pp2_source(GEN, num_layers=2)
        if rank == 0:
            control.set("model_facts", pickle.dumps((source.hf_config, family, vocab)))
        return control, side, rank, {"model": model, "family": family, "vocab_size": vocab}
    hf_config, family, vocab = pickle.loads(control.get("model_facts"))
    return control, side, rank, {"model": build_target(hf_config, rank), "family": family,
                                 "vocab_size": vocab}


def exchange_metadata(control, job, mine: Any, step: int) -> list:
    """Every worker's ``prepare()`` result of update ``step``, training ranks first (what
    the drivers gather)."""
    control.set(f"meta/{step}/{job.rank}", pickle.dumps(mine))
    keys = [f"meta/{step}/{r}" for r in range(TRAIN + GEN)]
    control.wait(keys)
    return [pickle.loads(control.get(k)) for k in keys]


def build_target(hf_config: dict, gen_rank: int) -> torch.nn.Module:
    """The generation rank's vLLM-layout model, NaN-filled; ``current_target()`` returns it."""
    from megatron_reshard.testing.vllm_like import build_vllm_like_model

    global _TARGET
    _TARGET = build_vllm_like_model(hf_config, gen_rank, GEN, 1, torch.bfloat16)
    with torch.no_grad():
        for p in _TARGET.parameters():
            p.fill_(float("nan"))
    return _TARGET


def publish_reference(control, rank: int, model, family: str, vocab_size: int, step: int) -> None:
    """Collective over the training world: the full HF tensors; rank 0 publishes each
    generation rank's expected vLLM params for refit ``step``."""
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.testing.vllm_like import expected_vllm_shard, vllm_param_shapes

    full = gather_full_hf_state_dict(model, family=family, vocab_size=vocab_size)
    if rank != 0:
        return
    hf_config = pickle.loads(control.get("model_facts"))[0]
    for g in range(GEN):
        expected = {n: expected_vllm_shard(hf_config, n, full, g, GEN)
                    for n in vllm_param_shapes(hf_config, g, GEN)}
        buffer = io.BytesIO()
        torch.save(expected, buffer)
        control.set(f"expected/{step}/{g}", buffer.getvalue())


def mismatches(control, gen_rank: int, step: int, model: torch.nn.Module) -> list[str]:
    """Names of the params that differ from the reference (or exist on one side only)."""
    expected = torch.load(io.BytesIO(control.get(f"expected/{step}/{gen_rank}")))
    actual = dict(model.named_parameters())
    return sorted(n for n in set(expected) | set(actual)
                  if n not in expected or n not in actual or not _same_bits(expected[n], actual[n]))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().view(torch.uint8)

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


class RaisingWeights:
    """The framework's iterator of gathered full tensors: the adapters must close it unread
    (reading it would run the gathers)."""

    def __init__(self) -> None:
        self.closed = False

    def __iter__(self):
        return self

    def __next__(self):
        raise AssertionError("the framework's full-tensor iterator was read")

    def close(self) -> None:
        self.closed = True
