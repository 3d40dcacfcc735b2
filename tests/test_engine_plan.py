"""Plans and schedules, checked by hand and by simulating them in one process."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.engine.schedule import build_schedule, cut_box
from megatron_reshard.layout.geometry import REPLICATE, box_numel
from megatron_reshard.engine.param_plan import build_plan
from megatron_reshard.engine.plan import Planner, layout_key
from megatron_reshard.layout.placements import MeshInfo
from hash_seeds import outputs_under_two_hash_seeds


def _key(shape, src_ranks, src_pl, dst_ranks, dst_pl):
    sm = MeshInfo(torch.tensor(src_ranks))
    dm = MeshInfo(torch.tensor(dst_ranks))
    return layout_key(shape, sm, src_pl, dm, dst_pl)


def _ops(plan):
    return [(op.phase, op.src, op.dst, op.box) for op in plan.ops]


def test_shard0_to_shard1_sends_each_quarter_once():
    plan = build_plan(_key((4, 6), [0, 1], [Shard(0)], [2, 3], [Shard(1)]))
    assert _ops(plan) == [
        (0, 0, 2, ((0, 2), (0, 3))), (0, 1, 2, ((2, 4), (0, 3))),
        (0, 0, 3, ((0, 2), (3, 6))), (0, 1, 3, ((2, 4), (3, 6))),
    ]


def test_ranks_on_both_sides_copy_locally():
    plan = build_plan(_key((10,), [0, 1], [Shard(0)], [0, 1], [Shard(0)]))
    assert _ops(plan) == [(0, 0, 0, ((0, 5),)), (0, 1, 1, ((5, 10),))]


def test_destination_replicas_get_stripes_then_exchange_them():
    plan = build_plan(_key((10, 3), [0, 1], [Shard(0)], [2, 3], [Replicate()]))
    assert _ops(plan) == [
        (0, 0, 2, ((0, 5), (0, 3))), (0, 1, 3, ((5, 10), (0, 3))),
        (1, 2, 3, ((0, 5), (0, 3))), (1, 3, 2, ((5, 10), (0, 3))),
    ]


def test_replicated_sources_are_deduplicated_and_spread():
    plan = build_plan(_key((8, 2), [0, 1], [Replicate()], [2, 3], [Shard(0)]))
    assert _ops(plan) == [(0, 0, 2, ((0, 4), (0, 2))), (0, 1, 3, ((4, 8), (0, 2)))]


def test_a_destination_that_holds_the_source_copies_locally():
    plan = build_plan(_key((6,), [0, 1], [Replicate()], [1, 2], [Replicate()]))
    assert _ops(plan) == [(0, 1, 1, ((0, 6),)), (0, 0, 2, ((0, 6),))]


def test_stripes_go_to_the_member_that_already_holds_them():
    # dst mesh order [1, 0]: stripe rows 0-4 still goes to rank 0, which holds them.
    plan = build_plan(_key((10,), [0, 1], [Shard(0)], [1, 0], [Replicate()]))
    assert [op for op in _ops(plan) if op[0] == 0] == [(0, 0, 0, ((0, 5),)), (0, 1, 1, ((5, 10),))]


def test_a_region_too_small_to_stripe_is_broadcast_by_one_member():
    plan = build_plan(_key((2,), [0], [Replicate()], [1, 2, 3], [Replicate()]))
    assert _ops(plan) == [(0, 0, 1, ((0, 2),)), (1, 1, 2, ((0, 2),)), (1, 1, 3, ((0, 2),))]


def test_planner_caches_by_plain_key():
    planner = Planner()
    k1 = _key((8, 2), [0, 1], [Shard(0)], [2], [Replicate()])
    k2 = _key((8, 2), [0, 1], [Shard(0)], [2], [Replicate()])
    assert planner.plan(k1) is planner.plan(k2) and len(planner) == 1
    planner.clear()
    assert len(planner) == 0


def test_fingerprint_changes_with_the_layout():
    a = build_plan(_key((8, 2), [0, 1], [Shard(0)], [2, 3], [Shard(1)])).fingerprint
    b = build_plan(_key((8, 2), [0, 1], [Shard(0)], [3, 2], [Shard(1)])).fingerprint
    assert a != b


def test_fingerprint_is_stable_across_processes():
    code = ("import torch; from torch.distributed.tensor import Shard, Replicate;"
            "from megatron_reshard.engine.param_plan import build_plan;"
            "print(build_plan(((8, 2), (2,), (0, 1), (0,), (2,), (2, 3), (-1,))).fingerprint)")
    out = outputs_under_two_hash_seeds(code)
    here = build_plan(((8, 2), (2,), (0, 1), (0,), (2,), (2, 3), (REPLICATE,))).fingerprint
    assert out == {here}


def test_placement_count_must_match_mesh_ndim():
    with pytest.raises(ValueError, match=r"placement count != mesh ndim: expected 2"):
        _key((4,), [[0, 1], [2, 3]], [Shard(0)], [4], [Replicate()])


@pytest.mark.parametrize("room", [0, 3, 4, 40, 100, 1000])
def test_cut_box_takes_the_longest_row_major_prefix_that_fits(room):
    box = ((1, 4), (0, 5), (2, 9))
    head, rest = cut_box(box, 4, room)
    order = [(i, j, k) for i in range(1, 4) for j in range(0, 5) for k in range(2, 9)]

    def cells(b):
        return [(i, j, k) for i in range(*b[0]) for j in range(*b[1]) for k in range(*b[2])]

    taken = [] if head is None else cells(head)
    assert len(taken) * 4 <= room
    assert taken == order[:len(taken)]  # a prefix, in row-major order
    assert [c for b in rest for c in cells(b)] == order[len(taken):]
    # as long as one box can be: a whole row of the last dim, then whole blocks
    assert len(taken) >= min(room // 4, 7)
    if room >= 4:
        assert head is not None


def test_balanced_rounds_carry_every_pair_at_once():
    # 2 sources x 2 destinations, 1 KiB per pair, 1 KiB budget: two rounds, all four pairs
    # in each (not two rounds of disjoint pairs)
    plan = build_plan(((64, 64), (2,), (0, 1), (0,), (2,), (2, 3), (1,)))
    rounds = {}
    for r in range(4):
        for rnd in build_schedule([plan], [1], r, 1024).rounds:
            rounds.setdefault(rnd.index, set()).update(
                (r, m.peer) for m in rnd.messages if m.is_send)
    assert rounds == {0: {(0, 2), (0, 3), (1, 2), (1, 3)},
                      1: {(0, 2), (0, 3), (1, 2), (1, 3)}}


# ---- property tests: random layouts, simulated in one process -----------------------


@st.composite
def layout_keys(draw, max_rank=6):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    sides = []
    for _ in range(2):
        mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
        n = 1
        for m in mesh_shape:
            n *= m
        if n > max_rank:
            mesh_shape, n = (n % max_rank or 1,), n % max_rank or 1
        ranks = tuple(draw(st.permutations(range(max_rank)))[:n])
        dims = tuple(draw(st.sampled_from([REPLICATE] + list(range(ndim))))
                     for _ in mesh_shape)
        sides += [mesh_shape, ranks, dims]
    return (shape, *sides)


def _simulate(plan, key):
    """Run the plan's ops on in-memory tensors; return (dst tensors, full tensor)."""
    shape = key[0]
    full = torch.arange(1, box_numel(tuple((0, n) for n in shape)) + 1,
                        dtype=torch.int64).reshape(shape)
    src = {r: full[tuple(slice(s, e) for s, e in own.pieces[0].box)].clone()
           if own.pieces else torch.empty(own.local_shape, dtype=torch.int64)
           for r, own in plan.src.items()}
    dst = {r: torch.zeros(own.local_shape, dtype=torch.int64) for r, own in plan.dst.items()}
    written = {r: 0 for r in dst}
    for op in plan.ops:  # phase 0 precedes phase 1 in plan order
        if op.phase == 0:
            data = plan.src[op.src].pieces[op.src_piece].view(src[op.src], op.box)
        else:
            data = plan.dst[op.src].pieces[op.src_piece].view(dst[op.src], op.box)
        plan.dst[op.dst].pieces[op.dst_piece].view(dst[op.dst], op.box).copy_(data)
        written[op.dst] += box_numel(op.box)
    return dst, full, written


