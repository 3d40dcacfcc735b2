"""The harness of the multi-process refit tests (tests only): one launch of a training world
(processes ``0..train-1``) and a generation world (the rest) on the session's worker pool,
each side's refit groups, the reference every generation rank checks its params against,
and the fault plumbing of the fault tests. A test keeps only its own ``train`` and ``gen``
functions and its checks."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
from megatron_reshard.testing.vllm_like import (build_vllm_like_model, expected_vllm_shard,
                                                vllm_param_shapes)
from megatron_reshard.tools.e2e import ModuleWorker, tensor_digest
from megatron_reshard.tools.tiny_source import tiny_source
from megatron_reshard.wire.codec import decode_payload
from megatron_reshard.wire.spec import RefitCtx

# -- the two worlds of one launch ----------------------------------------------------------


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


def _two_world_job(job, train: int, gen: int, train_fn, gen_fn, args: tuple):
    control, side, rank = join_world(job, train, gen)
    return (train_fn if side == "train" else gen_fn)(job, control, rank, *args)


def run_two_worlds(pool, train: int, gen: int, train_fn, gen_fn, *args, **run_options):
    """One launch on ``pool``: ``train_fn(job, control, rank, *args)`` on each training rank,
    ``gen_fn(job, control, gen_rank, *args)`` on each generation rank (module-level functions:
    they travel to the spawned workers by name). ``run_options`` go to ``WorkerPool.run``
    (``num_ports``, ``timeout_s``, ``return_failures``, ...); returns the results by process."""
    return pool.run(_two_world_job, train + gen, train, gen, train_fn, gen_fn, args,
                    **run_options)


# -- the training side ---------------------------------------------------------------------


def dense_pp2_source(gen: int, **overrides):
    """Under a training world of 2: the demo's dense model (bf16, ``overrides`` applied) over
    PP2 and its ``MegatronRefitSource`` for gen TP ``gen``; returns (model, source, family,
    vocab_size)."""
    from megatron_reshard.tools.tiny_source import tiny_source  # reads the demo presets

    return tiny_source("dense", gen, pp=2, **overrides)


def stage_group(job, source, gen: int, timeout_s: float, first_port: int = 1, **options):
    """This training rank's refit group: its PP stage's, with the ``gen`` generation ranks, at
    port ``job.ports[first_port + stage]`` (``options``: ``create_refit_group``'s, e.g.
    ``transport``)."""
    return create_refit_group(job.host, job.ports[first_port + source.stage],
                              source.stage_local_rank, 1 + gen, "gloo", timeout_s,
                              who=f"train rank {job.rank}",
                              label=f"refit group of PP stage {source.stage}", **options)


def delta_pp2_sender(job, control, rank: int, gen: int, timeout_s: float):
    """Under a training world of 2: the demo's dense model over PP2 and a delta
    ``RefitSender`` with checksums on, into this rank's stage group with ``gen`` generation
    ranks; rank 0 publishes the payload. Returns (model, source, family, vocab_size, sender)."""
    from megatron_reshard.megatron.sender import RefitSender

    model, source, family, vocab_size = dense_pp2_source(gen)
    if rank == 0:
        control.set("payload", source.payload_bytes())
    sender = RefitSender(source, stage_group(job, source, gen, timeout_s),
                         verify_checksums=True, delta=True)
    return model, source, family, vocab_size, sender


def publish_reference(job, control, model, family: str, vocab_size: int, hf_config: dict,
                      step, gen: int) -> None:
    """The independent reference of refit ``step``: the full HF tensors gathered from the
    training world (a collective: every training rank calls it), sliced by the vLLM layout of
    each generation rank (TP ``gen``); training rank 0 publishes their digests."""
    full = gather_full_hf_state_dict(model, family=family, vocab_size=vocab_size)
    if job.rank != 0:
        return
    full = {k: v.to("cpu") for k, v in full.items()}
    for g in range(gen):
        digests = {n: tensor_digest(expected_vllm_shard(hf_config, n, full, g, gen, 1))
                   for n in vllm_param_shapes(hf_config, g, gen, 1)}
        control.set(f"expected/{step}/{g}", json.dumps(digests))


def _sparse_picks(model, step: int, fraction: float):
    """Per param: ~``fraction`` of its elements, a seeded choice by step and name (identical
    on every run)."""
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{name}".encode()))
        flat = p.data.view(-1)
        yield flat, torch.rand(flat.numel(), generator=g) < fraction


@torch.no_grad()
def change_sparsely(model, step: int, fraction: float = 0.02) -> None:
    """Give ~``fraction`` of every param's elements new values (x * 1.5 + 1/16): what a
    training step that moves few weights looks like; a delta carries them as whole values."""
    for flat, pick in _sparse_picks(model, step, fraction):
        flat[pick] = flat[pick] * 1.5 + 0.0625


@torch.no_grad()
def nudge_sparsely(model, step: int, fraction: float = 0.02) -> None:
    """Move ~``fraction`` of every bf16 param's elements by one unit in the last place (up or
    down with the sign): the small differences a delta packs tightest."""
    for flat, pick in _sparse_picks(model, step, fraction):
        flat.view(torch.int16)[pick] += 1


# -- the generation side -------------------------------------------------------------------


def train_sparse_deltas(job, control, gen: int, refits: int, timeout_s: float) -> list:
    """A training rank of a 2-layer dense model sending deltas: ``refits`` refits, ~2% of
    every param changed before each but the first, the reference published after each;
    ends once every generation rank has checked the last. Returns each refit's outcome."""
    model, source, family, vocab = tiny_source("dense", gen, seed=0, num_layers=2)
    control.set("payload", source.payload_bytes())
    group = stage_group(job, source, gen, timeout_s)
    sender = RefitSender(source, group, delta=True)
    out = []
    for step in range(refits):
        if step:
            change_sparsely(model, step)
        out.append(catch(sender.refit))
        publish_reference(job, control, model, family, vocab, source.hf_config, step, gen)
    control.wait([f"checked/{refits - 1}/{g}" for g in range(gen)])
    destroy_refit_group(group, timeout_s)
    return out


