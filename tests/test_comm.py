"""Cross-world refit groups: built from a TCPStore while each side has its own default world."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.comm import create_refit_group
from megatron_reshard.worlds import free_ports


def _two_worlds_then_refit(job):
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import Transfer, xfer_batch
    from megatron_reshard.layout import MeshInfo

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


def test_unknown_backend_is_rejected_before_any_rendezvous():
    with pytest.raises(ValueError, match=r"backend must be 'gloo' or 'nccl', found 'mpi'"):
        create_refit_group("127.0.0.1", 1, 0, 2, backend="mpi")


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        create_refit_group("127.0.0.1", 1, 2, 2)
