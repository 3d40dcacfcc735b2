"""The benchmark harness on CPU: baselines and timing over real gloo worlds, report files.

Figures are only checked to be positive and finite (no wall-clock thresholds: two shared
cores). The engine-dependent part skips while the engine is not importable.
"""

import json
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.tools.bench import (BaselineGroups, BaselineParam, Column, NaiveRefit,
                                          format_table, gather_broadcast, measure_peak_extra,
                                          measure_raw_p2p, pattern_values, raw_p2p, time_collective,
                                          write_report)
from megatron_reshard.tools.bench.baselines import p2p_messages
from megatron_reshard.layout.geometry import rank_box
from megatron_reshard.tools.bench.env_options import apply_env
from megatron_reshard.tools.bench.transfer_cases import build_cases, parse_size
from megatron_reshard.tools.bench.transfer_main import build_parser
from megatron_reshard.tools.bench.transfer_run import COLUMNS
from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.tools.worlds import init_gloo_world

CPU = torch.device("cpu")


def _positive_finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


# ----------------------------------------------------------------- jobs (module level)


def _raw_patterns_on_default_world(job):
    init_gloo_world(job)
    return {pattern: measure_raw_p2p(None, [0, 1], [2, 3], 4096, CPU, iters=2, warmup=1,
                                     pattern=pattern)
            for pattern in ("pair", "pairs", "fanin", "mxn")}


def _raw_pair_on_unregistered_group(job):
    store = dist.TCPStore(job.host, job.ports[1], job.nprocs, job.rank == 0,
                          timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("refit", store), job.rank, job.nprocs,
                               timedelta(seconds=60))
    m = raw_p2p(pg, [0, 1], [2, 3], 2048, CPU, iters=2, warmup=1, pattern="mxn")
    return m.gbps, m.timing.times_s


def _timing_is_the_same_on_every_rank(job):
    init_gloo_world(job)
    t = time_collective(lambda: dist.all_reduce(torch.ones(8)), None, device=CPU, iters=3,
                        warmup=1)
    return t.times_s


_PARAMS = [
    BaselineParam((8, 8), torch.bfloat16, src_dim=0, dst_dim=1),   # S(0) -> S(1)
    BaselineParam((4, 8), torch.float32, src_dim=1, dst_dim=0),    # S(1) -> S(0)
    BaselineParam((8, 4), torch.bfloat16, src_dim=None, dst_dim=0),  # Replicate -> S(0)
    BaselineParam((4, 2, 6), torch.bfloat16, src_dim=0, dst_dim=None),  # S(0) -> replicas
]


def _naive_refit_outputs(job, dst_ranks):
    init_gloo_world(job)
    groups = BaselineGroups.create([0, 1], dst_ranks)
    naive = NaiveRefit(_PARAMS, groups, CPU)
    naive.run()
    checks = []
    for i, (p, out) in enumerate(zip(_PARAMS, naive.outputs())):
        if out is None:
            continue
        box = [(0, n) for n in p.global_shape]
        if p.dst_dim is not None:
            k = dst_ranks.index(job.rank)
            size = p.global_shape[p.dst_dim] // len(dst_ranks)
            box[p.dst_dim] = (k * size, (k + 1) * size)
        checks.append(torch.equal(out, pattern_values(p.global_shape, box, p.dtype, CPU, i)))
    m = gather_broadcast(_PARAMS, groups, CPU, iters=2, warmup=1)
    return checks, m.gbps, m.bytes_per_dst


def _uneven_baseline_raises(job):
    init_gloo_world(job)
    groups = BaselineGroups.create([0, 1], [2, 3])
    with pytest.raises(ValueError, match="does not split evenly"):
        gather_broadcast(BaselineParam((5, 4), torch.bfloat16, 0, 1), groups, CPU, iters=1)
    return True


def _bench_main(job, argv):
    """Run the benchmark's main() as torchrun would (env:// rendezvous) in a pool worker."""
    env = {"MASTER_ADDR": job.host, "MASTER_PORT": str(job.ports[2]), "RANK": str(job.rank),
           "WORLD_SIZE": str(job.nprocs), "LOCAL_RANK": str(job.rank)}
    argv = [a.replace("{refit_port}", str(job.ports[3])) for a in argv]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from megatron_reshard.tools.bench.transfer_main import main

        return main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------- baselines


