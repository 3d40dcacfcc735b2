"""The shared refit loop: payload order, bounded batches, local checks, plan fingerprints, and
a real multi-process refit with hooks on both sides."""

import dataclasses
import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.groups.comm import create_refit_group
from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info
from megatron_reshard.layout.geometry import box_index, rank_box
from megatron_reshard.refit.loop import PlanMismatchError, RefitLoop
from megatron_reshard.refit.order import batch_bounds, misc_items_by_stage, plan_fingerprint, stage_params
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx
from megatron_reshard.testing.groups import NoCommGroup
from vote_count import VoteCount


def _chunked(full, mesh_shape, coord, placements):
    t = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = torch.chunk(t, mesh_shape[axis], dim=p.dim)
            t = chunks[coord[axis]] if coord[axis] < len(chunks) else t.narrow(p.dim, 0, 0)
    return t


@pytest.mark.parametrize("shape,mesh_shape,placements", [
    ((10, 6), (4,), [Shard(0)]),                      # 3,3,3,1
    ((5, 6), (2, 2), [Shard(0), Shard(0)]),           # same dim twice, axis order
    ((3, 7), (2, 4), [Shard(1), Shard(0)]),           # trailing chunks empty
    ((8, 4, 6), (2, 3), [Replicate(), Shard(2)]),
    ((2, 9), (3, 2), [Shard(1), Replicate()]),
])
def test_rank_box_follows_dtensor_chunk_rules(shape, mesh_shape, placements):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    ranks = torch.arange(10, 10 + torch.Size(mesh_shape).numel()).reshape(mesh_shape)
    mesh = MeshInfo(ranks)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        rank = int(ranks[coord])
        region = rank_box(shape, mesh, placements, rank)
        assert torch.equal(full[box_index(region)], _chunked(full, mesh_shape, coord, placements))
    assert rank_box(shape, mesh, placements, 3) is None


def _info(pp=1):
    meta = {f"model.layers.{i}.mlp.{proj}.weight": {"shape": [8, 4] if proj != "down_proj" else [4, 8],
                                                   "dtype": "torch.float32"}
            for i in (2, 0, 1) for proj in ("gate_proj", "up_proj", "down_proj")}
    stages = {f"model.layers.{i}": (0 if i < 2 else 1) for i in range(3)} if pp > 1 else None
    return build_nccl_reshard_refit_info(meta, {"tp_size": 2, "pp_size": pp}, {"tp_size": 2},
                                         2 * pp, 2, stages)


def test_params_follow_layer_names_then_per_layer_order():
    info = _info()
    info["layer_names"] = ["model.layers.1", "model.layers.2", "model.layers.0"]
    names = [p.name for p in stage_params(info)[0]]
    assert names[:3] == [f"model.layers.1.mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
    assert names[3].startswith("model.layers.2.") and names[-1].startswith("model.layers.0.")
    staged = stage_params(_info(pp=2))
    assert sorted(staged) == [0, 1] and len(staged[0]) == 6 and len(staged[1]) == 3
    info["layer_names"].remove("model.layers.0")
    with pytest.raises(ValueError, match=r"missing from layer_names: \['model.layers.0'\]"):
        stage_params(info)


def test_batches_are_bounded_by_global_bytes_and_never_empty():
    params = stage_params(_info())[0]  # 9 params of 128 bytes
    assert batch_bounds(params, 1) == [(i, i + 1) for i in range(9)]
    assert batch_bounds(params, 300) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)]
    assert batch_bounds(params, 1 << 30) == [(0, 9)]


def test_misc_items_keep_payload_order_and_need_a_stage_under_pp():
    entries = [{"name": "b", "shape": [2], "dtype": "torch.bfloat16", "pp_stage": 1},
               {"name": "a", "shape": [3, 1], "dtype": "torch.float32", "pp_stage": 0},
               {"name": "c", "shape": [], "dtype": "torch.float32", "pp_stage": 1}]
    expected = {1: [("b", (2,), torch.bfloat16), ("c", (), torch.float32)],
                0: [("a", (3, 1), torch.float32)]}
    assert misc_items_by_stage({"pp_size": 2, "other_params": entries}) == expected
    as_dict = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in entries}
    assert misc_items_by_stage({"pp_size": 2, "other_params": as_dict}) == expected
    del entries[2]["pp_stage"]
    with pytest.raises(ValueError, match=r"other_params\['c'\] has no 'pp_stage'"):
        misc_items_by_stage({"pp_size": 2, "other_params": entries})
    with pytest.raises(ValueError, match="repeated name"):
        misc_items_by_stage({"pp_size": 2, "other_params": entries[:2] + entries[:1]})


