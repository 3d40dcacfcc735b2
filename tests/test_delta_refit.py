"""Delta refits (the delta package): bit-exact, smaller, and full whenever the base is unproven.

Real processes: a real megatron-core model (dense, Qwen3-shaped, bf16) on 2 training ranks
(PP2: two refit groups) and 2 generation ranks (TP2, vLLM-layout model). The senders ask
for delta refits. Between refits ~2% of every training param's elements change (a seeded
choice, identical on every run). After every refit each generation rank compares every
param bit for bit with the reference (full HF tensors gathered by the independent oracle,
sliced by the vLLM layout). Refits:

1. the first: full on every rank ("holds no base");
2.-4. delta on every rank, the bytes sent a small fraction of the first refit's;
5. new refit groups, a new sender (same model) and a new session on the generation ranks:
   full on every rank, the reason naming both sides (no base on either);
6. delta again;
7.-8. new groups again, stage 1's sender with a base budget of 1 byte: full both times;
   the second time stage 0's group alone could go delta, but the generation ranks see
   stage 1's "over its budget" and tell stage 0's training rank ("another PP stage").

A second layout mixes the two kinds of plans in every layer: 1 training rank, 4
generation ranks (TP4) of a model with 2 KV heads, so each KV head lives on 2 generation
ranks (k/v: the plan sends each member a stripe and the members exchange them, phase 1,
forwarded as deltas) while q, o and the MLP go one hop. Six refits, with the
end-to-end checksums on (they cover the resulting regions, deltas or not). Before the
fourth, generation rank 1 writes 16 elements of a delta param's storage behind the
refit's back: its base digest (delta.base_digest) no longer matches the one taken at the
last commit, so that refit goes full on every rank, naming why, before any delta lands,
and is bit-exact; the fifth and sixth are deltas again.
"""

import time

import pytest
import torch

from megatron_reshard.delta import DeltaConfig
from megatron_reshard.groups.comm import destroy_refit_group
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.tools.tiny_source import tiny_source
from two_worlds import (catch, change_sparsely, join_stages, mismatched, publish_reference,
                        run_two_worlds, stage_group, vllm_like_worker)

TRAIN, GEN = 2, 2
TIMEOUT_S = 60.0
TAMPERED = "model.layers.1.mlp.down_proj.weight"  # one hop from training TP1 to gen TP4
REFITS = 8
NEW_SESSION_BEFORE = 4  # 0-based refit index before which both sides start anew
TINY_BUDGET_FROM = 6    # and again, stage 1's sender's budget then 1 byte
ROUND_STARTS = (0, NEW_SESSION_BEFORE, TINY_BUDGET_FROM)
# (training ranks = PP stages, generation ranks = gen TP, refits, verify_checksums, model)
PP2_TO_TP2 = (2, 2, REFITS, False, "dense")
ONE_TO_TP4 = (1, 4, 6, True, "dense")
MOE_TO_TP2 = (1, 2, 3, True, "moe")
TAMPER_BEFORE = 3  # the mixed layout: gen rank 1 writes its storage before this refit


def _train(job, control, rank, layout):
    train, gen, refits, checks, name = layout
    model, source, family, vocab_size = tiny_source(name, gen, pp=train, seed=0, num_layers=2)
    if rank == 0:
        control.set("payload", source.payload_bytes())

    def start(round_: int, budget: int = 1 << 30):
        group = stage_group(job, source, gen, TIMEOUT_S, first_port=1 + 2 * round_)
        return group, RefitSender(source, group, verify_checksums=checks,
                                  delta=DeltaConfig(budget_bytes=budget, keep="pinned"))

    group, sender = start(0)
    out = []
    for step in range(refits):
        if step in ROUND_STARTS[1:] and train == 2:
            destroy_refit_group(group, TIMEOUT_S)
            round_ = ROUND_STARTS.index(step)
            tiny = step == TINY_BUDGET_FROM and source.stage == 1
            group, sender = start(round_, 1 if tiny else 1 << 30)
        if step:
            change_sparsely(model, step)
        out.append(catch(sender.refit))
        publish_reference(job, control, model, family, vocab_size, source.hf_config, step, gen)
        control.set(f"sent/{step}/{job.rank}", "1")
    destroy_refit_group(group, TIMEOUT_S)
    return out


