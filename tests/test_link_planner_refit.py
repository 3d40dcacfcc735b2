"""Real refits with the link-aware planner (refit.loop, docs/DESIGN.md "Which planner a
refit uses"): both sides agree on it at the plan check, refit bit-exact, full and delta;
a side that picks another planner is refused by name before any byte moves.

Real processes: 1 training rank and 4 generation ranks (TP4) of the dense model (2 KV
heads: each KV head is replicated on 2 generation ranks, the norms on all 4), one refit
group. Each rank names its node (``node=``): the training rank alone, generation ranks
0 and 2 on one node, 1 and 3 on another, so every replicated region spans both nodes
and ``planner="auto"`` must pick the link-aware planner. Three refits (full, delta,
delta), each compared bit for bit with the independent oracle's expected shards. Then
new groups where the training side asks for ``planner="default"``: every rank raises a
``PlanMismatchError`` naming the planner, and the weights keep the last refit's bits.
A second layout, PP2 -> TP2 (two refit groups, so one planner per stage, each with its
own group's nodes), runs the same refits.
"""

import json
import time

import pytest
import torch

from megatron_reshard.engine.param_plan import build_plan
from megatron_reshard.engine.plan import layout_key
from megatron_reshard.refit.loop import PLANNERS, choose_costs, node_code, plan_mismatch_text
from megatron_reshard.tools.e2e import ModuleWorker, _publish_expected, tensor_digest
from megatron_reshard.tools.run_config import RefitRunConfig
from two_worlds import join_world

GEN = 4
TIMEOUT_S = 60.0
REFITS = 3


def _cfg(train: int, gen: int) -> RefitRunConfig:
    return RefitRunConfig(model="dense", train_world=train, train_tp=1, train_pp=train,
                          train_ep=1, gen_world=gen, gen_tp=gen, gen_ep=1)


def _node(job, train: int) -> str:
    return "train-node" if job.rank < train else f"gen-node-{(job.rank - train) % 2}"


def _change(model, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        flat = p.data.view(-1)
        pick = torch.rand(flat.numel(), generator=g) < 0.02
        flat[pick] = flat[pick] * 1.5 + 0.0625


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"mode": "failed", "type": type(exc).__name__, "error": str(exc)}


def _job(job, train, gen):
    control, side, rank = join_world(job, train, gen)
    return _train(job, control, train, gen) if side == "train" else \
        _gen(job, control, rank, train, gen)


@torch.no_grad()
def _train(job, control, train, gen):
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.delta import DeltaConfig
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.tools.tiny_source import tiny_source

    model, source, family, vocab_size = tiny_source("dense", gen, pp=train, seed=0, num_layers=2)
    if job.rank == 0:
        control.set("payload", source.payload_bytes())

    def group(round_: int):
        return create_refit_group(job.host, job.ports[1 + round_ * train + source.stage],
                                  source.stage_local_rank, 1 + gen, "gloo", TIMEOUT_S,
                                  who=f"train rank {job.rank}",
                                  label=f"refit group of PP stage {source.stage}")

    g = group(0)
    sender = RefitSender(source, g, verify_checksums=True, planner="auto", node=_node(job, train),
                         delta=DeltaConfig(keep="pinned"))
    out = {"refits": []}
    for step in range(REFITS):
        if step:
            _change(model, step)
        out["refits"].append(_catch(sender.refit))
        full = gather_full_hf_state_dict(model, family=family, vocab_size=vocab_size)
        if job.rank == 0:
            _publish_expected(_cfg(train, gen), control, source.hf_config, full, step)
    destroy_refit_group(g, TIMEOUT_S)
    _change(model, REFITS)  # bits the refused refit must not deliver
    g = group(1)
    other = RefitSender(source, g, verify_checksums=True, planner="default",
                        node=_node(job, train))
    out["refused"] = _catch(other.refit)
    destroy_refit_group(g, TIMEOUT_S)
    return out


