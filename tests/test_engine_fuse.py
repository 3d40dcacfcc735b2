"""Small params of one layout fused into one transfer (engine/fuse.py): which transfers
fuse (plain data, alike on every rank) and that fused batches stay bit-exact against the
golden reference and independently sliced full tensors, strided storage included."""

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.engine import Planner, Transfer
from megatron_reshard.engine.fuse import FUSE_MAX_BYTES, plan_fusion, shift_dims
from megatron_reshard.engine.plan import layout_key
from megatron_reshard.layout.placements import MeshInfo, PaddedShard


def _plans(transfers, planner):
    return [planner.plan(layout_key(t.global_shape, t.src_mesh, t.src_placements,
                                    t.dst_mesh, t.dst_placements)) for t in transfers]


def _t(name, shape, dtype, src, sp, dst, dp):
    return Transfer(name, shape, dtype, MeshInfo(torch.tensor(src)), sp,
                    MeshInfo(torch.tensor(dst)), dp)


def test_transfers_of_one_layout_and_dtype_fuse_in_order_of_their_first_member():
    ts = []
    for i in range(3):
        ts.append(_t(f"a{i}", (8, 6), torch.bfloat16, [0, 1], [Shard(0)], [1], [Replicate()]))
        ts.append(_t(f"b{i}", (8, 6), torch.float32, [0, 1], [Shard(0)], [1], [Replicate()]))
    ts.append(_t("alone", (4,), torch.bfloat16, [0], [Replicate()], [1], [Replicate()]))
    planner = Planner()
    fusion = plan_fusion(ts, _plans(ts, planner), 256 << 20, planner)
    assert [(e.members, e.index) for e in fusion.execs] == [((0, 2, 4), 0), ((1, 3, 5), 1),
                                                             (None, 6)]
    fused = fusion.plans[0].key
    assert fused[0] == (3, 8, 6) and fused[3] == (1,) and fused[6] == (-1,)
    assert fusion.fused_bytes == 3 * 48 * 2 + 3 * 48 * 4


def test_padded_large_and_over_budget_transfers_are_not_fused():
    # a padded source stacks its padding rows along, harmless; a padded destination's
    # image would overwrite its padding rows
    padded = [_t(f"v{i}", (10, 4), torch.bfloat16, [2], [Replicate()], [0, 1],
                 [PaddedShard(0, 12)]) for i in range(2)]
    big_rows = FUSE_MAX_BYTES // (4 * 2) + 1
    large = [_t(f"l{i}", (big_rows, 4), torch.bfloat16, [0], [Replicate()], [1],
                [Replicate()]) for i in range(2)]
    planner = Planner()
    assert plan_fusion(padded + large, _plans(padded + large, planner), 256 << 20,
                       planner) is None
    small = [_t(f"s{i}", (16,), torch.float32, [0], [Replicate()], [1], [Replicate()])
             for i in range(4)]
    # a budget of 8 * 128 bytes fuses 128 bytes: two of the 64-byte params
    fusion = plan_fusion(small, _plans(small, planner), 8 * 128, planner)
    assert [e.members for e in fusion.execs] == [(0, 1), None, None]


def test_shifted_dims_shard_the_next_dim_and_keep_replicate_and_padding():
    assert shift_dims((0, -1, 2, (1, 12))) == (1, -1, 3, (2, 12))


# ---- across processes -----------------------------------------------------------------


def _fused_cases():
    """Interleaved groups of one layout each, members in every storage kind."""
    from test_engine_mp import STORAGE

    layouts = [  # shape, dtype, (mesh, ranks, dims) src, dst
        ((8, 6), "bfloat16", ((2,), (0, 1), (0,)), ((2,), (1, 2), (1,))),
        ((5,), "float32", ((1,), (0,), (-1,)), ((2,), (1, 2), (-1,))),
        ((10, 3), "float16", ((1,), (3,), (-1,)), ((4,), (0, 1, 2, 3), (0,))),
        ((4, 6, 2), "bfloat16", ((2,), (1, 0), (0,)), ((2, 2), (0, 1, 2, 3), (-1, 2))),
    ]
    cases = []
    for i in range(24):
        shape, dtype, src, dst = layouts[i % len(layouts)]
        cases.append((f"p{i}", shape, dtype, 100 + i, src, dst, STORAGE[i % len(STORAGE)],
                      STORAGE[(i // 2) % len(STORAGE)]))
    return cases


def _run_fused(job, stagings):
    from test_engine_mp import _run_cases

    return _run_cases(job, _fused_cases(), stagings)


def test_fused_batches_are_exact_against_reference_and_sliced_full_tensors(pool):
    # 256 MiB: every group fused; 2 KiB: a part fused (256 bytes), the rest alone
    results = pool.run(_run_fused, 4, [256 << 20, 2048], timeout_s=120)
    assert [f for r in results for f in r] == []


def test_the_cases_above_do_fuse():
    from test_engine_mp import _build

    ts = [_build(c, 0)[0] for c in _fused_cases()]
    planner = Planner()
    fusion = plan_fusion(ts, _plans(ts, planner), 256 << 20, planner)
    assert [len(e.members) for e in fusion.execs] == [6, 6, 6, 6]
    part = plan_fusion(ts, _plans(ts, planner), 2048, planner)
    assert any(e.members for e in part.execs) and any(e.members is None for e in part.execs)
