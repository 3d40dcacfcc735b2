"""The warm call's fast host path (issue 15): the local checks mapped in C give the detailed
checks' verdict, the cached layout rows and program keys catch what changed, and a warm
batch whose inputs change in place is still exact or refused on every rank; a repeated
call's lane (issue 35, engine/lane.py) misses on every such change."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.engine import Planner, Transfer
from megatron_reshard.engine.batch import kept_rows, layout_rows
from megatron_reshard.engine.checks import check_local, expected, local_ok
from megatron_reshard.engine.members import stride_keys
from megatron_reshard.engine.plan import layout_key
from megatron_reshard.layout.placements import MeshInfo

BF16 = torch.bfloat16


def _transfers():
    """Rank 0's view: a [8, 6] S(0) over [0, 1] -> Replicate on [1] (src [4, 6], no dst),
    and a [5] Replicate on [0] -> Replicate on [0, 1] (src and dst [5])."""
    both, one0, one1 = (MeshInfo(torch.tensor(r)) for r in ([0, 1], [0], [1]))
    return [Transfer("a", (8, 6), BF16, both, [Shard(0)], one1, [Replicate()],
                     torch.zeros(4, 6, dtype=BF16), None),
            Transfer("b", (5,), torch.float32, one0, [Replicate()], both, [Replicate()],
                     torch.zeros(5), torch.zeros(5))]


def _plans(transfers):
    planner = Planner()
    return [planner.plan(layout_key(t.global_shape, t.src_mesh, t.src_placements,
                                    t.dst_mesh, t.dst_placements)) for t in transfers]


def _expected(transfers, plans, me):
    shapes, dtypes = [], []
    for t, p in zip(transfers, plans):
        for own in (p.src.get(me), p.dst.get(me)):
            shapes.append(None if own is None else own.local_shape)
            dtypes.append(None if own is None else t.dtype)
    return expected(shapes, dtypes)


BAD = {
    "wrong shape": lambda ts: setattr(ts[0], "src", torch.zeros(6, 4, dtype=BF16)),
    "wrong dtype": lambda ts: setattr(ts[1], "dst", torch.zeros(5, dtype=torch.float64)),
    "tensor on a non-dst rank": lambda ts: setattr(ts[0], "dst", torch.zeros(8, 6, dtype=BF16)),
    "missing src": lambda ts: setattr(ts[1], "src", None),
    "not a tensor": lambda ts: setattr(ts[1], "src", [0.0] * 5),
    "meta device": lambda ts: setattr(ts[1], "dst", torch.zeros(5, device="meta")),
}


@pytest.mark.parametrize("bad", [None, *BAD])
def test_the_fast_local_checks_give_the_detailed_checks_verdict(bad):
    ts = _transfers()
    plans = _plans(ts)
    if bad is not None:
        BAD[bad](ts)
    tensors: list = []
    ok, device = local_ok(ts, _expected(ts, plans, 0), "cpu", tensors)
    problem, detailed_device = check_local(ts, plans, 0, "cpu")
    assert ok == (problem is None), problem
    assert tensors == [x for t in ts for x in (t.src, t.dst)] or bad == "not a tensor"
    if ok:
        assert device == detailed_device == torch.device("cpu")


def test_kept_rows_copy_given_lists_so_a_change_in_place_misses():
    ts = _transfers()
    rows = layout_rows(ts)
    kept = kept_rows(rows)
    assert kept == rows
    assert kept[0][4] is not ts[0].src_placements  # a list: copied
    ts[0].src_placements[0] = Shard(1)
    assert layout_rows(ts) != kept
    as_tuples = [Transfer("t", (4,), BF16, ts[1].src_mesh, (Replicate(),), ts[1].dst_mesh,
                          (Replicate(),))]
    rows = layout_rows(as_tuples)
    assert kept_rows(rows)[0] is rows[0]  # nothing mutable: the row itself
    as_tuples[0].global_shape = torch.tensor([4])
    assert kept_rows(layout_rows(as_tuples)) is None  # a tensor's == is not a bool


def test_stride_keys_tell_strides_and_lists_apart():
    a, b = torch.zeros(4, 6), torch.zeros(6, 4).t()
    assert stride_keys([a, None, b]) == ((6, 1), (1, 4))
    assert stride_keys([a, None, a]) != stride_keys([a, None, b])
    assert stride_keys([[a[0], a[1]], None]) == (("members", (1,), (1,)), None)


# ---- across processes -----------------------------------------------------------------


def _warm_changes(job):
    """One planner, the same Transfer objects; between calls a placements list changes
    in place, then a fused destination is swapped for one of the wrong dtype."""
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import xfer_batch

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=60)
    me = job.rank
    both = MeshInfo(torch.tensor([0, 1]))
    full = [torch.arange(64 * 6, dtype=torch.float32).view(64, 6).to(BF16) + i
            for i in range(6)]
    ts = [Transfer(f"p{i}", (64, 6), BF16, both, [Shard(0)], both, [Shard(1)],
                   full[i][32 * me:32 * (me + 1)].clone(), torch.zeros(64, 3, dtype=BF16))
          for i in range(6)]
    planner = Planner()
    out = []
    xfer_batch(ts, pg, planner=planner)
    out.append(all(torch.equal(t.dst, f[:, 3 * me:3 * (me + 1)]) for t, f in zip(ts, full)))
    for t, f in zip(ts, full):  # S(0) -> S(0) now: the same list objects, changed in place
        t.dst_placements[0] = Shard(0)
        t.dst = torch.zeros(32, 6, dtype=BF16)
    xfer_batch(ts, pg, planner=planner)
    out.append(all(torch.equal(t.dst, f[32 * me:32 * (me + 1)]) for t, f in zip(ts, full)))
    if me == 1:  # one rank's bad input: every rank raises, before any data moves
        ts[4].dst = torch.zeros(32, 6, dtype=torch.float16)
    try:
        xfer_batch(ts, pg, planner=planner)
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_a_warm_batch_follows_changes_in_place_and_refuses_a_bad_swap(pool):
    results = pool.run(_warm_changes, 2, timeout_s=120)
    for rank, (first, second, error) in enumerate(results):
        assert first and second, f"rank {rank}: not exact"
        assert ("'p4'" in error and "rank 1" in error and "expected torch.bfloat16" in error
                and "found torch.float16" in error), error


def test_cpu_scatter_and_whole_copies_keep_nan_payloads_in_their_own_dtype():
    from megatron_reshard.engine.copies import Copies
    from megatron_reshard.engine.fuse import scatter

    # NaNs with payloads (bf16 0x7f81, 0xffc3; fp32 0x7f800001), +inf, a subnormal
    bf = torch.tensor([0x7F81, 0xFFC3 - 0x10000, 0x7F80, 0x0001] * 64, dtype=torch.int16)
    f32 = torch.tensor([0x7F800001, 0x7FC00000, -0x80000000, 1] * 64, dtype=torch.int32)
    for bits, dtype in ((bf, BF16), (f32, torch.float32)):
        image = bits.view(dtype).view(16, 4, 4)
        outs = [torch.zeros(4, 4, dtype=dtype) if e % 2 else torch.zeros(4, 4, dtype=dtype).t()
                for e in range(16)]
        scatter([(image, outs)])
        assert torch.equal(torch.stack([o.contiguous() for o in outs]).view(bits.dtype),
                           bits.view(16, 4, 4))
        whole = [torch.zeros(4, 4, dtype=dtype) for _ in range(16)]
        copies = Copies()
        copies.many(whole, list(image.unbind(0)))
        copies.run()
        assert torch.equal(torch.stack(whole).view(bits.dtype), bits.view(16, 4, 4))


def _one_rank_group():
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


def test_local_copies_keep_their_views_for_the_same_tensors_and_follow_new_ones():
    from megatron_reshard.engine import xfer_batch

    group, me = _one_rank_group(), MeshInfo(torch.tensor([0]))
    experts = [torch.randn(4, 6).to(BF16) for _ in range(5)]  # a rank's experts, as a list
    first = torch.zeros(5, 4, 6, dtype=BF16)
    planner = Planner()

    def call(dst):
        t = Transfer("w", (5, 4, 6), BF16, me, [Shard(0)], me, [Replicate()], experts, dst)
        xfer_batch([t], group, planner=planner)

    call(first)
    (batch,) = [b for bs in planner._batches.values() for b in bs.values()]
    (program,) = batch.programs.values()
    kept = program._local_batch
    assert kept is not None and torch.equal(first, torch.stack(experts))
    experts[2].fill_(7.0)  # new values, same tensors: the kept views are used again
    call(first)
    assert program._local_batch is kept and torch.equal(first, torch.stack(experts))
    second = torch.zeros_like(first)  # a new destination: views built for its address
    call(second)
    assert program._local_batch is not kept and torch.equal(second, torch.stack(experts))
    first.zero_()
    call(second)
    assert not first.any()  # the old destination is no longer written
    planner.release_staging()  # drops the kept views (and the tensors they hold)
    assert program._local_batch is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_copies_keep_their_views_and_follow_new_tensors():
    # rank 0 of a 2-rank S(0) -> S(1) reshard packs its source's right half for rank 1;
    # of S(1) -> S(0) it unpacks rank 1's column block: both through kept views
    from megatron_reshard.engine.program import Program
    from megatron_reshard.engine.schedule import build_schedule

    both, n = MeshInfo(torch.tensor([0, 1])), 64
    for sp, dp in ((Shard(0), Shard(1)), (Shard(1), Shard(0))):
        src = torch.zeros(*((n // 2, n) if sp == Shard(0) else (n, n // 2)), dtype=BF16,
                          device="cuda")
        dst = torch.zeros(*((n, n // 2) if dp == Shard(1) else (n // 2, n)), dtype=BF16,
                          device="cuda")
        t = Transfer("w", (n, n), BF16, both, [sp], both, [dp], src, dst)
        plan = Planner().plan(layout_key((n, n), both, [sp], both, [dp]))
        prog = Program(build_schedule([plan], [2], 0, 1 << 20, set()), [t], [plan], 0)
        pack = sp == Shard(0)
        (stage,) = [r.packs if pack else r.unpacks for r in prog.rounds
                    if (r.packs if pack else r.unpacks)]
        buf = torch.zeros(stage.nbytes, dtype=torch.uint8, device="cuda")
        for values in (1.0, 2.0):
            new = torch.full_like(src if pack else dst, 0.0)
            tensors = [src, dst]
            if pack:
                src.fill_(values)
            else:
                buf.view(BF16).fill_(values)
            prog.stage(buf, stage, tensors, pack=pack)
            torch.cuda.synchronize()
            got = buf.view(BF16) if pack else dst[:, n // 2:]
            assert bool((got == values).all())
        kept = dict(prog._staged)
        prog.stage(buf, stage, [new, dst] if pack else [src, new], pack=pack)  # new tensor
        torch.cuda.synchronize()
        assert prog._staged != kept
        if pack:
            assert not buf.view(BF16).any()  # the new (zero) source was packed
        else:
            assert bool((new[:, n // 2:] == 2.0).all())
        prog.release()
        assert not prog._staged


# ---- lists of members on a warm call (members.KnownMembers) ---------------------------


def test_the_member_guard_is_used_here_and_refuses_every_change_the_checks_read():
    from megatron_reshard.engine.members import known_members

    experts = [torch.randn(4, 6).to(BF16) for _ in range(5)]
    known = known_members(experts)
    assert known is not None, "this torch's TensorGuards failed the probe: no fast path"
    assert known.matches(experts) and known.matches(tuple(experts))
    assert known.key == ("members",) + ((6, 1),) * 5 and known.device == torch.device("cpu")
    transposed = torch.randn(6, 4).to(BF16).t()
    repointed = torch.randn(4, 6).to(BF16)
    repointed.data = torch.randn(6, 4).to(BF16).t()  # same object, new strides
    in_place = torch.randn(4, 6).to(BF16)
    in_place.as_strided_((4, 6), (1, 4))
    for name, member in (("strides", transposed), ("data", repointed),
                         ("as_strided_", in_place), ("dtype", torch.randn(4, 6)),
                         ("shape", torch.randn(4, 5).to(BF16)),
                         ("device", torch.empty(4, 6, dtype=BF16, device="meta")),
                         ("type", torch.nn.Parameter(torch.randn(4, 6).to(BF16))),
                         ("not a tensor", None)):
        changed = list(experts)
        changed[3] = member
        assert not known.matches(changed), name
    assert not known.matches(experts[:-1]) and not known.matches(experts + experts[:1])
    # a new storage of the same metadata matches: its address is the kept copies' to check
    assert known.matches([torch.randn(4, 6).to(BF16) for _ in range(5)])
    import weakref

    held = [weakref.ref(m) for m in experts]
    del experts, changed, member, transposed, repointed, in_place
    assert all(r() is None for r in held)  # the guard keeps no member alive


def test_a_warm_list_of_members_follows_new_members_and_refuses_bad_ones_alike():
    from megatron_reshard.engine import xfer_batch

    group, me = _one_rank_group(), MeshInfo(torch.tensor([0]))
    experts = [torch.randn(4, 6).to(BF16) for _ in range(5)]
    dst = torch.zeros(5, 4, 6, dtype=BF16)
    t = Transfer("w", (5, 4, 6), BF16, me, [Shard(0)], me, [Replicate()], experts, dst)
    planner = Planner()

    def call(agree=False):
        dst.zero_()
        xfer_batch([t], group, planner=planner, agree=agree)
        return torch.equal(dst, torch.stack([m.contiguous() for m in experts]))

    assert call(agree=True) and call()
    (batch,) = [b for bs in planner._batches.values() for b in bs.values()]
    (known,) = batch.expected.members.values()
    assert call() and batch.expected.members[0] is known  # matched, not checked again
    experts[1] = torch.randn(6, 4).to(BF16).t()  # a swapped member of other strides
    assert call() and batch.expected.members[0] is not known
    experts[2].data = torch.randn(4, 6).to(BF16)  # same object, a new storage
    assert call()
    experts[3].as_strided_((4, 6), (1, 4))  # same object, same storage, new strides
    assert call()
    t.src = tuple(experts)  # the same members as a tuple
    assert call()
    t.src = experts
    for name, bad, message in (
            ("dtype", lambda: experts.__setitem__(0, torch.randn(4, 6)),
             "member 0 of shape (4, 6) and dtype torch.bfloat16, found (4, 6) torch.float32"),
            ("length", lambda: experts.pop(), "5 members"),
            ("data", lambda: setattr(experts[4], "data", torch.randn(4, 5).to(BF16)),
             "member 4 of shape (4, 6) and dtype torch.bfloat16, found (4, 5)")):
        good, storage = list(experts), experts[4].data
        bad()
        for agree in (True, False):  # the vote's error, and a skipped vote's own
            with pytest.raises(ValueError) as err:
                call(agree=agree)
            assert "param 'w' on rank 0: wrong src members" in str(err.value), name
            assert message in str(err.value), (name, str(err.value))
        if name == "data":
            experts[4].data = storage
        experts[:] = good
        assert call(agree=True) and call(), name


# ---- a repeated call's lane (lane.py) -------------------------------------------------


def _only_batch(planner):
    (batch,) = [b for bs in planner._batches.values() for b in bs.values()]
    return batch


def _lane_case(device="cpu", stream=None):
    """A rank's 5 experts given as a list -> a stacked destination, plus a column block
    of a wider tensor, called again and again with ``agree=False`` on one rank."""
    from megatron_reshard.engine import xfer_batch

    group, me = _one_rank_group() if device == "cpu" else _one_rank_nccl(), \
        MeshInfo(torch.tensor([0]))
    experts = [torch.randn(4, 6, device=device).to(BF16) for _ in range(5)]
    dst = torch.zeros(5, 4, 6, dtype=BF16, device=device)
    wide = torch.zeros(8, 12, dtype=BF16, device=device)
    square = torch.randn(8, 6, device=device).to(BF16)
    ts = [Transfer("w", (5, 4, 6), BF16, me, [Shard(0)], me, [Replicate()], experts, dst),
          Transfer("b", (8, 6), BF16, me, [Shard(0)], me, [Shard(1)], square, wide[:, 6:])]
    planner = Planner()

    def call(agree=False):
        for t in ts:
            if t.dst is not None:
                t.dst.zero_()
        xfer_batch(ts, group, planner=planner, agree=agree, stream=stream)
        if device != "cpu":
            torch.cuda.synchronize()
        return (torch.equal(ts[0].dst, torch.stack([m.contiguous() for m in experts]))
                and torch.equal(ts[1].dst, ts[1].src))

    return ts, experts, planner, call


def _one_rank_nccl():
    import os

    import torch.distributed as dist

    from megatron_reshard.tools.worlds import free_ports

    store = dist.TCPStore("127.0.0.1", free_ports(1)[0], 1, True)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return dist.ProcessGroupNCCL(store, 0, 1)


def _lane_follows_changes_and_refuses_bad_input(device="cpu", stream=None):
    ts, experts, planner, call = _lane_case(device, stream)
    assert call(agree=True) and call() and call()
    batch = _only_batch(planner)
    lane = batch.lane
    assert lane is not None and lane.copies is not None  # local copies only: kept copies
    experts[2].fill_(3.0)  # new values, same tensors: the lane runs them
    assert call() and call() and batch.lane is lane
    # each change below misses the lane; the full path copies exactly, and a new lane
    # follows (its guard kept where only an address changed)
    experts[1] = torch.randn(4, 6, device=device).to(BF16)  # a new member, same metadata
    assert call() and batch.lane is not lane and batch.lane.guard is lane.guard
    lane = batch.lane
    experts[2].data = torch.randn(4, 6, device=device).to(BF16)  # re-pointed in place
    assert call() and batch.lane is not lane
    lane = batch.lane
    experts[3] = torch.randn(6, 4, device=device).to(BF16).t()  # re-strided member
    assert call() and batch.lane.guard is not lane.guard and call()
    lane = batch.lane
    old_dst = ts[1].dst
    ts[1].dst = torch.zeros(8, 12, dtype=BF16, device=device)[:, :6]  # a new column block
    old_dst.zero_()
    assert call() and not old_dst.any() and batch.lane is not lane
    ts[1].dst.as_strided_((8, 6), (1, 8))  # re-strided destination, in place
    assert call() and call()
    # bad input is refused with the full path's errors, lane or not
    for name, bad, where, message in (
            ("member dtype", lambda: experts.__setitem__(0, torch.randn(4, 6, device=device)),
             "param 'w' on rank 0: wrong src members",
             "member 0 of shape (4, 6) and dtype torch.bfloat16, found (4, 6) torch.float32"),
            ("member shape", lambda: setattr(experts[4], "data",
                                             torch.randn(4, 5, device=device).to(BF16)),
             "param 'w' on rank 0: wrong src members", "found (4, 5)"),
            ("dst dtype", lambda: setattr(ts[1], "dst", torch.zeros(
                8, 6, dtype=torch.float16, device=device)),
             "param 'b' on rank 0", "expected torch.bfloat16, found torch.float16"),
            ("dst swapped for None", lambda: setattr(ts[0], "dst", None),
             "param 'w' on rank 0", "dst missing")):
        good, storage, dst = list(experts), experts[4].data, (ts[0].dst, ts[1].dst)
        assert call() and call() and batch.lane is not None
        bad()
        with pytest.raises(ValueError) as err:
            call()
        assert where in str(err.value) and message in str(err.value), (name, str(err.value))
        experts[4].data = storage
        experts[:] = good
        ts[0].dst, ts[1].dst = dst
        assert call(agree=True) and call(), name


def test_a_repeated_calls_lane_follows_every_change_and_refuses_bad_input():
    _lane_follows_changes_and_refuses_bad_input()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("on_stream", [False, True])
def test_a_repeated_calls_lane_on_cuda_replays_and_follows_changes(on_stream):
    stream = torch.cuda.Stream() if on_stream else None
    _lane_follows_changes_and_refuses_bad_input("cuda", stream)
    ts, experts, planner, call = _lane_case("cuda", stream)
    for _ in range(4):
        assert call()
    lane = _only_batch(planner).lane
    assert lane is not None and lane.copies._launch.graph is not None  # a graph replay


def test_voted_calls_keep_no_lane():
    ts, experts, planner, call = _lane_case()
    assert call(agree=True) and call(agree=True)
    assert _only_batch(planner).lane is None  # agree=True: every call votes, full path
    assert call() and _only_batch(planner).lane is not None


def test_a_lane_into_permuted_rows_follows_a_new_box_and_refuses_a_bad_one():
    from megatron_reshard.engine import xfer_batch
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    group, me = _one_rank_group(), MeshInfo(torch.tensor([0]))
    e, r, c = 4, 8, 6
    rows = torch.arange(r).flip(0)  # each expert's rows reversed: no strided view is this
    order = KernelOrder("reversed", (torch.arange(e) * r * c, rows * c, torch.arange(c)))
    experts = [torch.randn(r, c).to(BF16) for _ in range(e)]
    box = ((0, e), (0, r), (0, c))
    t = Transfer("w", (e, r, c), BF16, me, [Shard(0)], me, [Replicate()], experts,
                 order.permuted_rows(torch.zeros(e, r, c, dtype=BF16), box))
    planner = Planner()

    def call(agree=False):
        t.dst.storage.zero_()
        xfer_batch([t], group, planner=planner, agree=agree)
        return torch.equal(t.dst.read(), torch.stack(experts))

    assert call(agree=True) and call() and call()
    batch = _only_batch(planner)
    lane = batch.lane
    assert lane is not None and lane.copies is not None
    assert call() and batch.lane is lane  # run through the lane
    old = t.dst.storage
    t.dst = order.permuted_rows(torch.zeros(e, r, c, dtype=BF16), box)  # a new storage
    old.zero_()
    assert call() and not old.any() and batch.lane is not lane
    good = t.dst
    t.dst = order.permuted_rows(torch.zeros(e, r, c, dtype=torch.float16), box)
    with pytest.raises(ValueError) as err:
        call()
    assert ("param 'w' on rank 0: wrong dst dtype: expected torch.bfloat16, found "
            "torch.float16" in str(err.value)), str(err.value)
    t.dst = good
    assert call(agree=True) and call() and call()


def test_release_staging_drops_the_lane_and_the_copies_it_kept():
    import weakref

    ts, experts, planner, call = _lane_case()
    assert call(agree=True) and call() and call()
    lane = _only_batch(planner).lane
    assert lane is not None
    kept = weakref.ref(lane.copies)  # its views hold the last call's tensors
    del lane
    planner.release_staging()
    assert _only_batch(planner).lane is None and kept() is None
    assert call() and call() and _only_batch(planner).lane is not None


@pytest.mark.parametrize("case", ["dst", "src", "dtype", "shape"])
def test_the_fast_checks_give_the_detailed_verdict_on_permuted_rows(case):
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    me = MeshInfo(torch.tensor([0]))
    e, r, c = 2, 4, 6
    order = KernelOrder("reversed", (torch.arange(e) * r * c, torch.arange(r).flip(0) * c,
                                     torch.arange(c)))
    dtype = torch.float16 if case == "dtype" else BF16
    box = ((0, e), (0, r - 1 if case == "shape" else r), (0, c))
    rows = order.permuted_rows(torch.zeros(e, r, c, dtype=dtype), box)
    experts = torch.zeros(e, r, c, dtype=BF16)
    t = Transfer("w", (e, r, c), BF16, me, [Shard(0)], me, [Replicate()],
                 rows if case == "src" else experts, experts if case == "src" else rows)
    plans = _plans([t])
    ok, device = local_ok([t], _expected([t], plans, 0), "cpu", [])
    problem, _ = check_local([t], plans, 0, "cpu", permuted_dst=True)
    assert ok == (problem is None) == (case == "dst"), problem
    if ok:
        assert device == torch.device("cpu")