@torch.no_grad()
def _gen(job, control, gen_rank, train, gen):
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.wire.codec import decode_payload

    control.wait(["payload"])
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], gen_rank, gen, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    options = {"verify_checksums": True, "planner": "auto", "node": _node(job, train)}

    def digests():
        return {n: tensor_digest(p) for n, p in model.named_parameters()}

    ports = [job.ports[1 + s] for s in range(train)]
    worker.init_refit_groups(job.host, ports, 1 + gen_rank, 1 + gen, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload, options)
    out = {"refits": [], "mismatched": [], "payload": control.get("payload")}
    for step in range(REFITS):
        out["refits"].append(_catch(worker.refit))
        control.wait([f"expected/{step}/{gen_rank}"])
        expected = json.loads(control.get(f"expected/{step}/{gen_rank}"))
        actual = digests()
        out["mismatched"].append(sorted(n for n in set(expected) | set(actual)
                                        if expected.get(n) != actual.get(n)))
    worker.destroy_refit_groups(TIMEOUT_S)
    before = digests()
    ports = [job.ports[1 + train + s] for s in range(train)]
    worker.init_refit_groups(job.host, ports, 1 + gen_rank, 1 + gen, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload, options)
    out["refused"] = _catch(worker.refit)
    out["unchanged"] = digests() == before
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def runs(pool):
    return pool.run(_job, 1 + GEN, 1, GEN, num_ports=3, timeout_s=400)


@pytest.fixture(scope="module")
def pp2(pool):
    return pool.run(_job, 2 + 2, 2, 2, num_ports=5, timeout_s=400)


@pytest.mark.parametrize("layout", ["runs", "pp2"])
def test_link_aware_refits_are_bit_exact_full_and_delta(layout, request):
    res = request.getfixturevalue(layout)
    train = 1 if layout == "runs" else 2
    trains, gens = res[:train], res[train:]
    modes = [r["mode"] for r in trains[0]["refits"]]
    assert modes == ["full", "delta", "delta"], trains[0]["refits"]
    for t in trains:
        assert [r["mode"] for r in t["refits"]] == modes
        assert all(r["planner"] == "link" for r in t["refits"]), t["refits"]
    for gen in gens:
        assert gen["mismatched"] == [[]] * REFITS, gen["mismatched"]
        assert [r["mode"] for r in gen["refits"]] == modes
        assert all(r["planners"] == {s: "link" for s in range(train)}
                   for r in gen["refits"]), gen["refits"]


def test_a_side_with_another_planner_is_refused_by_name_before_bytes_move(runs):
    for who, res in enumerate(runs):
        refused = res["refused"]
        assert refused["type"] == "PlanMismatchError", (who, refused)
        assert "planner differs" in refused["error"], (who, refused)
        assert "'default' on group rank(s) [0]" in refused["error"], (who, refused)
        assert "'auto' on group rank(s) [1, 2, 3, 4]" in refused["error"], (who, refused)
    assert all(gen["unchanged"] for gen in runs[1:])


def _messages(plans) -> dict:
    """Messages (ops between two ranks) per group rank over the plans."""
    out: dict = {}
    for plan in plans:
        for op in plan.ops:
            if op.src != op.dst:
                out[op.src] = out.get(op.src, 0) + 1
                out[op.dst] = out.get(op.dst, 0) + 1
    return dict(sorted(out.items()))


def test_the_test_layout_plans_differ_and_the_counts_are_reported(runs, capsys):
    from megatron_reshard.refit.order import bulk_transfers, stage_params
    from megatron_reshard.wire.codec import decode_payload

    payload = decode_payload(runs[1]["payload"])
    keys = [layout_key(t.global_shape, t.src_mesh, t.src_placements, t.dst_mesh,
                       t.dst_placements) for t in bulk_transfers(stage_params(payload)[0])]
    nodes = [node_code("train-node")] + [node_code(f"gen-node-{g % 2}") for g in range(GEN)]
    costs = choose_costs("auto", nodes, 1.0)
    assert costs is not None and choose_costs("auto", [nodes[1]] * 5, 1.0) is None
    plain = _messages(build_plan(k) for k in keys)
    link = _messages(build_plan(k, costs) for k in keys)
    with capsys.disabled():
        print(f"\nmessages per group rank, default planner: {plain}; link-aware: {link}")
    assert plain != link  # else the link-aware refits above proved nothing new


def test_a_planner_mismatch_names_the_values_and_the_option():
    text = plan_mismatch_text(["transfers", "planner"], [[3, 7, PLANNERS.index("default")],
                                                         [3, 7, PLANNERS.index("link")]])
    assert text.startswith("planner differs ('default' on group rank(s) [0]; 'link' on group "
                           "rank(s) [1])"), text
    assert "RefitSender(planner=...)" in text
