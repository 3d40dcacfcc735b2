"""The colocated transport with real processes: a real megatron-core model on the training
ranks, the real receiver on the generation ranks, bytes copied out of the training ranks'
shared memory (CPU stand-in for CUDA IPC), bit for bit against the independent reference;
its fault twins live in test_faults.py (same jobs, ``transport="colocated"``)."""

import pytest

from test_faults import _check_all_or_nothing, _run

pytestmark = pytest.mark.slow


def test_colocated_refits_are_bit_exact_and_committed(pool):
    # before the third refit the generation ranks prepare again on the same groups: the
    # new session's plan check and first batches are voted on every rank, and it goes on
    results, _ = _run(pool, refits=3, tag="coloc", transport="colocated", fresh_gen=True,
                      prepare_again_before=3)
    for r in (0, 1):
        assert results[r]["error"] is None, results[r]
    for r in (2, 3):
        gen = results[r]
        assert gen["error"] is None, gen["error"]
        assert gen["state"]["state"] == "consistent" and gen["state"]["version"] == 3, gen
        assert set(gen["versions"][3]) == set(gen["names"])  # every param bit-exact
        assert gen["transports"] == ["colocated"]  # chosen by the trainer, followed here
        _check_all_or_nothing(gen)


def test_cuda_ipc_is_refused_for_the_async_allocator_and_old_torch_with_expandable_segments():
    from megatron_reshard.engine.shared_memory import allocator_problem

    assert allocator_problem("", (2, 11)) is None
    assert allocator_problem("expandable_segments:True", (2, 11)) is None
    assert "cudaMallocAsync" in allocator_problem("backend:cudaMallocAsync", (2, 13))
    assert "expandable_segments" in allocator_problem("expandable_segments:True", (2, 4))


def test_an_unknown_transport_name_is_refused_before_any_store():
    from megatron_reshard.groups.comm import create_refit_group

    with pytest.raises(ValueError, match="unknown refit transport 'ipc'"):
        create_refit_group("127.0.0.1", 1, 0, 2, transport="ipc")
    with pytest.raises(ValueError, match="colocated transport talks over gloo"):
        create_refit_group("127.0.0.1", 1, 0, 2, backend="nccl", transport="colocated")


def _changed_views_job(job, bad_side, overlap):
    """Train (rank 0) -> gen (rank 1), two batches (a dense param; a list of members),
    moved with ``overlap`` on the ranks it names, then flushed, refitted: as is, after
    in-place writes (an optimizer step), after one member and the dense param moved to
    fresh storages, after a member's view moved inside its storage, unchanged, after the
    generation side's dense destination moved to a fresh tensor, and last with bad input
    on ``bad_side``. The generation side must see each refit's values."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.engine import Planner, Transfer
    from megatron_reshard.engine.refit_transport import transport_of
    from megatron_reshard.layout.placements import MeshInfo

    train = job.rank == 0
    group = create_refit_group("127.0.0.1", job.ports[0], job.rank, 2, "gloo", 60.0,
                               transport="colocated", who=("train", "gen")[job.rank])
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    dense = torch.arange(24, dtype=torch.float32).view(4, 6)
    members = [torch.full((8, 3), float(k)) for k in range(4)]
    out_dense, out_members = torch.zeros(4, 6), torch.zeros(4, 3, 3)
    planner, seen = Planner(), []

    mine = overlap in ("both", ("train", "gen")[job.rank])
    transport = transport_of(group)

    def refit(src_dense, src_members, dst_members=None):
        batches = [[Transfer("dense", (4, 6), torch.float32, src_mesh, [Replicate()],
                             dst_mesh, [Replicate()], src_dense if train else None,
                             None if train else out_dense)],
                   [Transfer("experts", (4, 3, 3), torch.float32, src_mesh, [Shard(0)],
                             dst_mesh, [Replicate()],
                             [m[:3] for m in src_members] if train else None,
                             None if train else
                             (out_members if dst_members is None else dst_members))]]
        for batch in batches:
            transport.move(batch, group, planner=planner, agree=not seen, overlap=mine)
        transport.flush()
        seen.append(None if train else (out_dense.clone(), out_members.clone()))

    refit(dense, members)
    dense.mul_(2)
    for m in members:
        m.add_(10)
    refit(dense, members)  # same views, new values
    members[2] = torch.full((8, 3), -5.0)
    dense = dense + 1  # a fresh storage
    refit(dense, members)
    shifted = [m for m in members]
    shifted[1] = members[1][4:]  # same storage, another offset
    members[1][4:7] = 99.0
    refit(dense, shifted)
    refit(dense, shifted)  # unchanged again: the next call takes the optimistic order
    old_dense, out_dense = out_dense, torch.zeros(4, 6)  # the generation side's checks see it
    dense.mul_(3)
    refit(dense, shifted)
    untouched = train or torch.equal(old_dense, seen[-2][0])  # the former destination: unwritten
    bad = list(shifted)
    bad[0] = torch.zeros(2, 3)  # a member of the wrong shape, found after the copies
    try:
        if bad_side == "train":
            refit(dense, bad)
        else:  # a destination of the wrong shape, found while waiting for the training side
            refit(dense, shifted, dst_members=torch.zeros(4, 3, 2))
        error = None
    except ValueError as exc:
        error = str(exc)
    destroy_refit_group(group)
    return seen, error, untouched


@pytest.mark.parametrize("bad_side, overlap", [("train", "none"), ("gen", "none"),
                                               ("train", "both"), ("gen", "both"),
                                               ("train", "train"), ("gen", "gen")])
def test_colocated_refits_follow_changed_views_and_values(pool, bad_side, overlap):
    """``overlap``: which ranks move with ``overlap=True`` (the two sides need not agree)."""
    import torch

    (_, train_error, _), (gen, gen_error, untouched) = pool.run(
        _changed_views_job, 2, bad_side, overlap, timeout_s=120)
    # bad input in a batch that kept its tensors last time is checked after the rank entered
    # the ready barrier (training side: while the generation side copies; generation side:
    # before its copies): the batch is then moved again in the checked order, which raises
    # on both ranks
    for error in (train_error, gen_error):
        assert error is not None and "found a problem with their local tensors" in error, error
    named = train_error if bad_side == "train" else gen_error
    assert "experts" in named, named  # the rank with the bad tensor names the param
    assert untouched, "the generation side wrote into its former destination"
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    want = [(base, [0.0, 1.0, 2.0, 3.0]), (2 * base, [10.0, 11.0, 12.0, 13.0]),
            (2 * base + 1, [10.0, 11.0, -5.0, 13.0]), (2 * base + 1, [10.0, 99.0, -5.0, 13.0]),
            (2 * base + 1, [10.0, 99.0, -5.0, 13.0]), (6 * base + 3, [10.0, 99.0, -5.0, 13.0])]
    assert len(gen) == len(want)  # the failed refit appended nothing
    for k, ((got_dense, got_members), (dense, fills)) in enumerate(zip(gen, want)):
        assert torch.equal(got_dense, dense), k
        expect = torch.stack([torch.full((3, 3), f) for f in fills])
        assert torch.equal(got_members, expect), (k, got_members)
