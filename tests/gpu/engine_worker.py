"""GPU checks of the transfer engine over NCCL. Run: torchrun --nproc-per-node 4 tests/gpu/engine_worker.py

Every check compares bit for bit against the golden reference over the same group, or
against independently sliced full tensors. Exits non-zero on the first failure; rank 0
prints ``ENGINE GPU WORKER OK`` at the end. Timing lines (overlap of concurrent receives,
engine vs raw send/recv) are informational only.
Keep NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 set.
"""

from __future__ import annotations

import os
import random
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.engine import Planner, Transfer, xfer_batch, xfer_batch_reference
from megatron_reshard.layout.placements import MeshInfo

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL = int(os.environ.get("LOCAL_RANK", RANK))
HOST = os.environ.get("MASTER_ADDR", "127.0.0.1")
BASE_PORT = int(os.environ.get("ENGINE_WORKER_PORT", int(os.environ.get("MASTER_PORT", 29500)) + 11))
CPU_DRY_RUN = os.environ.get("ENGINE_WORKER_CPU") == "1"  # gloo on CPU: checks the script itself
DEV = torch.device("cpu") if CPU_DRY_RUN else torch.device("cuda", LOCAL)
BACKEND = "gloo" if CPU_DRY_RUN else "nccl"


def sync():
    if not CPU_DRY_RUN:
        torch.cuda.synchronize()


def log(*a):
    if RANK == 0:
        print(*a, flush=True)


def mesh(shape, ranks):
    return MeshInfo(torch.tensor(ranks).reshape(shape))


def pl(dims):
    return [Replicate() if d < 0 else Shard(d) for d in dims]


def expected_local(full, m, dims, rank):
    coord = m.coordinate_of(rank)
    out = full
    for axis, d in enumerate(dims):
        if d >= 0:
            parts = torch.chunk(out, m.shape[axis], dim=d)
            c = coord[axis]
            out = parts[c] if c < len(parts) else out.narrow(d, out.shape[d], 0)
    return out


def as_bytes(t):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t).reshape(-1).view(torch.uint8)


def build(case, strided_dst=False):
    name, shape, dtype, seed, (s_shape, s_ranks, s_dims), (d_shape, d_ranks, d_dims) = case
    gen = torch.Generator(device="cpu").manual_seed(seed)
    numel = torch.Size(shape).numel()
    full = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8,
                         generator=gen).view(dtype).reshape(shape).to(DEV)
    sm, dm = mesh(s_shape, s_ranks), mesh(d_shape, d_ranks)
    src = expected_local(full, sm, s_dims, RANK).clone() if RANK in s_ranks else None
    expect = expected_local(full, dm, d_dims, RANK).clone() if RANK in d_ranks else None
    dst = None
    if expect is not None:
        if strided_dst and expect.ndim >= 1:
            dst = torch.zeros(expect.shape[:-1] + (2 * expect.shape[-1],), dtype=dtype,
                              device=DEV)[..., ::2]
        else:
            dst = torch.zeros(expect.shape, dtype=dtype, device=DEV)
    return Transfer(name, shape, dtype, sm, pl(s_dims), dm, pl(d_dims), src, dst), expect


