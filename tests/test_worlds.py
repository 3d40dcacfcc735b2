"""The worker pool runs real gloo worlds and reports failures by rank."""

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.tools.worlds import init_gloo_world


def _all_reduce_rank(job):
    init_gloo_world(job)
    t = torch.tensor([job.rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(job):
    if job.rank == 1:
        raise ValueError("boom on rank 1")
    return job.rank


def test_pool_runs_a_gloo_world(pool):
    assert pool.run(_all_reduce_rank, 3) == [6.0, 6.0, 6.0]


def test_pool_reports_the_failing_rank(pool):
    with pytest.raises(RuntimeError, match=r"failed on ranks \[1\][\s\S]*boom on rank 1"):
        pool.run(_fail_on_rank_one, 2)
