"""The agreement step: skipped (agree=False) only for the call the group's history predicts."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.engine import DTensorRef, Planner, Transfer, xfer_batch, xferdtensor
from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.tools.worlds import init_gloo_world
from vote_count import VoteCount

FULL = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)


def _transfer(rank, dst=None):
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0, 1])), MeshInfo(torch.tensor([2, 3]))
    src = torch.chunk(FULL, 2, dim=0)[rank].clone() if rank < 2 else None
    return Transfer("w", (6, 8), torch.float32, src_mesh, [Shard(0)], dst_mesh, [Shard(1)],
                    src=src, dst=dst)


def _job(job, break_third_call):
    """Call 1 agrees; call 2 (agree=False) votes too, as no call has followed this batch
    yet; call 3 repeats the sequence, so it skips the vote."""
    init_gloo_world(job)
    planner = Planner()
    dst = torch.zeros(6, 4) if job.rank >= 2 else None
    votes = []
    with VoteCount() as counted:
        for agree in (True, False):
            xfer_batch([_transfer(job.rank, dst)], None, planner=planner, agree=agree)
            votes.append(counted.count)
        if dst is not None:
            dst.zero_()
        if break_third_call and job.rank == 3:
            with pytest.raises(ValueError, match=r"'w'.*agree=False: peers are not told"):
                xfer_batch([_transfer(job.rank, torch.zeros(6, 5))], None, planner=planner,
                           agree=False)
            return "raised"
        if break_third_call:
            return "skipped"
        xfer_batch([_transfer(job.rank, dst)], None, planner=planner, agree=False)
        votes.append(counted.count)
    exact = dst is None or torch.equal(dst, torch.chunk(FULL, 2, dim=1)[job.rank - 2])
    return exact, votes


def test_repeated_call_without_agreement_is_exact_and_skips_the_vote(pool):
    assert pool.run(_job, 4, False, timeout_s=60) == [(True, [1, 2, 2])] * 4


def test_without_agreement_a_bad_tensor_raises_on_its_rank_before_communicating(pool):
    assert pool.run(_job, 4, True, timeout_s=60)[3] == "raised"


def _job_bad_tensor_in_a_new_call(job):
    """agree=False on a call the history does not predict still votes: a bad tensor on
    one rank then fails every rank, before data moves."""
    init_gloo_world(job)
    planner = Planner()
    dst = torch.zeros(6, 4) if job.rank >= 2 else None
    xfer_batch([_transfer(job.rank, dst)], None, planner=planner)
    if job.rank == 3:
        dst = torch.zeros(6, 5)
    try:
        xfer_batch([_transfer(job.rank, dst)], None, planner=planner, agree=False)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_without_agreement_a_new_call_with_a_bad_tensor_fails_every_rank(pool):
    for text in pool.run(_job_bad_tensor_in_a_new_call, 4, timeout_s=60):
        assert "'w'" in text and "rank 3" in text and "no data was moved" in text


def _named(name, rank, fill, dst=None):
    """[4, 8] float32 from rank 0 (filled with ``fill``) to rank 1: one message."""
    one0, one1 = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    src = torch.full((4, 8), float(fill)) if rank == 0 else None
    return Transfer(name, (4, 8), torch.float32, one0, [Replicate()], one1, [Replicate()],
                    src=src, dst=dst)


def _job_sequence(job):
    """Two batches alternate: each call votes until the history has seen each batch
    follow the other, then none votes; every call is exact."""
    init_gloo_world(job)
    planner = Planner()
    votes, exact = [], []
    with VoteCount() as counted:
        for i, name in enumerate("abababab"):
            dst = torch.zeros(4, 8) if job.rank == 1 else None
            before = counted.count
            xfer_batch([_named(name, job.rank, 1 + i, dst)], None, planner=planner,
                       agree=i == 0)
            votes.append(counted.count - before)
            exact.append(dst is None or torch.equal(dst, torch.full((4, 8), 1.0 + i)))
    return votes, exact


def test_alternating_batches_skip_the_vote_once_the_sequence_repeats(pool):
    for votes, exact in pool.run(_job_sequence, 2, timeout_s=60):
        assert votes == [1, 1, 1, 0, 0, 0, 0, 0] and all(exact)


def _job_deviation(job):
    """After a, b, a, b, every rank predicts a. Rank 1 calls b instead (a caller's bug:
    two batches with the same messages). Rank 0 skips the vote and sends a's bytes;
    rank 1, not predicted, votes, so a's bytes never land in b's destination: rank 1
    fails when the group times out (or rank 0 leaves). Without the prediction both skip
    and rank 1 silently takes a's bytes into b."""
    init_gloo_world(job, timeout_s=5)
    planner = Planner()
    for i, name in enumerate("abab"):
        dst = torch.zeros(4, 8) if job.rank == 1 else None
        xfer_batch([_named(name, job.rank, 1, dst)], None, planner=planner, agree=i == 0)
    name = "a" if job.rank == 0 else "b"
    dst = torch.full((4, 8), -1.0) if job.rank == 1 else None
    try:
        xfer_batch([_named(name, job.rank, 7, dst)], None, planner=planner, agree=False)
    except Exception as exc:  # the group's timeout, or the peer's connection closed
        return "raised", getattr(exc, "__notes__", []), dst is None or bool((dst == -1).all())
    return "returned", None, dst is None or bool((dst == -1).all())