def _gen(job, control, gen_rank, layout):
    train, gen, refits, checks, name = layout
    worker, model, payload = vllm_like_worker(control, gen_rank, gen)

    def start(round_: int) -> None:
        join_stages(worker, job, gen_rank, gen, train, TIMEOUT_S, payload,
                    {"verify_checksums": checks}, first_port=1 + 2 * round_)

    start(0)
    out = {"refits": [], "mismatched": [], "reports": [], "states": []}
    for step in range(refits):
        if step in ROUND_STARTS[1:] and train == 2:
            worker.destroy_refit_groups(TIMEOUT_S)
            start(ROUND_STARTS.index(step))  # a new session: its storage is no proven base
        if checks and step == TAMPER_BEFORE and gen_rank == 1:
            with torch.no_grad():  # an out-of-band write the refit is not told about
                flat = dict(model.named_parameters())[TAMPERED].view(-1)
                flat[:16] = flat[:16] * 2 + 1
        out["refits"].append(catch(worker.refit))
        out["states"].append(worker.refit_weights_state())
        out["reports"].append(worker.report())
        out["mismatched"].append(mismatched(control, step, gen_rank, model))
    control.wait([f"sent/{refits - 1}/{r}" for r in range(train)])
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


def _run(pool, layout, num_ports):
    return run_two_worlds(pool, layout[0], layout[1], _train, _gen, layout, num_ports=num_ports,
                          timeout_s=400)


@pytest.fixture(scope="module")
def runs(pool):
    return _run(pool, PP2_TO_TP2, num_ports=7)


@pytest.fixture(scope="module")
def moe(pool):
    return _run(pool, MOE_TO_TP2, num_ports=3)


@pytest.fixture(scope="module")
def mixed(pool):
    return _run(pool, ONE_TO_TP4, num_ports=3)


def _modes(res):
    rows = res if isinstance(res, list) else res["refits"]
    return [r["mode"] for r in rows]


EXPECTED_MODES = ["full", "delta", "delta", "delta", "full", "delta", "full", "full"]


def test_every_refit_is_bit_exact_on_every_generation_rank(runs):
    for gen in runs[TRAIN:]:
        assert gen["mismatched"] == [[]] * REFITS, gen["mismatched"]


def test_every_rank_agrees_on_the_mode_of_every_refit(runs):
    for who, res in enumerate(runs):
        assert _modes(res) == EXPECTED_MODES, (who, _modes(res),
                                               [r["full_reason"] for r in
                                                (res if who < TRAIN else res["refits"])])


def test_full_refits_say_why_on_every_rank(runs):
    for who, res in enumerate(runs):
        rows = res if who < TRAIN else res["refits"]
        assert "holds no base" in rows[0]["full_reason"], (who, rows[0]["full_reason"])
        again = rows[NEW_SESSION_BEFORE]["full_reason"]
        assert "holds no base" in again and "session has not committed" in again, (who, again)
        last = rows[TINY_BUDGET_FROM + 1]["full_reason"]
        if who == 0:  # its own group was ready: the other stage's group said no
            assert last == "another PP stage's refit group needs a full refit", last
        else:
            assert "base is over its budget (stage 1's refit group)" in last, (who, last)
        for i, row in enumerate(rows):
            if row["mode"] == "delta":
                assert row["full_reason"] is None, (who, i, row)


