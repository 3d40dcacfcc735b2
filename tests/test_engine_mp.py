"""The engine across spawned gloo processes: exact against the golden reference and against
independently sliced full tensors; bad input raises on every rank before data moves."""

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

NPROCS = 6  # up to 4 + 2 ranks
DTYPES = ["float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "uint8", "float64"]


# ---- helpers that run inside workers ------------------------------------------------


def _mesh(shape, ranks):
    from megatron_reshard.layout.placements import MeshInfo

    return MeshInfo(torch.tensor(ranks, dtype=torch.int64).reshape(shape))


def _placements(dims):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if d < 0 else Shard(d) for d in dims]


def _expected_local(full, mesh, dims, rank):
    """Independent of the engine: the mesh coordinate, then nested torch.chunk."""
    coord = mesh.coordinate_of(rank)
    out = full
    for axis, d in enumerate(dims):
        if d < 0:
            continue
        parts = torch.chunk(out, mesh.shape[axis], dim=d)
        c = coord[axis]
        out = parts[c] if c < len(parts) else out.narrow(d, out.shape[d], 0)
    return out


STORAGE = ("contiguous", "every_other", "padded_rows", "shifted")


def _storage(shape, dtype, kind):
    """A tensor of ``shape`` laid out as ``kind`` (True: "every_other", False:
    "contiguous"): contiguous; every other element of a wider buffer; rows padded by four
    elements (unit last stride, as a slice of a wider matrix); or contiguous one element
    past an aligned address. The last two let the engine copy in words, or refuse to at
    run time (misaligned address), which the random cases compare bit for bit as well."""
    kind = {True: "every_other", False: "contiguous"}.get(kind, kind)
    if kind == "contiguous" or len(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    if kind == "every_other":
        return torch.empty(tuple(shape[:-1]) + (2 * shape[-1] + 1,), dtype=dtype)[..., 1::2]
    if kind == "padded_rows":
        return torch.empty(tuple(shape[:-1]) + (shape[-1] + 4,), dtype=dtype)[..., :shape[-1]]
    numel = torch.Size(shape).numel()
    return torch.empty(numel + 1, dtype=dtype)[1:].view(shape)


def _fill_sentinel(t):
    pattern = torch.full((t.numel() * t.dtype.itemsize,), 0xA5, dtype=torch.uint8)
    t.copy_(pattern.view(t.dtype).reshape(t.shape))


def _as_bytes(t):
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # stride-1 storage even for size-1 dims
    return fresh.reshape(-1).view(torch.uint8)


def _build(case, rank):
    """(Transfer with this rank's tensors, expected dst or None) for one plain-data case."""
    from megatron_reshard.engine import Transfer

    name, shape, dtype_name, seed, src, dst, s_strided, d_strided = case
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    numel = torch.Size(shape).numel()
    full = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8,
                         generator=gen).view(dtype).reshape(shape)
    sm, dm = _mesh(src[0], src[1]), _mesh(dst[0], dst[1])
    s_local = d_local = expect = None
    if rank in src[1]:
        want = _expected_local(full, sm, src[2], rank)
        s_local = _storage(tuple(want.shape), dtype, s_strided)
        s_local.copy_(want)
    if rank in dst[1]:
        expect = _expected_local(full, dm, dst[2], rank).clone()
        d_local = _storage(tuple(expect.shape), dtype, d_strided)
        _fill_sentinel(d_local)
    t = Transfer(name, shape, dtype, sm, _placements(src[2]), dm, _placements(dst[2]),
                 s_local, d_local)
    return t, expect