@settings(max_examples=400, deadline=None)
@given(layout_keys())
def test_simulated_plans_deliver_every_destination_region_exactly_once(key):
    plan = build_plan(key)
    dst, full, written = _simulate(plan, key)
    for r, own in plan.dst.items():
        expect = full[tuple(slice(s, e) for s, e in own.pieces[0].box)] if own.pieces else None
        if expect is not None:
            assert torch.equal(dst[r], expect), (key, r)
        assert written[r] == sum(box_numel(p.box) for p in own.pieces), (key, r)


@settings(max_examples=300, deadline=None)
@given(layout_keys())
def test_each_destination_group_pulls_its_region_from_sources_at_most_once(key):
    plan = build_plan(key)
    groups = {}
    for r, own in plan.dst.items():
        if own.pieces:
            groups.setdefault(own.boxes, []).append(r)
    for boxes, members in groups.items():
        remote = sum(box_numel(op.box) for op in plan.ops
                     if op.phase == 0 and op.dst in members and op.src != op.dst)
        assert remote <= sum(box_numel(b) for b in boxes), (key, members)


@settings(max_examples=200, deadline=None)
@given(layout_keys(), st.sampled_from([64, 100, 256, 4096]),
       st.one_of(st.none(), st.sets(st.tuples(st.integers(0, 5), st.integers(0, 3)))))