def test_delta_refits_move_a_small_fraction_of_the_bytes(runs):
    for who, rows in enumerate(runs[:TRAIN]):
        full = rows[0]["bytes_sent"]
        assert full > 0
        for i, row in enumerate(rows):
            if row["mode"] == "delta":
                d = row["delta"]
                assert d["params"] > 0 and 0 < d["changed"], (who, i, d)
                # ~2% changed: about 2-3 bytes per changed bf16 element (gaps, values)
                assert row["bytes_sent"] < 0.15 * full, (who, i, row["bytes_sent"], full)
                assert d["wire_bytes"] < 0.15 * d["full_bytes"], (who, i, d)
            else:
                assert row["bytes_sent"] == full, (who, i, row["bytes_sent"], full)
        base = rows[-1]["base"]
        if who == 1:
            assert base["kept_bytes"] == 0 < base["need_bytes"] and base["budget_bytes"] == 1
        else:  # stage 0 keeps its base (within budget)
            assert base["kept_bytes"] == base["need_bytes"] > 0, base
        assert rows[3]["base"]["kept_bytes"] == rows[3]["base"]["need_bytes"] > 0, rows[3]
    for gen in runs[TRAIN:]:
        first = gen["reports"][0]
        assert first["mode"] == "full" and first["bytes_received"] == first["full_bytes"] > 0
        for report in gen["reports"][1:NEW_SESSION_BEFORE]:
            assert report["mode"] == "delta"
            # issue 35's target: <= 4% of a full refit's bytes at 1-2% changed (headers and
            # the packed params included; measured 2.4-2.7% here)
            assert report["bytes_received"] < 0.04 * report["full_bytes"], report


MIXED_MODES = ["full", "delta", "delta", "full", "delta", "delta"]


def test_replica_completion_forwards_deltas_bit_exact(mixed):
    train, gens = mixed[0], mixed[1:]
    assert _modes(train) == MIXED_MODES, train
    for gen in gens:
        for step, bad in enumerate(gen["mismatched"]):
            assert bad == [] or step == TAMPER_BEFORE, (step, bad)
        assert _modes(gen) == MIXED_MODES, gen["refits"]
        assert all(r["checksums"] for r in gen["refits"] if r["mode"] != "failed")
    for step in (1, 2, 5):
        d = train[step]["delta"]
        assert d["params"] == train[step]["bulk_params"], d  # every param as a delta
        assert d["held_bytes"] == train[step]["bulk_bytes"]
        assert train[step]["bytes_sent"] < 0.15 * train[0]["bytes_sent"], train[step]
        forwarded = [gen["refits"][step]["delta"]["forwarded_bytes"] for gen in gens]
        assert all(f > 0 for f in forwarded), forwarded  # k/v stripes went member to member
        for gen in gens:
            row = gen["refits"][step]
            assert row["bytes_received"] < 0.15 * row["full_bytes"], row


def test_a_storage_written_behind_the_refits_back_makes_the_refit_full_before_any_delta_lands(mixed):
    train, gens = mixed[0], mixed[1:]
    tampered = train[TAMPER_BEFORE]
    assert tampered["mode"] == "full", tampered
    assert "written outside the refits" in tampered["full_reason"], tampered["full_reason"]
    assert train[TAMPER_BEFORE + 1]["mode"] == "delta", train[TAMPER_BEFORE + 1]
    for who, gen in enumerate(gens):
        assert gen["mismatched"][TAMPER_BEFORE] == [], (who, gen["mismatched"])
        row = gen["refits"][TAMPER_BEFORE]
        assert "written outside the refits" in row["full_reason"], (who, row)
        assert gen["states"][TAMPER_BEFORE]["state"] == "consistent", gen["states"]
        # the rank that was written names the param (in its report); the others found none
        found = gen["reports"][TAMPER_BEFORE]["written_outside"]
        assert found == ([TAMPERED] if who == 1 else []), (who, found)


def test_a_moe_model_refits_bit_exact_with_deltas(moe):
    train, gens = moe[0], moe[1:]
    for gen in gens:
        assert gen["mismatched"] == [[]] * 3, gen["mismatched"]
    modes = _modes(train)
    assert all(_modes(gen) == modes for gen in gens)
    assert modes == ["full", "delta", "delta"], [r["full_reason"] for r in train]
    assert train[2]["bytes_sent"] < 0.2 * train[0]["bytes_sent"], train[2]