def _run_cases(job, cases, stagings):
    """Every case in one batch per staging budget; compare with expectation and reference."""
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import Planner, xfer_batch, xfer_batch_reference

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=60)
    planner = Planner()
    failures = []
    built = [_build(c, job.rank) for c in cases]
    transfers = [t for t, _ in built]
    ref = []
    for t, _ in built:
        ref.append(None if t.dst is None else torch.empty_like(t.dst))
    ref_transfers = [type(t)(**{**t.__dict__, "dst": r}) for t, r in zip(transfers, ref)]
    xfer_batch_reference(ref_transfers, pg)
    for staging in stagings:
        for t in transfers:
            if t.dst is not None:
                _fill_sentinel(t.dst)
        xfer_batch(transfers, pg, staging_bytes=staging, planner=planner)
        for case, (t, expect), r in zip(cases, built, ref):
            if t.dst is None:
                continue
            if not torch.equal(_as_bytes(t.dst), _as_bytes(expect)):
                failures.append(f"rank {job.rank} staging {staging}: engine != sliced full: {case}")
            if not torch.equal(_as_bytes(t.dst), _as_bytes(r)):
                failures.append(f"rank {job.rank} staging {staging}: engine != reference: {case}")
    return failures


# ---- random cases (plain data, drawn in the parent) -----------------------------------


@st.composite
def _side(draw, ndim):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    n = 1
    for m in mesh_shape:
        n *= m
    if n > NPROCS:
        mesh_shape, n = (n % NPROCS or 1,), n % NPROCS or 1
    ranks = tuple(draw(st.permutations(range(NPROCS)))[:n])
    dims = tuple(draw(st.sampled_from([-1] + list(range(ndim)))) for _ in mesh_shape)
    return mesh_shape, ranks, dims


