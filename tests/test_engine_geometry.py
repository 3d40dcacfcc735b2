"""Geometry: DTensor chunk rules, nested shard axes, arbitrary rank lists, strided pieces."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.geometry import (REPLICATE, Piece, box_intersect, mesh_coords,
                                              placement_dims, shard_box, shard_ownerships)


def _rows(n, m):
    own = shard_ownerships((n, 2), (m,), tuple(range(m)), (0,))
    return [own[r].local_shape[0] for r in range(m)]


def test_ten_rows_over_four_ranks_are_3_3_3_1():
    assert _rows(10, 4) == [3, 3, 3, 1]


def test_five_rows_over_four_ranks_leave_the_last_chunk_empty():
    own = shard_ownerships((5, 2), (4,), (0, 1, 2, 3), (0,))
    assert [own[r].local_shape for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    assert own[3].pieces == ()  # an empty shard owns nothing


def test_two_mesh_axes_sharding_one_dim_apply_in_axis_order():
    # axis 0 splits 10 rows 5/5, then axis 1 splits each half 3/2
    boxes = [shard_box((10,), (2, 2), c, (0, 0)) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert boxes == [((0, 3),), ((3, 5),), ((5, 8),), ((8, 10),)]


def test_unordered_rank_list_uses_row_major_positions():
    coords = mesh_coords((2, 2), (7, 3, 5, 0))
    assert coords == {7: (0, 0), 3: (0, 1), 5: (1, 0), 0: (1, 1)}
    own = shard_ownerships((4, 4), (2, 2), (7, 3, 5, 0), (0, 1))
    assert own[3].boxes == (((0, 2), (2, 4)),)


def test_replicate_owns_everything_on_every_rank():
    own = shard_ownerships((3, 4), (2,), (4, 1), (REPLICATE,))
    assert own[4].boxes == own[1].boxes == (((0, 3), (0, 4)),)


def test_placements_accept_torch_and_wire_forms_and_normalise_negative_dims():
    assert placement_dims([Shard(-1), Replicate(), {"dim": 0}, {}], 3) == (2, REPLICATE, 0, REPLICATE)


def test_invalid_shard_dim_is_rejected_with_expected_range():
    with pytest.raises(ValueError, match=r"invalid shard dim: Shard\(2\).*\[-2, 2\)"):
        placement_dims([Shard(2)], 2)


def test_strided_piece_maps_a_box_onto_every_second_local_row():
    local = torch.arange(12).reshape(6, 2)
    piece = Piece(box=((10, 13), (0, 2)), local=((1, 2), (0, 1)))
    assert piece.view(local, ((11, 13), (1, 2))).flatten().tolist() == [7, 11]


def test_box_intersection_is_none_when_disjoint():
    assert box_intersect(((0, 2), (0, 3)), ((2, 4), (0, 3))) is None
    assert box_intersect(((0, 3), (1, 3)), ((2, 4), (0, 2))) == ((2, 3), (1, 2))


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    dims = tuple(draw(st.sampled_from([REPLICATE] + list(range(ndim)))) for _ in mesh_shape)
    coord = tuple(draw(st.integers(0, m - 1)) for m in mesh_shape)
    return shape, mesh_shape, dims, coord


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_boxes_match_dtensor_local_shape_and_offset(layout):
    torch_utils = pytest.importorskip("torch.distributed.tensor._utils")
    shape, mesh_shape, dims, coord = layout
    placements = [Replicate() if d == REPLICATE else Shard(d) for d in dims]
    local_shape, offset = torch_utils._compute_local_shape_and_global_offset(
        shape, mesh_shape, list(coord), placements)
    box = shard_box(shape, mesh_shape, coord, dims)
    assert tuple(e - s for s, e in box) == tuple(local_shape)
    for (s, e), off in zip(box, offset):
        if e > s:
            assert s == off


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_boxes_match_nested_torch_chunk(layout):
    shape, mesh_shape, dims, coord = layout
    full = torch.arange(max(1, torch.Size(shape).numel())).reshape(-1)[: torch.Size(shape).numel()]
    full = full.reshape(shape)
    expect = full
    for axis, d in enumerate(dims):
        if d == REPLICATE:
            continue
        parts = torch.chunk(expect, mesh_shape[axis], dim=d)
        c = coord[axis]
        expect = parts[c] if c < len(parts) else expect.narrow(d, expect.shape[d], 0)
    box = shard_box(shape, mesh_shape, coord, dims)
    got = full[tuple(slice(s, e) for s, e in box)]
    assert got.shape == expect.shape and torch.equal(got, expect)