def vllm_like_worker(control, gen_rank: int, gen: int, state: dict | None = None,
                     fresh: bool = True):
    """The worker extension over a vLLM-layout model (TP ``gen``, bf16) of the payload training
    rank 0 published; returns (worker, model, payload). With ``state`` (module state of the
    pool's long-lived process) the previous job's model and worker are kept unless ``fresh``."""
    payload = decode_payload(control.get("payload"))  # waits until it is there
    if state is None or fresh or "worker" not in state:
        model = build_vllm_like_model(payload["hf_config"], gen_rank, gen, 1, torch.bfloat16)
        if state is None:
            return ModuleWorker(model), model, payload
        state.update(worker=ModuleWorker(model), model=model)
    return state["worker"], state["model"], payload


def join_stages(worker, job, gen_rank: int, gen: int, stages: int, timeout_s: float,
                payload: dict, options: dict | None = None, first_port: int = 1) -> None:
    """Join every PP stage's refit group (ports ``first_port..first_port+stages-1``, the
    training side's ``stage_group``) and prepare the session (``options``)."""
    ports = [job.ports[first_port + s] for s in range(stages)]
    worker.init_refit_groups(job.host, ports, 1 + gen_rank, 1 + gen, "gloo", timeout_s)
    worker.prepare_refit(payload, options)


def prepared_worker(job, control, gen_rank: int, gen: int, stages: int, timeout_s: float,
                    options: dict | None = None, state: dict | None = None, fresh: bool = True):
    """``vllm_like_worker`` joined to every stage's refit group and prepared (``options``, see
    ``join_stages``); returns (worker, model, payload)."""
    worker, model, payload = vllm_like_worker(control, gen_rank, gen, state, fresh)
    join_stages(worker, job, gen_rank, gen, stages, timeout_s, payload, options)
    return worker, model, payload


def live_digests(model) -> dict:
    return {n: tensor_digest(p) for n, p in model.named_parameters()}