def test_a_rank_that_deviates_from_the_sequence_fails_loudly_not_silently(pool):
    (_, _, _), (outcome, notes, untouched) = pool.run(_job_deviation, 2, timeout_s=90)
    assert outcome == "raised" and untouched
    assert any("not the one the group's history predicts" in n for n in notes), notes


def _job_staging(job):
    init_gloo_world(job)
    try:
        xfer_batch([_transfer(job.rank, torch.zeros(6, 4) if job.rank >= 2 else None)], None,
                   staging_bytes=(1 << 20) * (1 + (job.rank == 2)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_staging_bytes_fail_before_data_moves(pool):
    for text in pool.run(_job_staging, 4, timeout_s=60):
        assert "staging_bytes" in text and "2097152 on rank 2" in text \
            and "1048576 on ranks [0, 1, 3]" in text and "no data was moved" in text


def _job_xferdtensor(job, outsider):
    """xferdtensor with agree=False skips the vote once the call repeats; with a rank of
    the group outside both meshes every call votes (that rank cannot tell calls apart)."""
    init_gloo_world(job)
    planner = Planner()
    one0, one1 = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    votes, exact = [], []
    with VoteCount() as counted:
        for i in range(4):
            full = torch.full((4, 8), float(i))
            src = DTensorRef(full.clone(), full.shape) if job.rank == 0 else None
            dst = DTensorRef(torch.zeros(4, 8), full.shape) if job.rank == 1 else None
            before = counted.count
            xferdtensor(src, one0, [Replicate()], dst, one1, [Replicate()], None,
                        planner=planner, agree=False)
            votes.append(counted.count - before)
            exact.append(dst is None or torch.equal(dst.local, full))
    return votes, exact


def test_xferdtensor_without_agreement_skips_the_vote_for_repeated_calls(pool):
    assert pool.run(_job_xferdtensor, 2, False, timeout_s=60) == \
        [([1, 1, 0, 0], [True] * 4)] * 2
    assert pool.run(_job_xferdtensor, 3, True, timeout_s=60) == \
        [([1, 1, 1, 1], [True] * 4)] * 3


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


def test_call_sequence_predicts_each_calls_successor_and_forgets_on_failure():
    from megatron_reshard.engine import sequence

    history = sequence.CallSequence()
    assert not history.predicts("a")  # nothing went through yet
    for key in "abab":
        history.record(key)
    assert history.predicts("a") and not history.predicts("b")
    history.record("c")  # b was followed by c this time; nothing has followed c yet
    assert history.predicts("a") is False and history.successor["b"] == "c"
    history.forget()
    assert not history.predicts("a") and history.last is None
    keys = list(range(sequence.MAX_KEYS + 2))
    for key in keys:  # the table is cleared at the same call on every rank, then refilled
        history.record(key)
    assert len(history.successor) <= sequence.MAX_KEYS and history.last == keys[-1]
    assert history.successor[keys[-2]] == keys[-1]
