"""Every refit reads the model's current storage, wherever the params moved (issue 50, 1).

Real processes: a real megatron-core model (dense, Qwen3-shaped, bf16) on 2 training ranks
(PP2: two refit groups) refits 2 generation ranks (TP2, vLLM-layout model, the worker
extension). Between refits the training ranks move their params to new memory the way RL
loops do (``testing.moves``: ``model._apply(clone)`` as ``Module.to()`` runs it, or an
offload and onload through ``param.data = ...``, on every rank or on training rank 0
only), then take an Adam step. Every refit is compared bit for bit on every generation
rank with the reference (full HF tensors gathered by the independent oracle, sliced by the
vLLM layout). Before the fix the senders kept views of the memory they were built on, so
every refit after a move sent the old weights and still reported a consistent commit.

The end-to-end runs (``tools.e2e``): process-group transport with checksums and deltas on,
and the colocated transport (shared-memory stand-in for CUDA IPC) with checksums on. The
job below adds what cannot be re-bound: training rank 1 turns one param to float32, and the
refit is refused on every rank before any byte moves, naming the param and the rank; once
the param is back in bf16 (new memory again) the same groups refit bit-exact.
"""

import time

import pytest
import torch

from megatron_reshard.groups.comm import destroy_refit_group
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.testing.moves import move_params_
from megatron_reshard.testing.optimizer_steps import adam_step_
from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.run_config import RefitRunConfig
from two_worlds import (catch, dense_pp2_source, live_digests, mismatched, prepared_worker,
                        publish_reference, run_two_worlds, stage_group)

TRAIN, GEN = 2, 2
TIMEOUT_S = 60.0
PP2_TO_TP2 = dict(model="dense", model_overrides={"num_layers": 2}, train_world=2, train_tp=1,
                  train_pp=2, train_ep=1, gen_world=2, gen_tp=2)


def _refit_job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


def _e2e(pool, **overrides):
    cfg = RefitRunConfig(**{"refits": 4, "quiet": True, "timeout_s": TIMEOUT_S,
                            "update": "adam", **PP2_TO_TP2, **overrides})
    results = pool.run(_refit_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=300)
    return results, summarize(cfg, results)


@pytest.mark.parametrize("move", ["apply", "data_rank0"])
def test_refits_after_a_move_send_the_models_current_weights_full_and_delta(pool, move):
    results, summary = _e2e(pool, move=move, delta=True, verify=True)
    for gen in results[TRAIN:]:
        assert gen["mismatches"] == [[]] * 4, gen["mismatches"]
    assert summary["modes"] == ["full", "delta", "delta", "delta"], summary["full_reasons"]
    for rank, train in enumerate(results[:TRAIN]):
        rebound = [r["rebound"] for r in train["refits"]]
        if move == "apply" or rank == 0:
            assert rebound[0] == 0 and all(n > 0 for n in rebound[1:]), (rank, rebound)
        else:  # its peer moved: this rank's views were right and stay
            assert rebound == [0] * 4, (rank, rebound)
        for r in train["refits"][1:]:  # the Adam steps changed some elements: they travel
            assert r["delta"]["changed"] > 0, r["delta"]


def test_the_colocated_transport_reads_the_moved_storage(pool):
    results, summary = _e2e(pool, move="data", transport="colocated", verify=True, refits=3)
    for gen in results[TRAIN:]:
        assert gen["mismatches"] == [[]] * 3, gen["mismatches"]
        assert gen["report"]["weights"]["state"] == "consistent"
    for train in results[:TRAIN]:
        assert train["transport"] == "colocated"
        assert [r["rebound"] > 0 for r in train["refits"]] == [False, True, True], train["refits"]


# -- what cannot be re-bound: refused on every rank, the groups stay usable -----------------

WIDENED = "decoder.layers.0.mlp.linear_fc2.weight"   # on training rank 1 (PP stage 1)
WIDENED_HF = "model.layers.1.mlp.down_proj.weight"


