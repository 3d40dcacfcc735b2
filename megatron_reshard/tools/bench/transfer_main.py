"""Transfer benchmark: the engine's ``xfer_batch`` against raw P2P and gather+broadcast.

Run under torchrun; the first half of the ranks are the source (training) side, the second
half the destination (generation) side: 4 GPUs → sources {0,1}, destinations {2,3};
2 GPUs → 0 → 1. Every figure of a row is measured in the same run::

    torchrun --nproc-per-node 4 scripts/bench_transfer.py [--iters 10] [--out bench_out/transfer]
    torchrun --nproc-per-node 4 scripts/bench_transfer.py --device cpu --small   # gloo smoke
    megatron-reshard bench transfer -- [options]          # the CLI runs this module

Layouts (global shapes; ``--small`` shrinks them for CPU smoke runs):

- ``s0_s1``: [16384,16384] bf16 Shard(0) on the sources → Shard(1) on the destinations
  (512 MiB; 256 MiB into each destination with 2+2 ranks).
- ``colocated_s0_s1``: the same tensor, Shard(0) → Shard(1) with every rank on both sides:
  each rank keeps one block locally and exchanges the others (on 2 GPUs, the one case
  where both directions of a link and the local copies run at once).
- ``tp2_tp4``: [8192,8192] bf16 Shard(0) on the sources (TP2) → Shard(0) over *all* ranks
  (TP4). With only two destination GPUs a true TP4 needs the source ranks on the
  destination side too, so this is the colocated refit: each source keeps one chunk
  locally and sends one to a destination rank. Needs 4+ ranks.
- ``dense_s0_s0``: [12288,4096] bf16 Shard(0) → Shard(0) (TP2 → TP2 on disjoint ranks:
  pairs only; the reference's "dense" row).
- ``experts_s0_s1``: [128,768,2048] Shard(0) (EP) → Shard(1) (TP);
  ``experts_s0_s2``: [128,2048,768] Shard(0) → Shard(2).
- ``rep_s0``: [16384,8192] Replicate on the sources → Shard(0) on the destinations.
- ``s0_dp2``: [16384,8192] Shard(0) → Replicate (one full replica per destination).
- ``small_200``: 200 × [4096] bf16 Replicate → Replicate, one ``xfer_batch`` call.
- ``mixed_1000``: 1000 small parameters of mixed shapes/layouts/dtypes (norms, column and
  row shards, transposed shards, biases, experts), one ``xfer_batch`` call.
- ``sweep_<size>``: square bf16 Shard(0) → Shard(1) tensors of the ``--sizes`` given.

Meshes are 1-D: the exchanges above are the ones 2+2 GPUs can make; 2-D meshes are
exercised by the engine's own tests.

Per row: bytes into each destination rank; engine time (median of ``--iters`` after
``--warmup``, each iteration barrier-aligned and timed on the slowest rank), the first
(cold, planning) call, GB/s per destination; raw NCCL P2P GB/s with the same bytes per
destination — one pair, fan-in of all sources into one destination, and all sources to
all destinations in one batch; engine/raw (against one pair: the per-GPU ceiling); the
same engine call with ``agree=False`` ("agreed once": the call repeats, so the engine
skips the agreement all-reduce and its host sync, as for every call its group's history
predicts; what the refit loop runs from its second refit on) and its ratio;
gather+broadcast (all-gather on the sources, broadcast of the full tensor, slice) and
engine/baseline; µs per parameter; peak extra GPU memory of one engine call (max over
source ranks / destination ranks); and whether the destination shards came out exact.

Without an importable engine, the baselines still run and the engine columns are n/a.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout import MeshInfo

from ..launch_env import apply_nccl_defaults
from .baselines import BaselineGroups, BaselineParam, gather_broadcast, raw_p2p
from .memory import measure_peak_extra
from .patterns import chunk_bounds, pattern_values
from .report import Column, format_table, plot_bandwidth, sig, write_report
from .timing import GroupOps, synchronize, time_collective, time_first_call

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
BF16, FP32 = torch.bfloat16, torch.float32
_SENTINEL = -1000.0  # outside the pattern's value range [-125, 125]


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class ParamSpec:
    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    src: tuple  # placements on the 1-D source mesh
    dst: tuple  # placements on the 1-D destination mesh

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    params: tuple[ParamSpec, ...]
    dst_on: str = "dst"  # "dst": the destination ranks; "all": every rank (colocated)
    src_on: str = "src"  # "src": the source ranks; "all": every rank


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _pl(p) -> str:
    return f"S({p.dim})" if isinstance(p, Shard) else "R"


def _one(name: str, shape: Sequence[int], src, dst, dtype=BF16, dst_on: str = "dst",
         note: str = "", src_on: str = "src") -> Case:
    shape = tuple(shape)
    dt = {BF16: "bf16", FP32: "fp32"}.get(dtype, str(dtype))
    layout = f"{list(shape)} {dt} {_pl(src)}→{_pl(dst)}{note}"
    return Case(name, layout, (ParamSpec(name, shape, dtype, (src,), (dst,)),),
                dst_on, src_on)


def _mixed_params(count: int, dims: Sequence[int], experts: Sequence[int]) -> tuple[ParamSpec, ...]:
    rng = random.Random(1234)
    out = []
    for i in range(count):
        kind = i % 7
        a, b = rng.choice(dims), rng.choice(dims)
        if kind == 0:
            out.append(ParamSpec(f"p{i}.norm", (a,), FP32, (R,), (R,)))
        elif kind == 1:
            out.append(ParamSpec(f"p{i}.col", (a, b), BF16, (S0,), (S0,)))
        elif kind == 2:
            out.append(ParamSpec(f"p{i}.row", (a, b), BF16, (S1,), (S1,)))
        elif kind == 3:
            out.append(ParamSpec(f"p{i}.swap", (a, b), BF16, (S0,), (S1,)))
        elif kind == 4:
            out.append(ParamSpec(f"p{i}.rep_to_shard", (a, b), BF16, (R,), (S0,)))
        elif kind == 5:
            out.append(ParamSpec(f"p{i}.bias", (a,), BF16, (S0,), (R,)))
        else:
            out.append(ParamSpec(f"p{i}.experts", (rng.choice(experts), a, b), BF16,
                                 (S0,), (S1,)))
    return tuple(out)


def parse_size(text: str) -> int:
    """'64M', '1G', '512MiB', '4096' → bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _size_label(nbytes: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def build_cases(small: bool, world_size: int, sizes: Sequence[int] = ()) -> list[Case]:
    """The benchmark's layouts (see module docstring); ``small`` for CPU smoke runs."""
    k = 32 if small else 1  # shrink factor for the big dims
    cases = [
        _one("s0_s1", (16384 // k, 16384 // k), S0, S1),
        _one("colocated_s0_s1", (16384 // k, 16384 // k), S0, S1, src_on="all", dst_on="all",
             note=" (every rank on both sides)"),
    ]
    if world_size >= 4:
        cases.append(_one("tp2_tp4", (8192 // k, 8192 // k), S0, S0, dst_on="all",
                          note=" (TP2→TP4 on all ranks)"))
    cases += [
        _one("dense_s0_s0", (12288 // k, 4096 // k), S0, S0),
        _one("experts_s0_s1", (128 // (8 if small else 1), 768 // k, 2048 // k), S0, S1),
        _one("experts_s0_s2", (128 // (8 if small else 1), 2048 // k, 768 // k), S0, S2),
        _one("rep_s0", (16384 // k, 8192 // k), R, S0),
        _one("s0_dp2", (16384 // k, 8192 // k), S0, R, note=" (full replica per dst)"),
    ]
    n_small = 200
    shape_small = (4096 // (16 if small else 1),)
    cases.append(Case("small_200", f"{n_small}×{list(shape_small)} bf16 R→R, one batch",
                      tuple(ParamSpec(f"small{i}", shape_small, BF16, (R,), (R,))
                            for i in range(n_small))))
    n_mixed = 200 if small else 1000
    dims = (8, 16, 32) if small else (64, 128, 256, 512)
    cases.append(Case(f"mixed_{n_mixed}", f"{n_mixed} mixed small params, one batch",
                      _mixed_params(n_mixed, dims, (4, 8))))
    for nbytes in sizes:
        side = max(64, int(math.isqrt(nbytes // 2)) // 64 * 64)
        cases.append(_one(f"sweep_{_size_label(nbytes)}", (side, side), S0, S1))
    return cases


# ----------------------------------------------------------------------------- geometry


def local_box(global_shape: Sequence[int], mesh: MeshInfo, placements: Sequence,
              rank: int) -> Optional[list[tuple[int, int]]]:
    """[lo, hi) per dim of ``rank``'s shard (torch.chunk rules, mesh axes in order)."""
    coord = mesh.coordinate_of(rank)
    if coord is None:
        return None
    box = [(0, n) for n in global_shape]
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            lo, hi = box[p.dim]
            a, b = chunk_bounds(hi - lo, mesh.shape[axis], coord[axis])
            box[p.dim] = (lo + a, lo + b)
    return box


def _box_bytes(box: Sequence[tuple[int, int]], dtype: torch.dtype) -> int:
    return math.prod(hi - lo for lo, hi in box) * _itemsize(dtype)


# ----------------------------------------------------------------------------- running


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
        sbox = local_box(p.global_shape, src_mesh, p.src, me)
        dbox = local_box(p.global_shape, dst_mesh, p.dst, me)
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
    per_dst = max(sum(_box_bytes(local_box(p.global_shape, dst_mesh, p.dst, r), p.dtype)
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


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_transfer",
        description=__doc__.split("\n\n")[0] + " Run under torchrun (2+ ranks, even count).",
        epilog="See megatron_reshard/tools/bench/transfer_main.py for the layouts and columns.")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (NCCL) or cpu (gloo); default: cuda when available")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke runs)")
    p.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                   help="only these cases (names as in the table; prefix match)")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[], metavar="SIZE",
                   help="extra S(0)→S(1) sweep rows of these global sizes (e.g. 64M 256M 1G)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 10; 3 with --small)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 3; 1 with --small)")
    p.add_argument("--timer", choices=["auto", "wall", "event"], default="auto",
                   help="wall: perf_counter + device sync (default); event: CUDA events")
    p.add_argument("--staging-mib", type=int, default=256, help="engine staging budget per rank")
    p.add_argument("--out", default="bench_out/transfer", help="output folder (md, json, png)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the exactness check of the destination shards")
    p.add_argument("--no-baseline", dest="baselines", action="store_false",
                   help="skip gather+broadcast")
    p.add_argument("--no-engine", action="store_true", help="baselines only")
    p.add_argument("--p2p-channels", type=int, default=None, metavar="N",
                   help="set NCCL_MIN_P2P_NCHANNELS and NCCL_MAX_P2P_NCHANNELS to N before init")
    p.add_argument("--nccl-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable before init (repeatable)")
    p.add_argument("--cross-world", action="store_true",
                   help="move the engine and raw P2P traffic over a refit group built by "
                        "megatron_reshard.comm.create_refit_group (unregistered), not the "
                        "torchrun world")
    p.add_argument("--refit-port", type=int, default=None,
                   help="TCPStore port for --cross-world (default MASTER_PORT + 17)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process group timeouts")
    return p


def apply_env(args: argparse.Namespace, environ: "os._Environ | dict" = os.environ) -> dict:
    """Set the NCCL-related environment before any process group exists; return it."""
    apply_nccl_defaults(environ)
    if args.p2p_channels is not None:
        environ["NCCL_MIN_P2P_NCHANNELS"] = str(args.p2p_channels)
        environ["NCCL_MAX_P2P_NCHANNELS"] = str(args.p2p_channels)
    for item in args.nccl_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--nccl-env wants KEY=VALUE, got {item!r}")
        environ[key] = value
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_"))}


def _load_engine(args: argparse.Namespace) -> tuple[Any, str]:
    if args.no_engine:
        return None, "disabled (--no-engine)"
    try:
        import megatron_reshard.engine as eng

        eng.Transfer, eng.xfer_batch  # noqa: B018 - the contract's names must exist
        return eng, "megatron_reshard.engine"
    except (ImportError, AttributeError) as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})"


def _refit_group(args: argparse.Namespace, backend: str,
                 device: torch.device) -> Optional[dist.ProcessGroup]:
    if not args.cross_world:
        return None
    from megatron_reshard.comm import create_refit_group

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = args.refit_port or int(os.environ.get("MASTER_PORT", "29500")) + 17
    return create_refit_group(host=host, port=port, rank=dist.get_rank(),
                              world_size=dist.get_world_size(), backend=backend,
                              timeout_s=args.timeout_s,
                              device=device if device.type == "cuda" else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    env = apply_env(args)
    if args.iters is None:
        args.iters = 3 if args.small else 10
    if args.warmup is None:
        args.warmup = 1 if args.small else 3
    want_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        print("bench_transfer: --device cuda but no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("bench_transfer: run under torchrun, e.g. "
              "torchrun --nproc-per-node 4 scripts/bench_transfer.py", file=sys.stderr)
        return 2
    timeout = timedelta(seconds=args.timeout_s)
    if want_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        backend = "gloo"
    try:
        return _run(args, device, backend, env)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device, backend: str, env: dict) -> int:
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world < 2 or world % 2:
        if rank == 0:
            print(f"bench_transfer: needs an even number of ranks >= 2, got {world}",
                  file=sys.stderr)
        return 2
    engine, engine_note = _load_engine(args)
    group = _refit_group(args, backend, device)
    try:
        return _run_cases(args, device, backend, env, engine, engine_note, group)
    finally:
        if group is not None:
            from megatron_reshard.comm import destroy_refit_group

            destroy_refit_group(group)


def _run_cases(args: argparse.Namespace, device: torch.device, backend: str, env: dict,
               engine, engine_note: str, group: Optional[dist.ProcessGroup]) -> int:
    world = dist.get_world_size()
    rank = dist.get_rank()
    ctx = Context(group=group, device=device, src_ranks=list(range(world // 2)),
                  dst_ranks=list(range(world // 2, world)), world_size=world,
                  iters=args.iters, warmup=args.warmup, timer=args.timer,
                  staging_bytes=args.staging_mib << 20, check=args.check, engine=engine,
                  baselines=args.baselines)
    cases = build_cases(args.small, world, args.sizes)
    if args.cases:
        cases = [c for c in cases if any(c.name.startswith(n) for n in args.cases)]
        if not cases:
            ctx.log(f"bench_transfer: no case matches {args.cases}")
            return 2
    ctx.log(f"bench_transfer: {world} ranks on {device.type} ({backend}), sources "
            f"{ctx.src_ranks} → destinations {ctx.dst_ranks}; engine: {engine_note}; "
            f"{len(cases)} cases, median of {args.iters} after {args.warmup} warmup")
    rows = [run_case(ctx, case) for case in cases]
    synchronize(device)
    if rank == 0:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "world_size": world, "src_ranks": ctx.src_ranks, "dst_ranks": ctx.dst_ranks,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": backend, "torch": torch.__version__,
            "nccl": (".".join(map(str, torch.cuda.nccl.version()))
                     if device.type == "cuda" else None),
            "group": "refit group (create_refit_group)" if args.cross_world
                     else "torchrun default world",
            "engine": engine_note, "iters": args.iters, "warmup": args.warmup,
            "timer": args.timer, "staging_mib": args.staging_mib, "small": args.small,
            "env": env, "argv": sys.argv,
        }
        table = format_table(rows, COLUMNS)
        print(table, flush=True)
        for r in rows:
            if "error" in r:
                print(f"{r['case']}: {r['error']}")
        paths = write_report(
            args.out, rows, COLUMNS, meta=meta, stem="transfer",
            title="Transfer benchmark: engine vs raw P2P vs gather+broadcast",
            plot=lambda rs, path: plot_bandwidth(rs, path, title="GB/s per destination rank"))
        print(f"wrote {paths.markdown}, {paths.json}" + (f", {paths.png}" if paths.png else ""))
    bad = any(r.get("check") == "MISMATCH" or "error" in r for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
