"""Bad input raises on every rank of the group before any data moves, and says what.

Each case runs on 4 spawned gloo processes (group ranks 0, 1: sources; 2, 3:
destinations, unless the case says otherwise): every rank must raise ``ValueError``,
its message must name the param, the rank at fault, what was expected and what was
found, no destination may be written, and the group must still work afterwards.
"""

import pytest
import torch

NAME = "layers.0.mlp.w"
FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


class _DeviceMeshLike:
    """The part of a DeviceMesh the engine reads: ``.mesh``, a rank tensor."""

    def __init__(self, ranks):
        self.mesh = torch.tensor(ranks)


def _mesh(kind, ranks):
    from megatron_reshard.layout.placements import MeshInfo

    if kind == "tensor":
        return torch.tensor(ranks)
    if kind == "device_mesh":
        return _DeviceMeshLike(ranks)
    return MeshInfo(torch.tensor(ranks))


def _good_after(pg, rank):
    """A valid transfer right after the failed one: nothing was left in flight."""
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import Transfer, xfer_batch

    dst = torch.zeros(8, 3) if rank >= 2 else None
    t = Transfer("after", (8, 6), torch.float32, _mesh("info", [0, 1]), [Shard(0)],
                 _mesh("info", [2, 3]), [Shard(1)],
                 torch.chunk(FULL, 2, 0)[rank].clone() if rank < 2 else None, dst)
    xfer_batch([t], pg)
    return dst is None or torch.equal(dst, torch.chunk(FULL, 2, 1)[rank - 2])


def _batch_case(job, case):
    """``xfer_batch`` of one Shard(0) -> Shard(1) param with the fault ``case``."""
    from torch.distributed.tensor import Shard

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import Transfer, xfer_batch

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=30)
    rank = job.rank
    kind, src_ranks, dst_ranks = case.get("meshes", ("info", [0, 1], [2, 3]))
    dtype = torch.float64 if case.get("dtype_on") == rank else torch.float32
    src = torch.chunk(FULL, 2, 0)[rank].to(dtype) if rank in (0, 1) else None
    dst = torch.full((8, 3), -7.0, dtype=dtype) if rank in (2, 3) else None
    t = Transfer(NAME, (8, 6), dtype, _mesh(kind, src_ranks), [Shard(0)],
                 _mesh(kind, dst_ranks), [Shard(1)], src, dst)
    batch = [t]
    if case.get("extra_on") == rank:  # one more param than the other ranks
        batch.append(Transfer("extra", (2,), torch.float32, _mesh("info", [0]), [Shard(0)],
                              _mesh("info", [1]), [Shard(0)]))
    try:
        xfer_batch(batch, pg)
        msg = None
    except ValueError as exc:
        msg = str(exc)
    untouched = dst is None or bool((dst == -7.0).all())
    return msg, untouched, _good_after(pg, rank)


def _check_every_rank(results, *needles):
    for rank, (msg, untouched, later_ok) in enumerate(results):
        assert msg is not None, f"rank {rank} did not raise"
        for needle in needles:
            assert needle in msg, (rank, needle, msg)
        assert untouched, f"rank {rank}: a destination was written"
        assert later_ok, f"rank {rank}: the group did not work afterwards"


@pytest.mark.parametrize("kind", ["tensor", "device_mesh"])
def test_a_duplicate_mesh_rank_raises_everywhere(pool, kind):
    results = pool.run(_batch_case, 4, {"meshes": (kind, [0, 0], [2, 3])}, timeout_s=60)
    _check_every_rank(results, NAME, "src mesh has duplicate ranks",
                      "expected distinct ranks in [0, 4)", "found [0] more than once")


@pytest.mark.parametrize("kind", ["tensor", "device_mesh"])
def test_a_negative_mesh_rank_raises_everywhere(pool, kind):
    results = pool.run(_batch_case, 4, {"meshes": (kind, [0, 1], [2, -3])}, timeout_s=60)
    _check_every_rank(results, NAME, "dst mesh has ranks outside the group",
                      "expected distinct ranks in [0, 4)", "found [-3]")


@pytest.mark.parametrize("kind", ["tensor", "device_mesh", "info"])
def test_a_mesh_rank_outside_the_group_raises_everywhere(pool, kind):
    results = pool.run(_batch_case, 4, {"meshes": (kind, [0, 1], [2, 4])}, timeout_s=60)
    _check_every_rank(results, NAME, "dst mesh has ranks outside the group",
                      "(group size 4)", "found [4]")


def test_one_ranks_different_dtype_is_named_with_the_param_and_the_rank(pool):
    results = pool.run(_batch_case, 4, {"dtype_on": 2}, timeout_s=60)
    _check_every_rank(results, f"param {NAME!r} (index 0 of the batch)",
                      "expected (as on ranks [0, 1, 3])", "torch.float32",
                      "found on rank 2", "torch.float64")


def test_a_rank_with_a_longer_batch_is_named(pool):
    results = pool.run(_batch_case, 4, {"extra_on": 3}, timeout_s=60)
    _check_every_rank(results, "(index 1 of the batch)",
                      "expected (as on ranks [0, 1, 2]) no param at index 1 (a batch of 1)",
                      "found on rank 3 'extra'")


# ---- xferdtensor -----------------------------------------------------------------------


def _xferdtensor_case(job, case):
    from torch.distributed.tensor import Shard

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import DTensorRef, xferdtensor

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=30)
    rank = job.rank
    if case == "shapes_differ":  # ranks 0, 1 on both sides; rank 1's dst says (8, 7)
        sm = dm = _mesh("info", [0, 1])
        src = DTensorRef(torch.chunk(FULL, 2, 0)[rank].clone(), (8, 6)) if rank < 2 else None
        dst = DTensorRef(torch.full((8, 3), -7.0), (8, 7 if rank == 1 else 6)) \
            if rank < 2 else None
    else:  # "missing_src": rank 0 is a source but passes None
        sm, dm = _mesh("info", [0, 1]), _mesh("info", [2, 3])
        src = DTensorRef(torch.chunk(FULL, 2, 0)[rank].clone(), (8, 6)) if rank == 1 else None
        dst = DTensorRef(torch.full((8, 3), -7.0), (8, 6)) if rank >= 2 else None
    try:
        xferdtensor(src, sm, [Shard(0)], dst, dm, [Shard(1)], pg, name=NAME)
        msg = None
    except ValueError as exc:
        msg = str(exc)
    untouched = dst is None or bool((dst.local == -7.0).all())
    return msg, untouched, _good_after(pg, rank)


def test_xferdtensor_src_and_dst_shapes_differing_on_one_rank_raise_everywhere(pool):
    results = pool.run(_xferdtensor_case, 4, "shapes_differ", timeout_s=60)
    _check_every_rank(results, NAME, "rank 1", "src and dst global shapes differ",
                      "(8, 6)", "found (8, 7)")


def test_xferdtensor_missing_src_names_the_real_local_shape_everywhere(pool):
    results = pool.run(_xferdtensor_case, 4, "missing_src", timeout_s=60)
    _check_every_rank(results, NAME, "rank 0", "src missing on a src rank",
                      "expected a local tensor of shape (4, 6)", "found None")