def test_schedules_match_between_peers_and_respect_the_staging_budget(key, cap, strided):
    plan = build_plan(key)
    plans, sizes = [plan, plan], [2, 8]
    ranks = sorted(set(key[2]) | set(key[5]))
    scheds = {r: build_schedule(plans, sizes, r, cap, strided) for r in ranks}
    by_round = {}
    for r, sched in scheds.items():
        phases = [rnd.phase for rnd in sched.rounds]
        assert phases == sorted(phases)
        for rnd in sched.rounds:
            # direct messages are not staged
            assert sum(m.nbytes for m in rnd.messages if not m.direct) <= cap
            for m in rnd.messages:
                s, d = (r, m.peer) if m.is_send else (m.peer, r)
                if m.direct:
                    assert strided is not None and len(m.segments) == 1
                    ti = m.segments[0].ti
                    assert (s, 2 * ti + (0 if rnd.phase == 0 else 1)) not in strided
                    assert (d, 2 * ti + 1) not in strided
                sig = (rnd.phase, rnd.index, m.tag, m.nbytes, m.direct,
                       [(sg.ti, sg.box, sg.offset) for sg in m.segments])
                by_round.setdefault((s, d, rnd.phase, m.tag), []).append((m.is_send, sig))
    for entries in by_round.values():  # every message is posted once by each end, alike
        assert sorted(e[0] for e in entries) == [False, True]
        assert entries[0][1] == entries[1][1]
    moved = sum(sg.nbytes for s in scheds.values() for rnd in s.rounds
                for m in rnd.messages if m.is_send for sg in m.segments)
    expect = sum(box_numel(op.box) * isz for p, isz in zip(plans, sizes)
                 for op in p.ops if op.src != op.dst)
    assert moved == expect


def test_large_staged_traffic_takes_two_rounds_even_when_one_would_fit():
    # 1 -> 1, [4096, 8192] bf16 (64 MiB) into a strided destination, 256 MiB budget: two
    # rounds of 32 MiB, so that the unpack of the first overlaps the second's transfer;
    # a quarter of it (16 MiB) stays in one round
    mib = 1 << 20
    for rows, expect in ((4096, [32, 32]), (1024, [16])):
        plan = build_plan(((rows, 8192), (1,), (0,), (0,), (1,), (1,), (1,)))
        rounds = build_schedule([plan], [2], 0, 256 * mib, {(1, 1)}).rounds
        assert [[m.nbytes / mib for m in rnd.messages] for rnd in rounds] == [[e] for e in expect]


def test_contiguous_regions_go_whole_in_one_round_whatever_the_budget():
    # 1 -> 1, the whole [64, 64] tensor: one direct message when both tensors are
    # standard-contiguous; 4 staged rounds of 1 KiB when the destination is strided
    plan = build_plan(((64, 64), (1,), (0,), (0,), (1,), (1,), (1,)))
    direct = build_schedule([plan], [1], 0, 1024, set()).rounds
    assert [(m.nbytes, m.direct) for rnd in direct for m in rnd.messages] == [(4096, True)]
    staged = build_schedule([plan], [1], 0, 1024, {(1, 1)}).rounds
    assert [(m.nbytes, m.direct) for rnd in staged for m in rnd.messages] == [(1024, False)] * 4
