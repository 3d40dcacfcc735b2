"""A local shard given as a list of tensors, one per index of dim 0 (engine/members.py):
a rank's experts are read and written where they are, exact against independently
sliced full tensors, with staged, direct and local copies and with fused small params."""

import pytest
import torch

EXPERT_CASES = [  # name, shape, dtype, seed, (mesh, ranks, dims) src, dst
    ("ep_to_tp", (6, 8, 5), "bfloat16", 1, ((2,), (0, 1), (0,)), ((2,), (2, 3), (1,))),
    ("ep_to_s2", (4, 6, 16), "float32", 2, ((2,), (1, 0), (0,)), ((2,), (0, 1), (2,))),
    ("ep_to_replicas", (5, 3, 4), "bfloat16", 3, ((2,), (0, 1), (0,)), ((2, 2), (0, 1, 2, 3), (-1, 0))),
    ("ep_to_ep", (8, 4, 4), "float16", 4, ((4,), (0, 1, 2, 3), (0,)), ((2,), (3, 2), (0,))),
    ("small_fused_a", (4, 2, 2), "bfloat16", 5, ((2,), (0, 1), (0,)), ((1,), (2,), (-1,))),
    ("small_fused_b", (4, 2, 2), "bfloat16", 6, ((2,), (0, 1), (0,)), ((1,), (2,), (-1,))),
]


def _as_members(x, strided: bool):
    """``x`` as a list of separate tensors, one per index of dim 0 (every other one
    a strided view of a wider buffer when ``strided``)."""
    out = []
    for e in range(x.shape[0]):
        if strided and e % 2:
            wide = torch.empty(*x.shape[1:-1], 2 * x.shape[-1], dtype=x.dtype)
            m = wide[..., ::2]
        else:
            m = torch.empty(x.shape[1:], dtype=x.dtype)
        out.append(m.copy_(x[e]))
    return out


def _run_members(job, lists_on: str, stagings):
    from test_engine_mp import _as_bytes, _build, _fill_sentinel

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import Planner, xfer_batch

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=60)
    planner = Planner()
    built = [_build(c + (False, False), job.rank) for c in EXPERT_CASES]
    transfers, failures = [], []
    for i, (t, _) in enumerate(built):
        if t.src is not None and lists_on in ("src", "both"):
            t.src = _as_members(t.src, strided=i % 2 == 0)
        if t.dst is not None and lists_on in ("dst", "both") and t.dst.dim() > 0:
            t.dst = _as_members(t.dst, strided=i % 2 == 1)
        transfers.append(t)
    for staging in stagings:
        for t in transfers:
            for d in (t.dst if isinstance(t.dst, list) else [t.dst]) if t.dst is not None else []:
                _fill_sentinel(d)
        xfer_batch(transfers, pg, staging_bytes=staging, planner=planner)
        for (t, expect), case in zip(built, EXPERT_CASES):
            if t.dst is None:
                continue
            got = torch.stack(t.dst) if isinstance(t.dst, list) else t.dst
            if not torch.equal(_as_bytes(got), _as_bytes(expect)):
                failures.append(f"rank {job.rank} staging {staging} lists on {lists_on}: "
                                f"{case[0]} differs from the sliced full tensor")
    return failures


@pytest.mark.parametrize("lists_on", ["src", "dst", "both"])
def test_lists_of_members_are_read_and_written_in_place_exactly(pool, lists_on):
    # 256 MiB: one round, small cases fused; 96 bytes: many rounds, boxes cut mid-member
    results = pool.run(_run_members, 4, lists_on, [256 << 20, 96], timeout_s=120)
    assert [f for r in results for f in r] == []


def _wrong_members(job):
    from test_engine_mp import _build

    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import xfer_batch

    pg = create_refit_group(job.host, job.ports[0], job.rank, job.nprocs, timeout_s=60)
    t, _ = _build(EXPERT_CASES[0] + (False, False), job.rank)
    if t.src is not None:
        t.src = _as_members(t.src, strided=False)[:-1]  # one expert short
    try:
        xfer_batch([t], pg)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_list_of_the_wrong_length_fails_on_every_rank_before_data_moves(pool):
    messages = pool.run(_wrong_members, 4, timeout_s=60)
    assert all("members" in m and "found 2" in m for m in messages), messages