def test_raw_p2p_gives_positive_equal_figures_on_every_rank_for_each_pattern(pool):
    results = pool.run(_raw_patterns_on_default_world, 4)
    assert all(r == results[0] for r in results)
    assert set(results[0]) == {"pair", "pairs", "fanin", "mxn"}
    assert all(_positive_finite(v) for v in results[0].values())


def test_raw_p2p_runs_on_an_unregistered_group(pool):
    results = pool.run(_raw_pair_on_unregistered_group, 4)
    gbps, times = results[0]
    assert _positive_finite(gbps) and len(times) == 2
    assert all(r == results[0] for r in results)


def test_raw_p2p_messages_split_bytes_per_destination():
    assert p2p_messages("pair", [0, 1], [2, 3], 10) == [(0, 2, 10)]
    assert p2p_messages("fanin", [0, 1], [2, 3], 11) == [(0, 2, 6), (1, 2, 5)]
    mxn = p2p_messages("mxn", [0, 1], [2, 3], 10)
    assert sorted(mxn) == [(0, 2, 5), (0, 3, 5), (1, 2, 5), (1, 3, 5)]
    with pytest.raises(ValueError, match="overlap"):
        p2p_messages("pair", [0, 1], [1, 2], 10)
    with pytest.raises(ValueError, match="unknown pattern"):
        p2p_messages("ring", [0], [1], 10)


def test_timing_reports_the_slowest_rank_identically_everywhere(pool):
    results = pool.run(_timing_is_the_same_on_every_rank, 3)
    assert all(r == results[0] for r in results)
    assert len(results[0]) == 3 and all(_positive_finite(t) for t in results[0])