@st.composite
def _case(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    return (f"p{draw(st.integers(0, 10**6))}", shape, draw(st.sampled_from(DTYPES)),
            draw(st.integers(0, 2**31)), draw(_side(ndim)), draw(_side(ndim)),
            draw(st.sampled_from(STORAGE)), draw(st.sampled_from(STORAGE)))


@settings(max_examples=3, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=list(HealthCheck))
@given(st.lists(_case(), min_size=80, max_size=80))
def test_random_layouts_match_reference_and_sliced_full_tensor(pool, cases):
    cases = [(f"{i}:{c[0]}",) + c[1:] for i, c in enumerate(cases)]
    results = pool.run(_run_cases, NPROCS, cases, [256 << 20, 512], timeout_s=150)
    assert [f for r in results for f in r] == []


@settings(max_examples=1, deadline=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=list(HealthCheck))
@given(st.lists(_case(), min_size=12, max_size=12))
def test_tiny_staging_budget_splits_into_many_rounds_and_stays_exact(pool, cases):
    cases = [(f"{i}:{c[0]}",) + c[1:] for i, c in enumerate(cases)]
    results = pool.run(_run_cases, NPROCS, cases, [64], timeout_s=150)
    assert [f for r in results for f in r] == []


def test_hand_checked_layouts_are_exact(pool):
    cases = [  # name, shape, dtype, seed, (mesh, ranks, dims) x2, strided src, strided dst
        ("s0_to_s1", (16, 12), "bfloat16", 1, ((2,), (0, 1), (0,)), ((2,), (2, 3), (1,)), False, False),
        ("10_rows_over_4", (10, 3), "float32", 2, ((1,), (5,), (-1,)), ((4,), (0, 1, 2, 3), (0,)), False, True),
        ("replicas_dp2", (8, 6), "float8_e4m3fn", 3, ((2,), (0, 1), (0,)), ((2, 2), (2, 3, 4, 5), (-1, 1)), True, False),
        ("experts_ep_to_tp", (4, 6, 5), "bfloat16", 4, ((2,), (1, 0), (0,)), ((2,), (3, 2), (1,)), True, True),
        ("both_sides", (9, 4), "float64", 5, ((3,), (0, 1, 2), (0,)), ((3,), (2, 0, 1), (1,)), False, False),
        ("nested_axes", (11,), "int64", 6, ((2, 2), (0, 1, 2, 3), (0, 0)), ((1,), (4,), (-1,)), False, False),
    ]
    results = pool.run(_run_cases, NPROCS, cases, [256 << 20, 64], timeout_s=120)
    assert [f for r in results for f in r] == []


def test_batches_of_whole_1d_tensors_of_one_dtype_are_exact(pool):
    """Staged copies of whole 1-D tensors of one dtype cut the buffer in that dtype and
    copy the tensors as they are (on CPU a pack is one cat): odd sizes leave alignment
    gaps, and two ranks sending each other put the other direction's bytes in between."""
    one = lambda r: ((1,), (r,), (-1,))  # noqa: E731
    for dtype in ("bfloat16", "float8_e4m3fn", "float32"):
        cases = [(f"{dtype}.{i}", (n,), dtype, i, one(i % 2), one(1 - i % 2), False, False)
                 for i, n in enumerate((37, 64, 5, 1, 300, 8))]
        one_way = [(f"{dtype}.w{i}", (n,), dtype, 9 + i, one(0), one(1), False, False)
                   for i, n in enumerate((3, 17, 128))]
        for batch in (cases, one_way):
            results = pool.run(_run_cases, 2, batch, [256 << 20, 64], timeout_s=60)
            assert [f for r in results for f in r] == []


# ---- bad input -------------------------------------------------------------------------


BAD_KINDS = ["wrong_shape", "wrong_dtype", "wrong_device", "src_on_non_source",
             "missing_src", "invalid_shard_dim", "placement_count", "rank_outside_group",
             "descriptions_differ"]


def _bad_input(job, kinds):
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import Transfer, xfer_batch

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=30)
    rank = job.rank
    out = {}
    for kind in kinds:
        sm, dm = _mesh((2,), (0, 1)), _mesh((2,), (2, 3))
        src_pl, dst_pl = [Shard(0)], [Shard(1)]
        src = torch.ones(4, 6) * (rank + 1) if rank < 2 else None
        dst = torch.full((8, 3), -7.0) if rank >= 2 else None
        shape = (8, 6)
        if kind == "wrong_shape" and rank == 1:
            src = torch.ones(5, 6)
        if kind == "wrong_dtype" and rank == 2:
            dst = torch.full((8, 3), -7.0, dtype=torch.float64)
        if kind == "wrong_device" and rank == 3:
            dst = torch.empty((8, 3), device="meta")
        if kind == "src_on_non_source" and rank == 2:
            src = torch.ones(4, 6)
        if kind == "missing_src" and rank == 0:
            src = None
        if kind == "invalid_shard_dim":
            dst_pl = [Shard(2)]
        if kind == "placement_count":
            src_pl = [Shard(0), Replicate()]
        if kind == "rank_outside_group":
            dm = _mesh((2,), (2, 9))
        if kind == "descriptions_differ" and rank == 3:
            shape = (8, 7)
        t = Transfer("layers.0.mlp.w", shape, torch.float32, sm, src_pl, dm, dst_pl, src, dst)
        try:
            xfer_batch([t], pg)
            msg = None
        except ValueError as exc:
            msg = str(exc)
        untouched = dst is None or dst.device.type == "meta" or bool((dst == -7.0).all())
        # the group is still usable afterwards: nothing was left in flight
        ok_dst = torch.zeros(8, 3) if rank >= 2 else None
        good = Transfer("after", (8, 6), torch.float32, _mesh((2,), (0, 1)), [Shard(0)],
                        _mesh((2,), (2, 3)), [Shard(1)],
                        torch.ones(4, 6) if rank < 2 else None, ok_dst)
        xfer_batch([good], pg)
        out[kind] = (msg, untouched, ok_dst is None or bool((ok_dst == 1).all()))
    return out


def test_bad_input_raises_on_every_rank_before_any_data_moves(pool):
    results = pool.run(_bad_input, 4, BAD_KINDS, timeout_s=120)
    for kind in BAD_KINDS:
        for rank, res in enumerate(results):
            msg, untouched, later_ok = res[kind]
            assert msg is not None, f"{kind}: rank {rank} did not raise"
            assert "layers.0.mlp.w" in msg or kind == "descriptions_differ", (kind, msg)
            assert untouched and later_ok, (kind, rank)


def test_bad_input_messages_say_what_was_expected_and_found(pool):
    results = pool.run(_bad_input, 4, ["wrong_shape", "src_on_non_source"], timeout_s=60)
    msg = results[1]["wrong_shape"][0]
    assert "rank 1" in msg and "expected (4, 6)" in msg and "found (5, 6)" in msg
    assert "rank 1 rejected param 'layers.0.mlp.w'" in results[0]["wrong_shape"][0]
    assert "src given on a non-src rank" in results[2]["src_on_non_source"][0]


