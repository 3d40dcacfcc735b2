"""The worker pool runs real gloo worlds and reports failures by rank."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.tools.worlds import RankFailure, init_gloo_world


def _all_reduce_rank(job):
    init_gloo_world(job)
    t = torch.tensor([job.rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(job):
    if job.rank == 1:
        raise ValueError("boom on rank 1")
    return job.rank


def _stop_on_rank_one(job):
    if job.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return job.rank


def test_pool_runs_a_gloo_world(pool):
    assert pool.run(_all_reduce_rank, 3) == [6.0, 6.0, 6.0]


def test_pool_reports_the_failing_rank(pool):
    with pytest.raises(RuntimeError, match=r"failed on ranks \[1\][\s\S]*boom on rank 1"):
        pool.run(_fail_on_rank_one, 2)


def test_with_settle_s_the_last_rank_still_running_after_the_others_returned_is_killed(pool):
    got = pool.run(_stop_on_rank_one, 3, settle_s=1.0, return_failures=True)
    assert got[0] == 0 and got[2] == 2
    assert isinstance(got[1], RankFailure)
    assert got[1].text == "still running 1 s after every other rank returned; killed"
    assert pool.run(_all_reduce_rank, 3) == [6.0, 6.0, 6.0]  # the stopped worker was replaced