def test_fingerprint_changes_with_every_described_field():
    params = stage_params(_info())[0]
    base = plan_fingerprint(params)
    assert base == plan_fingerprint([dataclasses.replace(p) for p in params])

    def changed(i, **kw):
        out = list(params)
        out[i] = dataclasses.replace(out[i], **kw)
        return plan_fingerprint(out)

    assert changed(0, name="x") != base
    assert changed(0, global_shape=(8, 5)) != base
    assert changed(0, dtype="torch.bfloat16") != base
    assert changed(0, dst_mesh_info=MeshInfo(torch.tensor([3, 2]))) != base
    assert changed(0, src_placements=(Replicate(),)) != base
    assert plan_fingerprint(params[::-1]) != base
    assert plan_fingerprint(params, [("a", (1,), torch.float32)]) != base


def test_local_problems_are_reported_before_any_communication():
    info = _info()
    params = stage_params(info)[0]
    specs = HFToLocalParamMap({p.name: LocalParamSpec(base=torch.zeros(4, 4) if "down" not in p.name
                                                         else torch.zeros(4, 4))
                               for p in params})
    group = NoCommGroup(3, 4)  # dst group rank 3 = gen rank 1; any communication would raise
    RefitLoop(info, specs, "dst", {0: group})
    missing = HFToLocalParamMap(dict(specs.specs))
    del missing.specs["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: no local spec on dst "
                                         r"group rank 3 of stage 0"):
        RefitLoop(info, missing, "dst", {0: group})
    wrong = HFToLocalParamMap({**specs.specs, "model.layers.2.mlp.down_proj.weight":
                               LocalParamSpec(base=torch.zeros(4, 8))})
    with pytest.raises(ValueError, match=r"down_proj\.weight: dst group rank 3 .*shape \[4, 4\].*shape \[4, 8\]"):
        RefitLoop(info, wrong, "dst", {0: group})
    half = HFToLocalParamMap({**specs.specs, "model.layers.1.mlp.gate_proj.weight":
                              LocalParamSpec(base=torch.zeros(4, 4, dtype=torch.float16))})
    with pytest.raises(ValueError, match=r"wire dtype torch\.float32 but local tensor dtype torch\.float16"):
        RefitLoop(info, half, "dst", {0: group})
    with pytest.raises(ValueError, match=r"stage 1, but the payload has pp_size=1"):
        RefitLoop(info, specs, "dst", {1: group})


# ------------------------------------------------------------------- multi-process

E, I, H, F = 4, 6, 4, 8


