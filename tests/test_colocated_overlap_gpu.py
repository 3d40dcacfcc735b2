"""The colocated transport's ``overlap`` on one GPU (CUDA IPC, two processes): a training
rank may change its sources once ``flush`` returned, and only then. The generation rank's
copies are held back behind a long kernel on its stream, so a ``copied`` word reported
before they ran would let the training rank overwrite its sources first, and the
generation side would read the new values. Skipped without CUDA."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BATCHES, ROWS, COLS = 3, 2048, 4096  # 3 batches of 16 MiB (bf16)


def _job(rank: int, port: int, out) -> None:
    try:
        out.put((rank, _refit(rank, port)))
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def _refit(rank: int, port: int):
    from torch.distributed.tensor import Replicate

    from megatron_reshard.engine import Planner, Transfer
    from megatron_reshard.engine.refit_transport import transport_of
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.layout.placements import MeshInfo

    train, device = rank == 0, torch.device("cuda:0")
    group = create_refit_group("127.0.0.1", port, rank, 2, "gloo", 60.0,
                               transport="colocated", who=("train", "gen")[rank])
    transport, planner = transport_of(group), Planner()
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    values = [torch.full((ROWS, COLS), float(k + 1), dtype=torch.bfloat16, device=device)
              for k in range(BATCHES)]
    tensors = values if train else [torch.zeros_like(v) for v in values]

    def refit(agree):
        for k, t in enumerate(tensors):
            transport.move([Transfer(f"p{k}", (ROWS, COLS), torch.bfloat16, src_mesh,
                                     [Replicate()], dst_mesh, [Replicate()],
                                     t if train else None, None if train else t)],
                           group, planner=planner, agree=agree, overlap=True)
        transport.flush()

    refit(True)  # maps the sources, builds the copies
    torch.cuda.synchronize()
    if not train:
        for t in tensors:
            t.zero_()
        torch.cuda._sleep(500_000_000)  # ~0.25 s of device time ahead of the copies
    refit(False)
    if train:  # allowed once flush returned: every generation rank has read the sources
        for t in tensors:
            t.fill_(-7.0)
        torch.cuda.synchronize()
    got = None if train else [bool((t == k + 1).all()) for k, t in enumerate(tensors)]
    destroy_refit_group(group)
    return got


def test_a_training_rank_changes_its_sources_only_after_the_generation_rank_read_them():
    import torch.multiprocessing as mp

    from megatron_reshard.tools.worlds import free_ports

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_ports(1)[0]
    procs = [ctx.Process(target=_job, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got[0] is None, got[0]
    assert got[1] == [True] * BATCHES, got[1]