def random_cases(n, seed):
    rnd = random.Random(seed)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float16]
    cases = []
    for i in range(n):
        ndim = rnd.randint(1, 3)
        shape = tuple(rnd.randint(0, 33) for _ in range(ndim))
        sides = []
        for _ in range(2):
            k = rnd.randint(1, WORLD)
            ranks = rnd.sample(range(WORLD), k)
            mshape = (k,) if k in (1, 3) or rnd.random() < 0.5 else (2, k // 2)
            dims = tuple(rnd.choice([-1] + list(range(ndim))) for _ in mshape)
            sides.append((mshape, ranks, dims))
        cases.append((f"rand{i}", shape, rnd.choice(dtypes), rnd.randint(0, 2**31), *sides))
    return cases


def check(transfers, expects, what):
    for t, e in zip(transfers, expects):
        if t.dst is not None and not torch.equal(as_bytes(t.dst), as_bytes(e)):
            raise AssertionError(f"rank {RANK}: {what}: param {t.name} differs from expectation")


def run_against_reference(pg, cases, what, stream=None, staging=256 << 20, strided=False):
    planner = Planner()
    built = [build(c, strided) for c in cases]
    transfers, expects = [b[0] for b in built], [b[1] for b in built]
    # cold call, warm call (cached schedule: the first round packs during the agreement),
    # then without the agreement, as the refit loop runs
    for agree in (True, True, False):
        for t in transfers:
            if t.dst is not None:
                t.dst.zero_()
        xfer_batch(transfers, pg, stream=stream, staging_bytes=staging, planner=planner,
                   agree=agree)
        if stream is not None:
            stream.synchronize()
        check(transfers, expects, what)
    refs = [Transfer(**{**t.__dict__, "dst": None if t.dst is None else torch.zeros_like(t.dst)})
            for t in transfers]
    xfer_batch_reference(refs, pg)
    for t, r in zip(transfers, refs):
        if t.dst is not None and not torch.equal(as_bytes(t.dst), as_bytes(r.dst)):
            raise AssertionError(f"rank {RANK}: {what}: param {t.name} differs from reference")
    sync()
    log(f"ok: {what} ({len(cases)} params)")


def timed(fn, reps=5):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def overlap_and_bandwidth(pg):
    """Informational: into rank 2 from 0 and 1 at once vs one after the other; engine S0->S1."""
    if WORLD < 4 or CPU_DRY_RUN:
        return
    n = 128 << 20  # elements of bf16 = 256 MiB per message
    buf = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    rec = [torch.empty(n, dtype=torch.bfloat16, device=DEV) for _ in range(2)]

    def concurrent():
        if RANK in (0, 1):
            pg.send([buf], 2, 0).wait()
        elif RANK == 2:
            works = [pg.recv([rec[i]], i, 0) for i in (0, 1)]
            for w in works:
                w.wait()

    def sequential():
        for src in (0, 1):
            if RANK == src:
                pg.send([buf], 2, 0).wait()
            elif RANK == 2:
                pg.recv([rec[src]], src, 0).wait()
                torch.cuda.synchronize()

    for fn in (concurrent, sequential):
        fn()  # warm-up (lazy communicators)
    tc, ts = timed(concurrent), timed(sequential)
    gb = 2 * n * 2 / 1e9
    log(f"info: into rank 2 from ranks 0+1, 2x256 MiB: concurrent {tc*1e3:.2f} ms "
        f"({gb/tc:.0f} GB/s), sequential {ts*1e3:.2f} ms ({gb/ts:.0f} GB/s), ratio {ts/tc:.2f}")

    full_shape = (16384, 16384)
    sm, dm = mesh((2,), (0, 1)), mesh((2,), (2, 3))
    src = torch.ones(8192, 16384, dtype=torch.bfloat16, device=DEV) if RANK < 2 else None
    dst = torch.empty(16384, 8192, dtype=torch.bfloat16, device=DEV) if RANK >= 2 else None
    t = Transfer("big", full_shape, torch.bfloat16, sm, [Shard(0)], dm, [Shard(1)], src, dst)
    planner = Planner()
    run = lambda: xfer_batch([t], pg, planner=planner)  # noqa: E731
    run()
    te = timed(run)
    log(f"info: engine [16384,16384] bf16 S(0) on 0,1 -> S(1) on 2,3: {te*1e3:.2f} ms, "
        f"{256*2**20/te/1e9:.0f} GB/s per destination (includes the agreement all-reduce)")


def staging_stays_within_budget(pg):
    """Calls queued without a host sync (as the refit loop's receiving side runs) hold
    no more than the staging budget: the planner's slots are reused in stream order, not
    freed per call (NCCL keeps freed buffers busy until its stream is past them)."""
    if WORLD < 2 or CPU_DRY_RUN:
        return
    half = WORLD // 2
    budget = 16 << 20  # two 8 MiB slots on CUDA
    sm, dm = mesh((half,), list(range(half))), mesh((WORLD - half,), list(range(half, WORLD)))
    batches = []
    for b in range(8):  # 32 MiB each, into strided destinations: every byte staged
        src = torch.ones(4096 // half, 4096, dtype=torch.bfloat16, device=DEV) if RANK < half else None
        dst = (torch.zeros(4096, 2 * (4096 // (WORLD - half)), dtype=torch.bfloat16,
                           device=DEV)[:, ::2] if RANK >= half else None)
        batches.append([Transfer(f"b{b}.w", (4096, 4096), torch.bfloat16, sm, [Shard(0)], dm,
                                 [Shard(1)], src, dst)])
    planner = Planner()
    # agreed, twice round, so that the calls' history predicts even the loop's first
    # call below (a vote there would wait for the busy GPU)
    for batch in batches * 2:
        xfer_batch(batch, pg, staging_bytes=budget, planner=planner)
    sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda._sleep(500_000_000)  # keep the GPU busy so the host queues every call
    for _ in range(3):
        for batch in batches:
            xfer_batch(batch, pg, staging_bytes=budget, planner=planner, agree=False)
    sync()
    extra = torch.cuda.max_memory_reserved() - base
    if extra > budget + (2 << 20):
        raise AssertionError(f"rank {RANK}: 24 queued staged calls reserved {extra >> 20} MiB, "
                             f"more than the {budget >> 20} MiB staging budget")
    log(f"ok: 24 queued staged calls stayed within the staging budget "
        f"({extra >> 20} MiB more reserved than after the warm-up, budget {budget >> 20} MiB)")


def bad_input_raises_everywhere(pg):
    if WORLD < 2:
        return
    sm, dm = mesh((1,), (0,)), mesh((1,), (1,))
    src = torch.ones(4, 4, device=DEV) if RANK == 0 else None
    dst = torch.zeros(4, 5, device=DEV) if RANK == 1 else None  # wrong shape on rank 1
    t = Transfer("bad.w", (4, 4), torch.float32, sm, [Replicate()], dm, [Replicate()], src, dst)
    try:
        xfer_batch([t], pg)
    except ValueError as exc:
        assert "bad.w" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {RANK}: bad input did not raise")
    log("ok: bad input raised on every rank")


def main():
    if not CPU_DRY_RUN:
        torch.cuda.set_device(DEV)
    pg = create_refit_group(HOST, BASE_PORT, RANK, WORLD, backend=BACKEND, timeout_s=120,
                            prefix="engine-gpu", device=None if CPU_DRY_RUN else DEV)
    w = list(range(WORLD))
    half = max(1, WORLD // 2)
    hand = [
        ("s0_s1", (64, 48), torch.bfloat16, 1, ((half,), w[:half], (0,)),
         ((WORLD - half,), w[half:] or w[:1], (1,))),
        ("replicas", (40, 8), torch.float8_e4m3fn, 2, ((half,), w[:half], (0,)),
         ((WORLD - half,), w[half:] or w[:1], (-1,))),
        ("both_sides", (9, 7), torch.float32, 3, ((WORLD,), w, (0,)), ((WORLD,), w[::-1], (1,))),
        ("experts", (8, 6, 10), torch.bfloat16, 4, ((half,), w[:half], (0,)),
         ((WORLD - half,), w[half:] or w[:1], (2,))),
    ]
    run_against_reference(pg, hand, "hand-checked layouts")
    run_against_reference(pg, hand, "hand-checked layouts, tiny staging", staging=256)
    run_against_reference(pg, hand, "hand-checked layouts, strided dst", strided=True)
    stream = None if CPU_DRY_RUN else torch.cuda.Stream()
    run_against_reference(pg, random_cases(120, 7), "random layouts on a side stream", stream=stream)
    run_against_reference(pg, random_cases(60, 8), "random layouts, 4 KiB staging", staging=4096)
    small = [(f"small{i}", (4096,), torch.bfloat16, 100 + i, ((half,), w[:half], (-1,)),
              ((WORLD - half,), w[half:] or w[:1], (-1,))) for i in range(200)]
    run_against_reference(pg, small, "200 small replicated tensors in one batch")
    bad_input_raises_everywhere(pg)
    staging_stays_within_budget(pg)

    # A registered default world built from an explicit store (not the agent store): group=None.
    store = dist.TCPStore(HOST, BASE_PORT + 1, WORLD, RANK == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(BACKEND, store=store, rank=RANK, world_size=WORLD,
                            timeout=timedelta(seconds=120),
                            device_id=None if CPU_DRY_RUN else DEV)
    run_against_reference(None, hand, "hand-checked layouts on the registered default world")
    overlap_and_bandwidth(pg)
    destroy_refit_group(pg)
    dist.destroy_process_group()
    log("ENGINE GPU WORKER OK")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not hang peers' teardown on a failed rank