def _train(job, control, rank):
    model, source, family, vocab = dense_pp2_source(GEN, num_layers=2, seed=0)
    if rank == 0:
        control.set("payload", source.payload_bytes())
    group = stage_group(job, source, GEN, TIMEOUT_S)
    sender = RefitSender(source, group, delta=True)  # checksums off: the README's default
    params = dict(model.named_parameters())
    out = []
    for step in range(4):
        if step == 1:  # offload / onload on training rank 0 only
            move_params_(model, "data_rank0", job.rank)
        if step == 2 and job.rank == 1:  # a param in another dtype: the payload says bf16
            params[WIDENED].data = params[WIDENED].data.float()
        if step == 3 and job.rank == 1:  # back in bf16, in new memory
            params[WIDENED].data = params[WIDENED].data.to(torch.bfloat16)
        if step in (1, 3):
            adam_step_(model, step)
        out.append(catch(sender.refit))
        if step != 2:
            publish_reference(job, control, model, family, vocab, source.hf_config, step, GEN)
        control.set(f"sent/{step}/{job.rank}", "1")
    destroy_refit_group(group, TIMEOUT_S)
    return out


def _gen(job, control, gen_rank):
    worker, model, _ = prepared_worker(job, control, gen_rank, GEN, TRAIN, TIMEOUT_S)
    out = {"refits": [], "states": [], "mismatched": []}
    for step in range(4):
        before = live_digests(model)
        out["refits"].append(catch(worker.refit))
        out["states"].append(worker.refit_weights_state())
        if step == 2:  # refused: nothing may have moved
            after = live_digests(model)
            out["mismatched"].append(sorted(n for n in before if before[n] != after[n]))
            continue
        out["mismatched"].append(mismatched(control, step, gen_rank, model))
    control.wait([f"sent/3/{r}" for r in range(TRAIN)])
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def refused(pool):
    return run_two_worlds(pool, TRAIN, GEN, _train, _gen, num_ports=3, timeout_s=300)


def test_a_move_on_one_training_rank_only_refits_bit_exact_without_checksums(refused):
    for gen in refused[TRAIN:]:
        assert gen["mismatched"][:2] == [[], []], gen["mismatched"]
        assert [r.get("mode") for r in gen["refits"][:2]] == ["full", "delta"], gen["refits"]
    train0, train1 = refused[0][1], refused[1][1]
    assert train0["rebound"] > 0 and train1["rebound"] == 0, (train0, train1)
    assert train0["delta"]["changed"] > 0, train0["delta"]


def test_a_param_that_changed_dtype_is_refused_on_every_rank_before_any_byte_moves(refused):
    for who, res in enumerate(refused):
        row = res[2] if who < TRAIN else res["refits"][2]
        assert row.get("type") == "TensorsRefused", (who, row)
    own = refused[1][2]["error"]  # the rank that holds it names it, its dtypes and itself
    assert WIDENED in own and "torch.float32" in own and "PP stage 1" in own, own
    # its group's generation ranks name the rank and the HF param; stage 0's training
    # rank learns it from them
    for gen in refused[TRAIN:]:
        err = gen["refits"][2]["error"]
        assert "training group rank 0 of stage 1" in err and WIDENED_HF in err, err
        assert gen["mismatched"][2] == [], gen["mismatched"]  # nothing was written
        state = gen["states"][2]
        assert state["state"] == "consistent" and state["version"] == 2, state
    assert "another PP stage's refit group" in refused[0][2]["error"], refused[0][2]


def test_the_groups_stay_usable_after_the_refusal_and_the_next_refit_is_exact(refused):
    for gen in refused[TRAIN:]:
        assert gen["mismatched"][3] == [], gen["mismatched"]
        assert gen["states"][3]["state"] == "consistent" and gen["states"][3]["version"] == 3
    assert refused[1][3]["rebound"] > 0, refused[1][3]
