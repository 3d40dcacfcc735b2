"""Cross-world refit groups: built from a TCPStore while each side has its own default world."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.tools.worlds import free_ports


def _two_worlds_then_refit(job):
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo

    side = job.rank // 2  # ranks 0-1: "train" world, ranks 2-3: "generation" world
    store = dist.TCPStore(job.host, job.ports[side], 2, job.rank % 2 == 0,
                          timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=job.rank % 2, world_size=2,
                            timeout=timedelta(seconds=30))
    pg = create_refit_group(job.host, job.ports[2], job.rank, 4, backend="gloo",
                            timeout_s=30, prefix="refit-stage0")
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    src = full[3 * job.rank: 3 * job.rank + 3].clone() if side == 0 else None
    dst = torch.zeros(6, 2) if side == 1 else None
    t = Transfer("mlp.w", (6, 4), torch.float32, MeshInfo(torch.tensor([0, 1])), [Shard(0)],
                 MeshInfo(torch.tensor([2, 3])), [Shard(1)], src, dst)
    xfer_batch([t], pg)
    # each default world still works and still has two ranks
    x = torch.tensor([float(job.rank)])
    dist.all_reduce(x)
    expect = None if dst is None else full[:, 2 * (job.rank - 2): 2 * (job.rank - 2) + 2]
    return (pg.rank(), pg.size(), dist.get_world_size(), x.item(),
            None if dst is None else torch.equal(dst, expect))


def test_refit_group_spans_two_default_worlds_and_moves_tensors(pool):
    results = pool.run(_two_worlds_then_refit, 4, timeout_s=90)
    assert [r[:3] for r in results] == [(i, 4, 2) for i in range(4)]
    assert [r[3] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[4] for r in results] == [None, None, True, True]


def test_a_one_rank_refit_group_needs_no_default_world():
    pg = create_refit_group("127.0.0.1", free_ports(1)[0], 0, 1, timeout_s=10)
    assert (pg.rank(), pg.size()) == (0, 1)
    assert not dist.is_initialized()
    assert destroy_refit_group(pg) == 1


def test_unknown_backend_is_rejected_before_any_rendezvous():
    with pytest.raises(ValueError, match=r"backend must be 'gloo' or 'nccl', found 'mpi'"):
        create_refit_group("127.0.0.1", 1, 0, 2, backend="mpi")


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        create_refit_group("127.0.0.1", 1, 2, 2)


def _destroy_late_peers_first(job):
    import time

    from megatron_reshard.groups.comm import destroy_refit_group

    pg = create_refit_group(job.host, job.ports[0], job.rank, 3, backend="gloo", timeout_s=30)
    x = torch.ones(1)
    pg.allreduce([x]).wait()
    if job.rank:
        time.sleep(0.3 * job.rank)  # the store's host reaches destroy first and must wait
    return x.item(), destroy_refit_group(pg, timeout_s=20)


def test_the_store_host_outlives_every_peers_shutdown(pool):
    results = pool.run(_destroy_late_peers_first, 3, timeout_s=60)
    assert [r[0] for r in results] == [3.0, 3.0, 3.0]
    assert results[0][1] == 3  # rank 0 hosts the store: it returned after all three
    assert all(1 <= r[1] <= 3 for r in results[1:])


def _destroy_with_a_missing_peer(job):
    import warnings

    from megatron_reshard.groups.comm import destroy_refit_group

    pg = create_refit_group(job.host, job.ports[0], job.rank, 2, backend="gloo", timeout_s=30)
    if job.rank == 1:
        return None  # never shuts down
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = destroy_refit_group(pg, timeout_s=0.3)
    return done, [str(w.message) for w in caught]


def test_the_store_host_stops_waiting_after_the_timeout_and_says_so(pool):
    done, messages = pool.run(_destroy_with_a_missing_peer, 2, timeout_s=60)[0]
    assert done == 1
    assert messages == ["destroy_refit_group: 1 of 2 ranks had not shut down after 0.3 s; "
                        "closing the store anyway"]
