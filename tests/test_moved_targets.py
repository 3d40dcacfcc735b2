"""What the receiver writes into must still be vLLM's storage (issue 51, 2; the generation
side of issue 50's moved params).

Real processes: a real megatron-core model (dense, Qwen3-shaped, bf16) on 2 training ranks
(PP2: two refit groups) refits 2 generation ranks (TP2, vLLM-layout model, the worker
extension), with deltas asked for and checksums off (the defaults). Between refits the
generation ranks re-allocate their params the ways vLLM and RL loops do: ``param.data =
...`` on one param of one rank (a post-load step), ``model._apply(clone)`` on every rank
(what ``Module.to()`` runs), a new ``Parameter`` put into a module. The training ranks take
an Adam step before each refit, so a refit that wrote into the old storage leaves the new
one stale. Each refit is compared bit for bit on every generation rank with the reference
(full HF tensors gathered by the independent oracle, sliced by the vLLM layout).

A param turned to float32 on one generation rank cannot take the payload's bf16: the
refit is refused on every rank before any byte moves, naming it; once it is back in bf16
(a new ``Parameter``) the same groups refit bit-exact.

Before the fix the receiver wrote every refit into the tensors bound at ``prepare_refit``.
"""

import json
import time

import pytest
import torch

from megatron_reshard.tools.e2e import ModuleWorker, _publish_expected, tensor_digest
from megatron_reshard.tools.run_config import RefitRunConfig
from two_worlds import dense_pp2_source, join_world

TRAIN, GEN = 2, 2
TIMEOUT_S = 60.0
STEPS = 5
PP2_TO_TP2 = dict(model="dense", model_overrides={"num_layers": 2}, train_world=2, train_tp=1,
                  train_pp=2, train_ep=1, gen_world=2, gen_tp=2)
DATA_MOVED = "model.layers.1.self_attn.qkv_proj.weight"  # step 1, gen rank 0: param.data =
WIDENED = "model.layers.0.mlp.down_proj.weight"          # step 3, gen rank 1: float32
REFUSED = 3


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"type": type(exc).__name__, "error": str(exc)}


def _job(job):
    control, side, rank = join_world(job, TRAIN, GEN)
    return _train(job, control) if side == "train" else _gen(job, control, rank)


def _train(job, control):
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.testing.optimizer_steps import adam_step_

    model, source, family, vocab = dense_pp2_source(GEN, num_layers=2, seed=0)
    if job.rank == 0:
        control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1 + source.stage], source.stage_local_rank,
                               1 + GEN, "gloo", TIMEOUT_S, who=f"train rank {job.rank}",
                               label=f"refit group of PP stage {source.stage}")
    sender = RefitSender(source, group, delta=True)
    out = []
    for step in range(STEPS):
        if step:
            adam_step_(model, step)
        out.append(_catch(sender.refit))
        full = gather_full_hf_state_dict(model, family=family, vocab_size=vocab)
        if job.rank == 0:
            _publish_expected(RefitRunConfig(**PP2_TO_TP2), control, source.hf_config, full, step)
        control.set(f"sent/{step}/{job.rank}", "1")
    destroy_refit_group(group, TIMEOUT_S)
    return out


@torch.no_grad()
def _reallocate(model: torch.nn.Module, step: int, gen_rank: int) -> None:
    params = dict(model.named_parameters())
    if step == 1 and gen_rank == 0:  # a post-load step on one param of one rank
        params[DATA_MOVED].data = params[DATA_MOVED].data.clone()
    if step == 2:  # what Module.to() runs, every param and buffer to new memory
        model._apply(lambda t: t.clone())
    if step == REFUSED and gen_rank == 1:  # another dtype than the payload's bf16
        params[WIDENED].data = params[WIDENED].data.float()
    if step == REFUSED + 1 and gen_rank == 1:  # back in bf16, as a new Parameter object
        prefix, _, leaf = WIDENED.rpartition(".")
        setattr(model.get_submodule(prefix), leaf,
                torch.nn.Parameter(params[WIDENED].data.to(torch.bfloat16), requires_grad=False))