def _loop_info():
    meta = {"model.layers.0.mlp.gate_proj.weight": {"shape": [F, H], "dtype": "torch.float32"},
            "model.layers.0.mlp.down_proj.weight": {"shape": [H, F], "dtype": "torch.float32"}}
    for e in range(E):
        meta[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = {"shape": [I, H], "dtype": "torch.float32"}
    return build_nccl_reshard_refit_info(meta, {"tp_size": 2, "ep_size": 2}, {"tp_size": 2}, 2, 2)


def _global(name):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shape = {"gate_proj": (F, H), "down_proj": (H, F), "up_proj": (E, I, H)}[name.split(".")[-2]]
    return torch.randn(shape, generator=g)


def _loop_job(job):
    info = _loop_info()
    group = create_refit_group(job.host, job.port, job.rank, 4, "gloo", 30.0)
    side = "src" if job.rank < 2 else "dst"
    params = stage_params(info)[0]
    specs, finals = HFToLocalParamMap(), {}
    for p in params:
        region = rank_box(p.global_shape, p.mesh(side), p.placements(side), job.rank)
        full = _global(p.name)
        if side == "src" and p.grouped_expert_proj:
            # the sender keeps its experts apart and stacks them in a pre hook
            experts = [full[e] for e in range(*region[0])]
            specs.specs[p.name] = LocalParamSpec(
                base=experts, pre=lambda base: RefitCtx(buf=torch.stack(base)))
        elif side == "src":
            specs.specs[p.name] = LocalParamSpec(base=full[box_index(region)].clone())
        else:
            final = torch.full([b - a for a, b in region], float("nan"))
            finals[p.name] = (final, full[box_index(region)])
            specs.specs[p.name] = LocalParamSpec(
                base=final, pre=lambda base: RefitCtx(buf=torch.empty_like(base), extra={"out": base}),
                post=lambda ctx: ctx.extra["out"].copy_(ctx.buf))
    results = {}
    from megatron_reshard.engine import xfer_batch_reference

    for label, kwargs in (("engine", {"batch_bytes": 1}), ("reference", {"xfer_batch": xfer_batch_reference})):
        for final, _ in finals.values():
            final.fill_(float("nan"))
        stats = RefitLoop(info, specs, side, {0: group}, **kwargs).run()
        results[label] = (all(torch.equal(a, b) for a, b in finals.values()), stats.as_dict())
    # the same loop run three times: votes per run (one per batch, then one for the first
    # batch only, as no call has followed the last batch yet, then none) and exactness
    loop, results["runs"] = RefitLoop(info, specs, side, {0: group}, batch_bytes=1), []
    with VoteCount() as counted:
        for _ in range(3):
            for final, _ in finals.values():
                final.fill_(float("nan"))
            before = counted.count
            loop.run()
            results["runs"].append((counted.count - before,
                                    all(torch.equal(a, b) for a, b in finals.values())))
    # one side adds the misc layout to its plan, the other does not: caught at setup on both
    misc = {0: [("model.norm.weight", (H,), torch.float32)]} if side == "dst" else None
    try:
        RefitLoop(info, specs, side, {0: group}, misc_items=misc).run()
        results["mismatch"] = None
    except PlanMismatchError as err:
        results["mismatch"] = str(err)
    # batching is part of the plan: different batch_bytes on the two sides is a mismatch too
    try:
        RefitLoop(info, specs, side, {0: group}, batch_bytes=1 if side == "src" else 1 << 20).verify_plan()
        results["batching"] = None
    except PlanMismatchError as err:
        results["batching"] = str(err)
    # checksums on one side only: the setting is named, nothing else
    try:
        RefitLoop(info, specs, side, {0: group}, verify_checksums=side == "src").verify_plan()
        results["checksums"] = None
    except PlanMismatchError as err:
        results["checksums"] = str(err)
    # a pre hook that builds a wrong buffer on one rank: every rank gets an error, none hangs
    bad = HFToLocalParamMap(dict(specs.specs))
    if job.rank == 0:
        bad.specs["model.layers.0.mlp.down_proj.weight"] = LocalParamSpec(
            base=None, pre=lambda base: RefitCtx(buf=torch.zeros(3, 3)))
    try:
        RefitLoop(info, bad, side, {0: group}).run()
        results["bad_pre"] = None
    except ValueError as err:
        results["bad_pre"] = str(err)
    return results


def test_refit_loop_moves_params_through_hooks_and_catches_plan_mismatch(pool):
    results = pool.run(_loop_job, 4, timeout_s=90)
    for rank, res in enumerate(results):
        assert res["engine"][0] and res["reference"][0], rank
        assert res["engine"][1]["params"] == 3
        assert res["engine"][1]["stages"][0]["batches"] == 3  # batch_bytes=1: one param per batch
        assert res["reference"][1]["stages"][0]["batches"] == 1
        assert res["runs"] == [(3, True), (1, True), (0, True)], res["runs"]
        assert "refit plan mismatch in the group of PP stage 0" in res["mismatch"]
        # each mismatch names exactly the setting that differs, with the ranks on each side
        assert "misc_items differs (none given on group rank(s) [0, 1]; " in res["mismatch"]
        assert "batch_bytes" not in res["mismatch"], res["mismatch"]
        assert "batch_bytes differs (1 on group rank(s) [0, 1]; 1048576 on group rank(s) " \
               "[2, 3]): pass the same batch_bytes on every rank" in res["batching"]
        assert "misc_items" not in res["batching"] and "staging" not in res["batching"]
        assert "verify_checksums differs (True on group rank(s) [0, 1]; False on group " \
               "rank(s) [2, 3]): pass the same verify_checksums on both sides" in res["checksums"]
        for other in ("batch_bytes", "staging_bytes", "misc_items", "transfer list"):
            assert other not in res["checksums"], res["checksums"]
        assert res["bad_pre"] and "down_proj" in res["bad_pre"], res["bad_pre"]
