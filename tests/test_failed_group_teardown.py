"""A failed gloo refit group tears down at once: its survivors drop or destroy it while an
abandoned operation still runs in it (until gloo's own timeout), and nothing waits for that
operation. Three ranks; the group's timeout is long (600 s), so a teardown that waited for
gloo would outlast the job's timeout and fail as a hang."""

import gc
import threading
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.groups import faults
from megatron_reshard.groups.comm import FAILED_LINGER_S, create_refit_group, destroy_refit_group

GROUP_TIMEOUT_S = 600.0  # gloo's timeout: what an abandoned operation would wait for


def _control(job):
    return dist.TCPStore(job.host, job.ports[1], job.nprocs, job.rank == 0,
                         timeout=timedelta(seconds=60))


def _drop_with_a_collective_in_flight(job):
    """Rank 0 all-reduces with rank 2 while rank 1 never joins; rank 2 fails on purpose."""
    control = _control(job)
    pg = create_refit_group(job.host, job.ports[0], job.rank, 3, "gloo", GROUP_TIMEOUT_S)
    x = torch.ones(1)
    if job.rank == 1:  # alive but never joins: the all-reduce can only end at gloo's timeout
        control.wait(["dropped"])
        return None
    work = pg.allreduce([x])
    if job.rank == 2:
        faults.post_failure([pg], RuntimeError("planted"))
    else:
        with pytest.raises(faults.PeerFailure, match="planted"):
            faults.wait_works([work], pg, "the all-reduce", [1, 2])
    del pg
    gc.collect()  # the last reference to the group this rank's code held
    in_flight = not work.is_completed()
    # the group's own threads (RefitGroup.threads) run its waits
    waiters = [t.daemon for t in threading.enumerate() if t.name == "refit-group"]
    control.add("dropped_by", 1)
    if job.rank == 0:
        while int(control.add("dropped_by", 0)) < 2:
            control.wait(["dropped_by"])
        control.set("dropped", "1")
    return in_flight, waiters


def test_dropping_a_failed_group_does_not_wait_for_its_abandoned_collective(pool):
    results = pool.run(_drop_with_a_collective_in_flight, 3, num_ports=2, timeout_s=60)
    for rank in (0, 2):  # the failing rank and the one that saw its failure
        in_flight, _ = results[rank]
        assert in_flight, f"rank {rank}: dropping the group waited for its all-reduce"
    waiters = results[0][1]
    assert waiters and all(waiters), waiters  # the stuck wait is on a daemon thread


def _destroy_after_a_failure(job):
    """Rank 2 fails and destroys the group; rank 1 never destroys it (a dead or stopped
    rank); rank 0, the store's host, sees the failure, then destroys the group."""
    control = _control(job)
    pg = create_refit_group(job.host, job.ports[0], job.rank, 3, "gloo", GROUP_TIMEOUT_S)
    if job.rank == 1:
        control.wait(["destroyed"])
        return None
    if job.rank == 2:
        faults.post_failure([pg], RuntimeError("planted"))
        return destroy_refit_group(pg, timeout_s=GROUP_TIMEOUT_S), []
    with pytest.raises(faults.PeerFailure, match="planted"):
        faults.wait_works([pg.recv([torch.zeros(1)], 1, 0)], pg, "a recv", [1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = destroy_refit_group(pg, timeout_s=GROUP_TIMEOUT_S)
    control.set("destroyed", "1")
    return done, [str(w.message) for w in caught]


def test_the_store_host_of_a_failed_group_does_not_wait_for_a_rank_that_never_shuts_down(pool):
    results = pool.run(_destroy_after_a_failure, 3, num_ports=2, timeout_s=60)
    done, messages = results[0]
    assert done == 2  # rank 2 counted itself, rank 1 never does
    assert messages == [f"destroy_refit_group: 1 of 3 ranks had not shut down after "
                        f"{FAILED_LINGER_S:g} s; the group had failed; closing the store anyway"]
