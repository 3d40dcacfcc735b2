"""Integrity: the plan proves every destination element is written exactly once, and the
refit checksums tile, see what a swap or a misplaced row does, and count replicas once."""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.wire.records import ParamRecord
from megatron_reshard.engine.plan import Planner, layout_key
from megatron_reshard.engine.plan_check import PlanError, check_writes_exactly_once
from megatron_reshard.refit.integrity import (
    ChecksumTable,
    box_checksum,
    is_canonical_holder,
    mismatches,
    source_overlaps,
)
from megatron_reshard.layout.placements import MeshInfo


def _plan(shape=(10, 6)):
    key = layout_key(shape, MeshInfo(torch.tensor([0, 1])), [Shard(0)],
                     MeshInfo(torch.tensor([[2, 3], [4, 5]])), [Replicate(), Shard(1)])
    return Planner().plan(key)


def test_a_built_plan_writes_every_destination_element_once():
    check_writes_exactly_once(_plan())  # Planner.plan ran it too


def test_a_plan_missing_an_op_is_refused():
    plan = _plan()
    broken = dataclasses.replace(plan, ops=plan.ops[:-1])
    with pytest.raises(PlanError, match=r"destination rank \d+, piece 0 .*ops write \d+ elements"):
        check_writes_exactly_once(broken)


def test_a_plan_writing_an_element_twice_is_refused():
    plan = _plan()
    broken = dataclasses.replace(plan, ops=plan.ops + plan.ops[:1])
    with pytest.raises(PlanError, match=r"ops write \d+ elements|overlap"):
        check_writes_exactly_once(broken)


def test_checksums_of_tiles_add_up_to_the_whole():
    full = torch.randn(10, 7, 3).to(torch.bfloat16)
    whole = box_checksum(full, ((0, 10), (0, 7), (0, 3)), (0, 0, 0))
    parts = 0
    for rows in ((0, 4), (4, 10)):
        for cols in ((0, 2), (2, 7)):
            local = full[slice(*rows), slice(*cols)].clone()
            parts += int(box_checksum(local, (rows, cols, (0, 3)), (rows[0], cols[0], 0)))
    assert int(whole) == parts % ((1 << 31) - 1)


def test_checksums_see_swapped_halves_and_misplaced_rows():
    full = torch.randn(8, 16).to(torch.bfloat16)
    box = ((0, 8), (0, 16))
    ref = int(box_checksum(full, box, (0, 0)))
    swapped = torch.cat([full[4:], full[:4]])  # gate and up exchanged
    moved = full.clone()
    moved[[1, 2]] = moved[[2, 1]]
    flipped = full.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # one bit
    for bad in (swapped, moved, flipped):
        assert int(box_checksum(bad, box, (0, 0))) != ref


def test_only_the_first_replica_counts_and_overlaps_cover_each_destination():
    mesh = MeshInfo(torch.tensor([[0, 1], [2, 3]]))  # axis 0 replicates, axis 1 shards dim 0
    placements = [Replicate(), Shard(0)]
    assert [is_canonical_holder(mesh, placements, r) for r in range(4)] == [True, True, False, False]
    param = ParamRecord.from_entry({
        "name": "w", "dtype": "torch.float32", "global_shape": (6, 4), "src_mesh_info": mesh,
        "src_placements": placements, "dst_mesh_info": MeshInfo(torch.tensor([4, 5, 6])),
        "dst_placements": [Shard(0)]})
    got = {r: source_overlaps(param, r) for r in range(4)}
    assert got[2] == [] and got[3] == []
    assert got[0] == [(4, ((0, 2), (0, 4))), (5, ((2, 3), (0, 4)))]
    assert got[1] == [(5, ((3, 4), (0, 4))), (6, ((4, 6), (0, 4)))]


def test_a_receiver_finds_the_param_whose_bytes_differ():
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    table = ChecksumTable(group_size=2, num_params=2)
    table.add(1, 0, box_checksum(full, ((0, 6), (0, 4)), (0, 0)))
    table.add(1, 1, box_checksum(full[:3], ((0, 3), (0, 4)), (0, 0)))
    wrong = full[:3].clone()
    wrong[0, 0] = 99
    got = {0: box_checksum(full, ((0, 6), (0, 4)), (0, 0)),
           1: box_checksum(wrong, ((0, 3), (0, 4)), (0, 0))}
    assert mismatches(table.dense(torch.device("cpu"))[1], got, ["a", "b"]) == ["b"]
