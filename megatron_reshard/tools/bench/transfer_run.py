"""One transfer-benchmark row, measured on every rank: the engine call (cold, timed,
agreed once, peak memory, exactness), the raw P2P figures with the same bytes per
destination, and gather+broadcast (``transfer_main``'s docstring says what each column is).
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from megatron_reshard.layout.geometry import rank_box
from megatron_reshard.layout.placements import MeshInfo

from .baselines import BaselineGroups, BaselineParam, gather_broadcast, raw_p2p
from .memory import measure_peak_extra
from .patterns import pattern_values
from .report import Column, sig
from .timing import GroupOps, time_collective, time_first_call
from .transfer_cases import Case, itemsize

_SENTINEL = -1000.0  # outside the pattern's value range [-125, 125]


def _box_bytes(box: Sequence[tuple[int, int]], dtype: torch.dtype) -> int:
    return math.prod(hi - lo for lo, hi in box) * itemsize(dtype)



@dataclass
class Context:
    group: Optional[dist.ProcessGroup]     # the refit group (None: the default world)
    device: torch.device
    src_ranks: list[int]
    dst_ranks: list[int]
    world_size: int
    iters: int
    warmup: int
    timer: str
    staging_bytes: int
    check: bool
    engine: Any                            # the engine module, or None
    baselines: bool = True
    raw_cache: dict = None
    group_cache: dict = None

    def __post_init__(self) -> None:
        self.raw_cache = {}
        self.group_cache = {}

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def _raw_figures(ctx: Context, nbytes: int) -> dict[str, float]:
    if nbytes in ctx.raw_cache:
        return ctx.raw_cache[nbytes]
    out = {}
    for pattern in ("pair", "fanin", "mxn"):
        m = raw_p2p(ctx.group, ctx.src_ranks, ctx.dst_ranks, nbytes, ctx.device,
                    iters=ctx.iters, warmup=ctx.warmup, pattern=pattern, timer=ctx.timer)
        out[f"raw_{pattern}_gbps"] = m.gbps
    ctx.raw_cache[nbytes] = out
    return out


def _baseline_groups(ctx: Context, src_ranks: Sequence[int],
                     dst_ranks: Sequence[int]) -> BaselineGroups:
    key = (tuple(src_ranks), tuple(dst_ranks))
    if key not in ctx.group_cache:
        ctx.group_cache[key] = BaselineGroups.create(list(src_ranks), list(dst_ranks))
    return ctx.group_cache[key]


def _run_engine(ctx: Context, case: Case, src_mesh: MeshInfo, dst_mesh: MeshInfo,
                row: dict) -> None:
    eng = ctx.engine
    me = ctx.rank
    transfers, expected = [], []
    for i, p in enumerate(case.params):
        sbox = rank_box(p.global_shape, src_mesh, p.src, me)
        dbox = rank_box(p.global_shape, dst_mesh, p.dst, me)
        src = pattern_values(p.global_shape, sbox, p.dtype, ctx.device, i) if sbox else None
        dst = None
        if dbox:
            dst = torch.full([hi - lo for lo, hi in dbox], _SENTINEL, dtype=p.dtype,
                             device=ctx.device)
            expected.append((dst, p.global_shape, dbox, p.dtype, i))
        transfers.append(eng.Transfer(name=p.name, global_shape=p.global_shape, dtype=p.dtype,
                                      src_mesh=src_mesh, src_placements=list(p.src),
                                      dst_mesh=dst_mesh, dst_placements=list(p.dst),
                                      src=src, dst=dst))

    planner = eng.Planner()  # as the refit loop does: plans and schedules reused across calls

    def call(agree: bool = True) -> None:
        eng.xfer_batch(transfers, ctx.group, staging_bytes=ctx.staging_bytes, planner=planner,
                       agree=agree)

    row["engine_cold_ms"] = 1e3 * time_first_call(call, ctx.group, device=ctx.device,
                                                  timer=ctx.timer)
    if ctx.check:
        ok = all(torch.equal(dst, pattern_values(shape, box, dtype, ctx.device, salt))
                 for dst, shape, box, dtype, salt in expected)
        ops = GroupOps(ctx.group, ctx.device)
        all_ok = bool(ops.allreduce_min(torch.tensor([1.0 if ok else 0.0]))[0] > 0)
        row["check"] = "exact" if all_ok else "MISMATCH"
    timing = time_collective(call, ctx.group, device=ctx.device, iters=ctx.iters,
                             warmup=max(0, ctx.warmup - 1), timer=ctx.timer)
    row["engine_ms"] = 1e3 * timing.median_s
    row["engine_min_ms"] = 1e3 * timing.min_s
    row["engine_gbps"] = row["bytes_per_dst"] / timing.median_s / 1e9
    row["us_per_param"] = 1e6 * timing.median_s / len(case.params)

    # as the refit loop from its second refit on: no agreement step
    agreed = time_collective(lambda: call(agree=False), ctx.group, device=ctx.device, iters=ctx.iters,
                             warmup=1, timer=ctx.timer)
    row["agreed_ms"] = 1e3 * agreed.median_s
    row["agreed_gbps"] = row["bytes_per_dst"] / agreed.median_s / 1e9
    if ctx.device.type == "cuda":
        planner.release_staging()  # kept from the timed calls: let the measured one count them
        _, peak = measure_peak_extra(call, ctx.device)
        extra = peak.extra_bytes if peak else 0
        is_src, is_dst = me in src_mesh.ranks(), me in dst_mesh.ranks()
        both = GroupOps(ctx.group, ctx.device).allreduce_max(
            torch.tensor([extra if is_src else 0, extra if is_dst else 0], dtype=torch.float64))
        row["peak_extra_src_mib"] = float(both[0]) / (1 << 20)
        row["peak_extra_dst_mib"] = float(both[1]) / (1 << 20)


def run_case(ctx: Context, case: Case) -> dict:
    """Measure one case on every rank; returns the row (identical on every rank)."""
    dst_ranks = list(range(ctx.world_size)) if case.dst_on == "all" else ctx.dst_ranks
    src_ranks = list(range(ctx.world_size)) if case.src_on == "all" else ctx.src_ranks
    src_mesh = MeshInfo(torch.tensor(src_ranks))
    dst_mesh = MeshInfo(torch.tensor(dst_ranks))
    per_dst = max(sum(_box_bytes(rank_box(p.global_shape, dst_mesh, p.dst, r), p.dtype)
                      for p in case.params) for r in dst_ranks)
    row: dict = {"case": case.name, "layout": case.layout, "params": len(case.params),
                 "bytes_per_dst": per_dst, "mib_per_dst": per_dst / (1 << 20)}
    t0 = time.perf_counter()
    if ctx.engine is not None:
        try:
            _run_engine(ctx, case, src_mesh, dst_mesh, row)
        except Exception as exc:  # noqa: BLE001 - a failing case must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
            ctx.log(f"[{case.name}] engine failed:\n{traceback.format_exc()}")
        finally:
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    row.update(_raw_figures(ctx, per_dst))
    if ctx.baselines:
        params = [BaselineParam(p.global_shape, p.dtype,
                                p.src[0].dim if isinstance(p.src[0], Shard) else None,
                                p.dst[0].dim if isinstance(p.dst[0], Shard) else None)
                  for p in case.params]
        try:
            m = gather_broadcast(params, _baseline_groups(ctx, src_ranks, dst_ranks), ctx.device,
                                 iters=ctx.iters, warmup=ctx.warmup, timer=ctx.timer)
            row["baseline_ms"] = 1e3 * m.median_s
            row["baseline_gbps"] = m.gbps
        except ValueError as exc:  # uneven split: raised on every rank before any traffic
            row["baseline_note"] = str(exc)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    raw = row.get("raw_pair_gbps")
    eng = row.get("engine_gbps")
    if eng is not None and raw:
        row["engine_vs_raw"] = eng / raw
        if row.get("agreed_gbps"):
            row["agreed_vs_raw"] = row["agreed_gbps"] / raw
    if eng is not None and row.get("baseline_gbps"):
        row["engine_vs_baseline"] = eng / row["baseline_gbps"]
    ctx.log(f"[{case.name}] done in {time.perf_counter() - t0:.1f}s")
    return row


COLUMNS = [
    Column("case", "case"),
    Column("layout", "layout"),
    Column("mib_per_dst", "MiB/dst", "{:.2f}"),
    Column("engine_ms", "engine ms", sig),
    Column("engine_gbps", "engine GB/s/dst", sig),
    Column("raw_pair_gbps", "raw pair GB/s", sig),
    Column("raw_fanin_gbps", "raw fan-in GB/s", sig),
    Column("raw_mxn_gbps", "raw all→all GB/s", sig),
    Column("engine_vs_raw", "engine/raw", "{:.0%}"),
    Column("agreed_gbps", "agreed-once GB/s/dst", sig),
    Column("agreed_vs_raw", "agreed-once/raw", "{:.0%}"),
    Column("baseline_ms", "g+b ms", sig),
    Column("baseline_gbps", "g+b GB/s/dst", sig),
    Column("engine_vs_baseline", "engine/g+b", "{:.2f}×"),
    Column("us_per_param", "µs/param", sig),
    Column("engine_cold_ms", "cold ms", sig),
    Column("peak_extra_src_mib", "peak extra src MiB", "{:.0f}"),
    Column("peak_extra_dst_mib", "peak extra dst MiB", "{:.0f}"),
    Column("check", "check"),
]