def _gen(job, control, gen_rank):
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.wire.codec import decode_payload

    control.wait(["payload"])
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], gen_rank, GEN, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1], job.ports[2]], 1 + gen_rank, 1 + GEN,
                             "gloo", TIMEOUT_S)
    worker.prepare_refit(payload)
    out = {"refits": [], "states": [], "mismatched": [], "unchanged_when_refused": None,
           "params": len(dict(model.named_parameters()))}
    for step in range(STEPS):
        _reallocate(model, step, gen_rank)
        before = {n: tensor_digest(p) for n, p in model.named_parameters()}
        out["refits"].append(_catch(worker.refit))
        out["states"].append(worker.refit_weights_state())
        actual = {n: tensor_digest(p) for n, p in model.named_parameters()}
        if step == REFUSED:  # refused: nothing may have been written
            out["unchanged_when_refused"] = before == actual
            out["mismatched"].append(None)
            continue
        control.wait([f"expected/{step}/{gen_rank}"])
        expected = json.loads(control.get(f"expected/{step}/{gen_rank}"))
        out["mismatched"].append(sorted(n for n in set(expected) | set(actual)
                                        if expected.get(n) != actual.get(n)))
    out["report"] = worker.report()
    control.wait([f"sent/{STEPS - 1}/{r}" for r in range(TRAIN)])
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def refits(pool):
    return pool.run(_job, TRAIN + GEN, num_ports=3, timeout_s=300)


def test_refits_land_in_the_storage_vllm_holds_now_bit_exact(refits):
    for gen in refits[TRAIN:]:
        exact = [m for i, m in enumerate(gen["mismatched"]) if i != REFUSED]
        assert exact == [[]] * (STEPS - 1), gen["mismatched"]
        assert gen["states"][-1] == {**gen["states"][-1], "state": "consistent",
                                     "version": STEPS - 1}


def test_only_the_ranks_whose_params_moved_rebind_and_deltas_still_apply(refits):
    gen0, gen1 = refits[TRAIN]["refits"], refits[TRAIN + 1]["refits"]
    every = refits[TRAIN]["params"]  # model._apply moved them all
    assert [gen0[i]["rebound"] for i in (0, 1, 2, 4)] == [0, 1, every, 0], gen0
    assert [gen1[i]["rebound"] for i in (0, 1, 2, 4)] == [0, 0, every, 1], gen1
    assert refits[TRAIN]["report"]["rebinds"] == 2 and refits[TRAIN + 1]["report"]["rebinds"] == 2
    for gen in (gen0, gen1):  # the moved storage holds the committed bytes: still a base
        assert [gen[i]["mode"] for i in (0, 1, 2, 4)] == ["full", "delta", "delta", "delta"], gen


def test_a_param_in_another_dtype_is_refused_on_every_rank_by_name_before_any_byte_moves(refits):
    for who, res in enumerate(refits):
        row = res[REFUSED] if who < TRAIN else res["refits"][REFUSED]
        assert row.get("type") == "TensorsRefused", (who, row)
    own = refits[TRAIN + 1]["refits"][REFUSED]["error"]  # the rank that holds it names it
    assert WIDENED in own and "torch.float32" in own and "torch.bfloat16" in own, own
    assert "prepare_refit again" in own, own
    # stage 0's training rank names the generation rank and the HF param it writes
    stage0 = refits[0][REFUSED]["error"]
    assert "generation group rank 2 of stage 0's refit group" in stage0, stage0
    assert "model.layers.0.mlp.down_proj.weight among them" in stage0, stage0
    stage1 = refits[1][REFUSED]["error"]  # its param is no stage-1 param: named by rank only
    assert "generation group rank 2 of stage 1's refit group" in stage1, stage1
    for gen in refits[TRAIN:]:
        assert gen["unchanged_when_refused"] is True
        state = gen["states"][REFUSED]
        assert state["state"] == "consistent" and state["version"] == REFUSED, state