@pytest.mark.parametrize("dst_ranks", [[2, 3], [0, 1, 2, 3]], ids=["disjoint", "colocated"])
def test_gather_broadcast_delivers_exact_destination_parts_and_a_figure(pool, dst_ranks):
    results = pool.run(_naive_refit_outputs, 4, dst_ranks)
    for rank, (checks, gbps, per_dst) in enumerate(results):
        assert len(checks) == (len(_PARAMS) if rank in dst_ranks else 0)
        assert all(checks), f"rank {rank}: wrong destination part {checks}"
        assert _positive_finite(gbps)
    n = len(dst_ranks)
    expected = (8 * 8 // n * 2) + (4 * 8 // n * 4) + (8 * 4 // n * 2) + 4 * 2 * 6 * 2
    assert results[0][2] == expected


def test_gather_broadcast_rejects_an_uneven_split_before_any_traffic(pool):
    assert pool.run(_uneven_baseline_raises, 4) == [True] * 4


def test_peak_memory_is_not_measured_off_cuda():
    result, peak = measure_peak_extra(lambda: 42, CPU)
    assert result == 42 and peak is None


# ----------------------------------------------------------------- report


def test_report_writes_a_table_with_every_row_and_column_and_json(tmp_path):
    rows = [{"case": "a", "engine_gbps": 123.456, "baseline_gbps": float("nan")},
            {"case": "b|c", "engine_gbps": 0.00123}]
    cols = [Column("case", "case"), Column("engine_gbps", "GB/s", "{:.1f}"),
            Column("baseline_gbps", "g+b")]
    table = format_table(rows, cols)
    lines = table.splitlines()
    assert lines[0] == "| case | GB/s | g+b |"
    assert len(lines) == 2 + len(rows)
    assert "| a | 123.5 | n/a |" in lines and "| b\\|c | 0.0 | n/a |" in lines
    paths = write_report(tmp_path / "out", rows, cols, meta={"iters": 3}, stem="t")
    assert paths.markdown.read_text().startswith("| case |")
    data = json.loads(paths.json.read_text())
    assert data["meta"] == {"iters": 3}
    assert [r["case"] for r in data["rows"]] == ["a", "b|c"]
    assert data["rows"][0]["baseline_gbps"] is None  # NaN is not JSON
    assert paths.png is None  # no plot asked for


def test_report_plot_is_written_or_skipped_without_matplotlib(tmp_path, capsys):
    from megatron_reshard.tools.bench import plot_bandwidth

    out = plot_bandwidth([{"case": "a", "engine_gbps": 1.0}], tmp_path / "p.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert out is None and "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert out is not None and out.stat().st_size > 0


# ----------------------------------------------------------------- transfer benchmark


def test_cli_pieces_sizes_env_and_cases():
    assert parse_size("64M") == 64 << 20 and parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    env: dict = {"NCCL_NVLS_ENABLE": "1"}
    args = build_parser().parse_args(["--p2p-channels", "32", "--nccl-env", "NCCL_DEBUG=WARN"])
    apply_env(args, env)
    assert env["NCCL_NVLS_ENABLE"] == "1"  # an explicit setting is kept
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NCCL_MIN_P2P_NCHANNELS"] == env["NCCL_MAX_P2P_NCHANNELS"] == "32"
    assert env["NCCL_DEBUG"] == "WARN"
    names = [c.name for c in build_cases(False, 4, [64 << 20])]
    assert names == ["s0_s1", "colocated_s0_s1", "tp2_tp4", "dense_s0_s0", "experts_s0_s1", "experts_s0_s2",
                     "rep_s0", "s0_dp2", "small_200", "mixed_1000", "sweep_64M"]
    big = build_cases(False, 4)
    assert big[0].params[0].nbytes == 512 << 20
    assert len(big[-1].params) == 1000
    assert "tp2_tp4" not in [c.name for c in build_cases(True, 2)]


def test_the_bench_cuts_shards_with_the_engines_torch_chunk_rules():
    # the bench's shards come from layout.geometry.rank_box (it had its own copy)
    mesh = MeshInfo(torch.tensor([2, 3, 4]))
    from torch.distributed.tensor import Replicate, Shard

    assert rank_box((7, 5), mesh, [Shard(0)], 2) == ((0, 3), (0, 5))
    assert rank_box((7, 5), mesh, [Shard(0)], 4) == ((6, 7), (0, 5))
    assert rank_box((7, 5), mesh, [Replicate()], 3) == ((0, 7), (0, 5))
    assert rank_box((7, 5), mesh, [Shard(1)], 0) is None
    mesh2 = MeshInfo(torch.tensor([[0, 1], [2, 3]]))
    assert rank_box((8,), mesh2, [Shard(0), Shard(0)], 1) == ((2, 4),)


def test_bench_main_runs_baselines_only_and_writes_the_report(pool, tmp_path):
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--small", "--no-engine", "--iters", "1", "--warmup", "0",
            "--cases", "s0_s1", "rep_s0", "--out", str(out)]
    assert pool.run(_bench_main, 4, argv) == [0] * 4
    rows = json.loads((out / "transfer.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["s0_s1", "rep_s0"]
    for r in rows:
        for key in ("raw_pair_gbps", "raw_fanin_gbps", "raw_mxn_gbps", "baseline_gbps"):
            assert _positive_finite(r[key]), (r["case"], key, r.get(key))
        assert r.get("engine_gbps") is None
    md = (out / "transfer.md").read_text()
    assert all(f"| {c.header} |" in md or f"| {c.header}" in md for c in COLUMNS)


def test_bench_main_with_the_engine_is_exact_and_reports_ratios(pool, tmp_path):
    pytest.importorskip("megatron_reshard.engine", reason="engine not importable yet")
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--small", "--iters", "1", "--warmup", "1",
            "--cases", "s0_s1", "tp2_tp4", "experts_s0_s2", "s0_dp2", "small_200",
            "--out", str(out)]
    assert pool.run(_bench_main, 4, argv, timeout_s=300) == [0] * 4
    rows = json.loads((out / "transfer.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["s0_s1", "tp2_tp4", "experts_s0_s2", "s0_dp2",
                                         "small_200"]
    for r in rows:
        assert r["check"] == "exact", r
        for key in ("engine_gbps", "raw_pair_gbps", "engine_vs_raw", "agreed_gbps",
                    "baseline_gbps", "engine_vs_baseline", "us_per_param"):
            assert _positive_finite(r[key]), (r["case"], key, r.get(key))


def test_bench_main_over_a_cross_world_refit_group(pool, tmp_path):
    pytest.importorskip("megatron_reshard.engine", reason="engine not importable yet")
    pytest.importorskip("megatron_reshard.groups.comm", reason="comm not importable yet")
    out = tmp_path / "bench"
    argv = ["--device", "cpu", "--small", "--iters", "1", "--warmup", "1", "--cross-world",
            "--refit-port", "{refit_port}", "--cases", "s0_s1", "--out", str(out)]
    assert pool.run(_bench_main, 4, argv, timeout_s=300) == [0] * 4
    data = json.loads((out / "transfer.json").read_text())
    assert "create_refit_group" in data["meta"]["group"]
    (row,) = data["rows"]
    assert row["check"] == "exact"
    assert _positive_finite(row["engine_gbps"]) and _positive_finite(row["raw_mxn_gbps"])
