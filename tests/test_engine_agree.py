"""The agreement step can be skipped for a batch that already went through on every rank."""

import pytest
import torch
from torch.distributed.tensor import Shard

from megatron_reshard.engine import DTensorRef, Planner, Transfer, xfer_batch, xferdtensor
from megatron_reshard.layout import MeshInfo
from megatron_reshard.tools.worlds import init_gloo_world

FULL = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)


def _transfer(rank, dst=None):
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0, 1])), MeshInfo(torch.tensor([2, 3]))
    src = torch.chunk(FULL, 2, dim=0)[rank].clone() if rank < 2 else None
    return Transfer("w", (6, 8), torch.float32, src_mesh, [Shard(0)], dst_mesh, [Shard(1)],
                    src=src, dst=dst)


def _job(job, break_second_call):
    init_gloo_world(job)
    planner = Planner()
    dst = torch.zeros(6, 4) if job.rank >= 2 else None
    xfer_batch([_transfer(job.rank, dst)], None, planner=planner)  # agreed
    if dst is not None:
        dst.zero_()
    if break_second_call and job.rank == 3:
        with pytest.raises(ValueError, match=r"'w'.*agree=False"):
            xfer_batch([_transfer(job.rank, torch.zeros(6, 5))], None, planner=planner,
                       agree=False)
        return "raised"
    if break_second_call:
        return "skipped"
    xfer_batch([_transfer(job.rank, dst)], None, planner=planner, agree=False)
    if dst is None:
        return True
    return torch.equal(dst, torch.chunk(FULL, 2, dim=1)[job.rank - 2])


def test_second_call_without_agreement_is_exact(pool):
    assert pool.run(_job, 4, False, timeout_s=60) == [True] * 4


def test_without_agreement_a_bad_tensor_raises_on_its_rank_before_communicating(pool):
    assert pool.run(_job, 4, True, timeout_s=60)[3] == "raised"



def _direct_flags(planner):
    (batches,) = planner._batches.values()
    (batch,) = batches.values()
    return sorted({m.direct for rnd in batch.sched.rounds for m in rnd.messages})


def _rows_transfer(rank, dst):
    """Shard(0) on ranks 0,1 -> Shard(0) on ranks 2,3: one contiguous row block each."""
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0, 1])), MeshInfo(torch.tensor([2, 3]))
    src = torch.chunk(FULL, 2, dim=0)[rank].clone() if rank < 2 else None
    return Transfer("w", (6, 8), torch.float32, src_mesh, [Shard(0)], dst_mesh, [Shard(0)],
                    src=src, dst=dst)


def _job_strides(job):
    """The schedule follows every rank's strides, agreed on each call: row blocks go
    straight between contiguous tensors; a strided destination (a transposed buffer)
    brings staging back. A fresh planner with agree=False agrees anyway (it has no
    agreed schedule to vouch for)."""
    init_gloo_world(job)
    planner = Planner()
    expect = torch.chunk(FULL, 2, dim=0)[job.rank - 2] if job.rank >= 2 else None
    out = []
    for dst in (torch.zeros(3, 8), torch.zeros(8, 3).t(), torch.zeros(3, 8)):
        dst = dst if job.rank >= 2 else None
        xfer_batch([_rows_transfer(job.rank, dst)], None, planner=planner, staging_bytes=64)
        out.append((dst is None or torch.equal(dst, expect), _direct_flags(planner)))
    dst = torch.zeros(8, 3).t() if job.rank >= 2 else None
    xfer_batch([_rows_transfer(job.rank, dst)], None, planner=Planner(), agree=False)
    out.append((dst is None or torch.equal(dst, expect), None))
    return out


def test_schedule_follows_every_ranks_strides(pool):
    results = pool.run(_job_strides, 4, timeout_s=60)
    for rank_out in results:
        assert all(ok for ok, _ in rank_out)
        assert [flags for _, flags in rank_out[:3]] == [[True], [False], [True]]


def _job_outsider(job):
    """A rank outside both meshes describes a call by a placeholder, so with a shared
    planner its cache can hit where the others miss (two tensors with the same
    placements): whether the schedule is rebuilt, and the stride map exchanged, must
    still be decided alike on every rank, or the exchange would wait forever."""
    init_gloo_world(job)
    planner = Planner()
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    ok = []
    for rows in (6, 4, 6):
        full = torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8)
        src = DTensorRef(full.clone(), full.shape) if job.rank == 0 else None
        # a strided destination (a transposed buffer): every call votes a signature
        dst = DTensorRef(torch.zeros(8, rows).t(), full.shape) if job.rank == 1 else None
        xferdtensor(src, src_mesh, [Shard(0)], dst, dst_mesh, [Shard(0)], None,
                    planner=planner)
        ok.append(dst is None or torch.equal(dst.local, full))
    return ok


def test_rank_outside_both_meshes_with_a_shared_planner(pool):
    assert pool.run(_job_outsider, 3, timeout_s=60) == [[True] * 3] * 3