def changes_ahead(control, step, gen_rank: int, model) -> tuple[dict, dict, list]:
    """Before refit ``step``: this rank's live digests, the reference's of the step (waits
    for it), and the 2-D params the refit changes (sorted)."""
    before = live_digests(model)
    control.wait([f"expected/{step}/{gen_rank}"], timedelta(seconds=60))
    want = json.loads(control.get(f"expected/{step}/{gen_rank}"))
    changing = sorted(n for n, p in model.named_parameters()
                      if want.get(n) != before[n] and p.dim() == 2)
    return before, want, changing


def mismatched(control, step, gen_rank: int, model) -> list:
    """The params of this rank that differ from the reference of refit ``step`` (waits for
    it), or that only one side has."""
    control.wait([f"expected/{step}/{gen_rank}"])
    expected = json.loads(control.get(f"expected/{step}/{gen_rank}"))
    actual = live_digests(model)
    return sorted(n for n in set(expected) | set(actual) if expected.get(n) != actual.get(n))


def refit_and_record(out: dict, worker, control, step, gen_rank: int, model) -> None:
    """One refit of a generation rank, recorded in ``out`` (its lists ``refits``, ``states``,
    ``reports``, ``mismatched``): the outcome, the weight state, the report and the params
    off the reference of refit ``step``; then tells the training side it was checked."""
    out["refits"].append(catch(worker.refit))
    out["states"].append(worker.refit_weights_state())
    out["reports"].append(worker.report())
    out["mismatched"].append(mismatched(control, step, gen_rank, model))
    control.set(f"checked/{step}/{gen_rank}", "1")


def versions_held(control, gen_rank: int, actual: dict, steps) -> dict:
    """Per refit of ``steps`` whose reference was published: the params (of the digests
    ``actual``) bit-exact at it."""
    held = {}
    for k in steps:
        key = f"expected/{k}/{gen_rank}"
        if control.check([key]):
            want = json.loads(control.get(key))
            held[k] = sorted(n for n in actual if want.get(n) == actual[n])
    return held


def gen_outcome(control, gen_rank: int, worker, model, refits: int) -> dict:
    """What a generation rank holds after its refits ``1..refits`` (or a fault): its weight
    state, which params are bit-exact at which version, and when the victim struck."""
    actual = live_digests(model)
    return {"state": worker.refit_weights_state(),
            "versions": versions_held(control, gen_rank, actual, range(1, refits + 1)),
            "names": sorted(actual), "fault_at": fault_time(control)}


def catch(fn):
    """``fn()``, or its error as a result: ``{"mode": "failed", "type", "error",
    "full_reason": None}``."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"mode": "failed", "type": type(exc).__name__, "error": str(exc),
                "full_reason": None}


# -- faults --------------------------------------------------------------------------------

FAULT_TIMEOUT_S = 8.0  # the fault tests' refit groups: a survivor hears of a hung peer by then
FAULT_MARGIN_S = 5.0   # ... and every survivor fails within timeout + margin of the fault


def strike(control, fault: str) -> None:
    """In the victim: note the time in the control store, then SIGKILL (``fault == "kill"``)
    or SIGSTOP this process."""
    control.set("fault_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def fault_time(control):
    return float(control.get("fault_at")) if control.check(["fault_at"]) else None


def arm_victim(loop, fault: str, seed: int, at_refit: int, control, step) -> None:
    """Make one seeded random param's pre hook of this rank's refit ``loop`` strike
    (``fault``) when refit ``step()`` is ``at_refit``."""
    names = sorted(loop.local_map.specs)
    spec = loop.local_map.specs[random.Random(seed).choice(names)]
    inner = spec.pre

    def pre(base):
        if step() == at_refit:
            strike(control, fault)
        return inner(base) if inner is not None else RefitCtx(buf=base)

    spec.pre = pre


def check_all_or_nothing(gen: dict) -> None:
    """The state says exactly what the storage holds: every param not listed as
    overwritten is bit-exact at the version the state gives (``gen``: a ``gen_outcome``)."""
    state = gen["state"]
    base = state["version"] if state["state"] == "consistent" else state["started_from"]
    held = set(gen["versions"].get(base, []))
    unlisted = set(gen["names"]) - set(state["overwritten"])
    assert unlisted <= held, (sorted(unlisted - held), state)
