"""A failed commit names the param and the rank on every rank (issue 50, items 8 and 9).

Real processes: a real megatron-core model (dense, Qwen3-shaped, bf16) on 2 training ranks
(PP2: two refit groups) and 2 generation ranks (TP2, the worker extension), the senders
with ``check_finite=True``, end-to-end checksums on and off. Refits:

1. a clean refit: committed;
2. (checksums on) generation rank 1's transport writes one element of a stage-1 param
   wrong (a transport bug stood in by a wrapper around the real transport): the commit
   fails on every rank, and every rank's error names the param and the generation rank,
   stage 0's training rank included (it learns it through the generation ranks);
3. a clean refit again: full, committed, bit-exact;
4. training rank 1 holds a NaN in one weight: the refit is refused on every rank before any
   byte moves (``NonFiniteRefused``), each error naming the param, the training rank and
   ``check_finite``; the generation side keeps the version it held, consistent, its
   weights untouched (before issue 51's round the bytes moved and the commit failed,
   leaving the weights inconsistent);
5. clean again: committed;
6. training rank 1 holds an Inf in the final norm, which this source sends in the packed
   broadcast (``packed_params``): refused the same way, naming it.
"""

import time

import pytest
import torch

from megatron_reshard.tools.e2e import ModuleWorker
from two_worlds import dense_pp2_source, join_world

TRAIN, GEN = 2, 2
TIMEOUT_S = 60.0
TARGET_HF = "model.layers.1.mlp.down_proj.weight"      # stage 1's
TARGET = "decoder.layers.0.mlp.linear_fc2.weight"      # its Megatron name on training rank 1
PACKED_HF = "model.norm.weight"                       # sent packed, from training rank 1
PACKED = "decoder.final_layernorm.weight"
REFITS = 6


def _catch(fn):
    try:
        return {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}


def _job(job, checksums):
    control, side, rank = join_world(job, TRAIN, GEN)
    return _train(job, control, checksums) if side == "train" else _gen(job, control, rank,
                                                                         checksums)


def _train(job, control, checksums):
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron.sender import RefitSender

    model, source, _, _ = dense_pp2_source(GEN, num_layers=2, seed=0,
                                           packed_params=r"^model\.norm\.weight$")
    if job.rank == 0:
        control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1 + source.stage], source.stage_local_rank,
                               1 + GEN, "gloo", TIMEOUT_S, who=f"train rank {job.rank}",
                               label=f"refit group of PP stage {source.stage}")
    sender = RefitSender(source, group, verify_checksums=checksums, check_finite=True)
    weight = dict(model.named_parameters()).get(TARGET)
    out = []
    for step in range(REFITS):
        if step == 3 and job.rank == 1:
            with torch.no_grad():
                weight.view(-1)[5] = float("nan")
        if step == 4 and job.rank == 1:
            with torch.no_grad():
                weight.view(-1)[5] = 0.25
        if step == 5 and job.rank == 1:
            with torch.no_grad():
                dict(model.named_parameters())[PACKED].view(-1)[3] = float("inf")
        out.append(_catch(sender.refit))
        control.set(f"sent/{step}/{job.rank}", "1")
    destroy_refit_group(group, TIMEOUT_S)
    return out


def _corrupting():
    """The real transport, then one element of the target written wrong on this rank."""
    from megatron_reshard.engine.refit_transport import transport_of

    def move(transfers, group, **kwargs):
        transport_of(group).move(transfers, group, **kwargs)
        for t in transfers:
            if t.name == TARGET_HF and t.dst is not None:
                t.dst[(0,) * t.dst.dim()] += 1
    return move


def _gen(job, control, gen_rank, checksums):
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.testing.vllm_like import build_vllm_like_model

    control.wait(["payload"])
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], gen_rank, GEN, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1], job.ports[2]], 1 + gen_rank, 1 + GEN,
                             "gloo", TIMEOUT_S)
    worker.prepare_refit(payload, {"verify_checksums": checksums})
    loop = worker.refit_worker_state.session.loop
    out = {"refits": [], "states": [], "unchanged": []}
    for step in range(REFITS):
        corrupt = checksums and step == 1 and gen_rank == 1
        loop._xfer_batch = _corrupting() if corrupt else None
        before = [p.clone() for p in model.parameters()]
        out["refits"].append(_catch(worker.refit))
        out["states"].append(worker.refit_weights_state())
        out["unchanged"].append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    control.wait([f"sent/{REFITS - 1}/{r}" for r in range(TRAIN)])
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["checksums", "no_checksums"])
def runs(request, pool):
    return request.param, pool.run(_job, TRAIN + GEN, request.param, num_ports=3,
                                   timeout_s=300)


def _rows(res, who):
    return res if who < TRAIN else res["refits"]


def test_clean_refits_commit(runs):
    checksums, results = runs
    for who, res in enumerate(results):
        rows = _rows(res, who)
        for step in (0, 2, 4):
            assert rows[step]["ok"], (who, step, rows[step])


def test_a_checksum_mismatch_names_the_param_and_the_rank_on_every_rank(runs):
    checksums, results = runs
    if not checksums:
        pytest.skip("the end-to-end checksums are off in this run")
    for who, res in enumerate(results):
        row = _rows(res, who)[1]
        assert not row["ok"] and "checksums differ" in row["error"], (who, row)
        assert TARGET_HF in row["error"] and "group rank 2 of stage 1" in row["error"], (who, row)
    for gen in results[TRAIN:]:
        assert gen["states"][1]["state"] == "inconsistent", gen["states"][1]


def _refused_before_any_byte_moved(results, step: int, hf_name: str) -> None:
    for who, res in enumerate(results):
        row = _rows(res, who)[step]
        assert not row["ok"] and row["type"] == "NonFiniteRefused", (who, row)
        err = row["error"]
        assert "NaN or Inf" in err and hf_name in err and "check_finite" in err, (who, err)
        assert "before any byte moved" in err or "nothing moved" in err, (who, err)
        if who != 1:  # the rank that holds it names itself by its PP stage
            assert "training group rank 0 of stage 1" in err, (who, err)
    assert "PP stage 1" in results[1][step]["error"], results[1][step]
    for gen in results[TRAIN:]:
        state = gen["states"][step]
        assert gen["unchanged"][step], step
        assert state["state"] == "consistent", state
        assert state["version"] == gen["states"][step - 1]["version"], gen["states"]
        assert all(s["state"] == "consistent" for s in gen["states"][step:]), gen["states"]


def test_nan_in_a_training_weight_refuses_the_refit_before_any_byte_moves(runs):
    _refused_before_any_byte_moved(runs[1], 3, TARGET_HF)


def test_inf_in_a_packed_param_refuses_the_refit_naming_it(runs):
    _refused_before_any_byte_moved(runs[1], 5, PACKED_HF)