# ---- xferdtensor and registered groups -------------------------------------------------


def _xferdtensor_with_an_idle_rank(job):
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import DTensorRef, xferdtensor

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=30)
    full = torch.arange(7 * 5, dtype=torch.bfloat16).reshape(7, 5)
    sm, dm = _mesh((2,), (3, 0)), _mesh((1, 2), (1, 2))
    src = DTensorRef(_expected_local(full, sm, (0,), job.rank).clone(), (7, 5)) \
        if job.rank in (3, 0) else None
    dst = DTensorRef(torch.zeros(7, 3 if job.rank == 1 else 2, dtype=torch.bfloat16), (7, 5)) \
        if job.rank in (1, 2) else None
    xferdtensor(src, sm, [Shard(0)], dst, dm, [Replicate(), Shard(1)], pg)
    return None if dst is None else (dst.local, _expected_local(full, dm, (-1, 1), job.rank))


def test_xferdtensor_moves_one_tensor_with_an_idle_rank_in_the_group(pool):
    results = pool.run(_xferdtensor_with_an_idle_rank, 5, timeout_s=60)
    for rank in (1, 2):
        got, expect = results[rank]
        assert torch.equal(got, expect)
    assert results[4] is None


def _default_world_group(job):
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import Transfer, xfer_batch
    from megatron_reshard.tools.worlds import init_gloo_world

    init_gloo_world(job, timeout_s=30)
    full = torch.arange(12.0).reshape(4, 3)
    t = Transfer("w", (4, 3), torch.float32, _mesh((3,), (0, 1, 2)), [Shard(1)],
                 _mesh((3,), (2, 1, 0)), [Shard(0)],
                 full[:, job.rank:job.rank + 1].clone(), torch.zeros(
                     _expected_local(full, _mesh((3,), (2, 1, 0)), (0,), job.rank).shape))
    xfer_batch([t], None)
    return torch.equal(t.dst, _expected_local(full, _mesh((3,), (2, 1, 0)), (0,), job.rank))


def test_group_none_uses_the_registered_default_world(pool):
    assert pool.run(_default_world_group, 3, timeout_s=60) == [True, True, True]


# ---- transport and optional backend ----------------------------------------------------


def _swap_in_one_round(job):
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import P2PTransport

    pg = create_refit_group(job.host, job.ports[0], job.rank, 2, timeout_s=30)
    transport = P2PTransport(pg)
    mine = torch.full((4 << 20,), job.rank + 1, dtype=torch.float32)  # 16 MiB each way
    got = torch.zeros_like(mine)
    with transport.round():  # both ranks send first, then receive: must not deadlock
        transport.send(mine, 1 - job.rank, 0)
        transport.recv(got, 1 - job.rank, 0)
    return bool((got == 2 - job.rank).all())


def test_a_round_lets_two_ranks_swap_large_messages_without_deadlock(pool):
    assert pool.run(_swap_in_one_round, 2, timeout_s=60) == [True, True]


def test_backend_auto_runs_this_engine_and_an_unknown_backend_is_refused():
    from torch.distributed.tensor import Shard

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import Transfer, xfer_batch
    from megatron_reshard.tools.worlds import free_ports

    pg = create_refit_group("127.0.0.1", free_ports(1)[0], 0, 1, timeout_s=10)
    t = Transfer("w", (4,), torch.float32, _mesh((1,), (0,)), [Shard(0)], _mesh((1,), (0,)),
                 [Shard(0)], torch.arange(4.0), torch.zeros(4))
    xfer_batch([t], pg, backend="auto")  # the Python engine
    assert torch.equal(t.dst, torch.arange(4.0))
    import pytest

    with pytest.raises(ValueError, match=r"unknown backend on rank 0: expected one of \('python', "
                                         r"'auto'\), found 'm2n'"):
        xfer_batch([t], pg, backend="m2n")  # the native backend once probed here is gone
