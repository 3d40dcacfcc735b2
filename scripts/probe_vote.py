"""What the engine's agreement vote costs, piece by piece (a diagnostic; 2+ ranks).

    torchrun --nproc-per-node 2 scripts/probe_vote.py [--iters 200]

Slowest rank's median µs of: the engine's vote (``agree.start`` + ``agree.conclude``) right after a
barrier and device sync; a bare NCCL all-reduce of the same int64 slots plus a sync; the
same back to back (no barrier: latency without arrival skew); a gloo all-reduce of the
slots over a CPU group of the same ranks; and the engine vote queued behind a 256 MiB
point-to-point transfer on the same communicator (what a loop of calls meets).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.engine.agree import Vote, conclude, start
from megatron_reshard.engine.p2p import P2PTransport
from megatron_reshard.tools.launch_env import apply_nccl_defaults


def slowest_median(samples: list, device) -> float:
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return 1e6 * float(t[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--profile", action="store_true",
                    help="also print rank 0's cProfile of the engine's votes")
    args = ap.parse_args()
    apply_nccl_defaults(os.environ)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    me, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    transport = P2PTransport(dist.group.WORLD, device)
    values = list(range(world + 8 + 9 + world))  # as many slots as the engine's vote
    vote = Vote(None, 1, 256 << 20, 12345, 0, 0, (4096,))

    def engine_vote(over=transport):
        return conclude(start(vote, over), lambda: None, over, "probe")

    raw = P2PTransport(dist.group.WORLD._get_backend(device), device)  # no c10d dispatcher

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn, aligned: bool) -> list:
        out = []
        for _ in range(args.iters):
            if aligned:
                dist.barrier()
                sync()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    slots = torch.tensor(values, dtype=torch.int64, device=device)

    def bare():
        dist.all_reduce(slots, op=dist.ReduceOp.MAX)
        sync()

    cpu_slots = torch.tensor(values, dtype=torch.int64)

    def over_gloo():
        dist.all_reduce(cpu_slots, op=dist.ReduceOp.MAX, group=gloo)

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group = dist.group.WORLD

    def plain_h2d_d2h():  # one pageable H2D, the all-reduce, one D2H (its own sync)
        flags = torch.tensor(values, dtype=torch.int64, device=device)
        group.allreduce([flags], opts).wait()
        return flags.tolist()

    pinned_in = torch.empty(len(values), dtype=torch.int64, pin_memory=cuda)
    pinned_out = torch.empty(len(values), dtype=torch.int64, pin_memory=cuda)
    dev_buf = torch.empty(len(values), dtype=torch.int64, device=device)

    def pinned(spin: bool):  # pinned copies both ways, one wait on an event
        pinned_in.copy_(torch.tensor(values, dtype=torch.int64))
        dev_buf.copy_(pinned_in, non_blocking=True)
        group.allreduce([dev_buf], opts).wait()
        pinned_out.copy_(dev_buf, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        while spin and not ev.query():
            pass
        ev.synchronize()
        return pinned_out.tolist()

    proto = torch.tensor(values, dtype=torch.int64, device=device)

    def kept_slots():  # the slots kept on the device: one copy kernel instead of an H2D
        flags = proto.clone()
        group.allreduce([flags], opts).wait()
        return flags.tolist()

    pieces = {"h2d": [], "launch": [], "d2h": []}

    def in_pieces():  # the plain variant, each piece timed on the host
        t0 = time.perf_counter()
        flags = torch.tensor(values, dtype=torch.int64, device=device)
        t1 = time.perf_counter()
        group.allreduce([flags], opts).wait()
        t2 = time.perf_counter()
        flags.tolist()
        t3 = time.perf_counter()
        for k, dt in zip(pieces, (t1 - t0, t2 - t1, t3 - t2)):
            pieces[k].append(dt)

    engine_pieces = {"engine start": [], "engine conclude": []}

    def engine_in_pieces():
        t0 = time.perf_counter()
        pending = start(vote, transport)
        t1 = time.perf_counter()
        conclude(pending, lambda: None, transport, "probe")
        t2 = time.perf_counter()
        engine_pieces["engine start"].append(t1 - t0)
        engine_pieces["engine conclude"].append(t2 - t1)

    rows = {}
    timed(engine_in_pieces, True)
    rows |= engine_pieces
    if cuda:
        rows["plain: H2D, all-reduce, D2H, aligned"] = timed(plain_h2d_d2h, True)
        rows["kept device slots: clone, all-reduce, D2H, aligned"] = timed(kept_slots, True)
        timed(in_pieces, True)
        rows |= {f"plain, piece: {k}": v for k, v in pieces.items()}
        rows["plain: back to back"] = timed(plain_h2d_d2h, False)
        rows["pinned, one event sync, aligned"] = timed(lambda: pinned(False), True)
        rows["pinned, spin on event, aligned"] = timed(lambda: pinned(True), True)
    rows |= {
        "engine vote, aligned": timed(lambda: engine_vote(), True),
        "engine vote, back to back": timed(lambda: engine_vote(), False),
        "engine vote over the raw backend, aligned": timed(lambda: engine_vote(raw), True),
        "bare NCCL all-reduce + sync, aligned": timed(bare, True),
        "bare NCCL all-reduce + sync, back to back": timed(bare, False),
        "gloo all-reduce (CPU group), aligned": timed(over_gloo, True),
        "gloo all-reduce (CPU group), back to back": timed(over_gloo, False),
    }
    if cuda and world >= 2:
        buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)

        def behind_transfer():
            ops = [dist.P2POp(dist.isend if me == 0 else dist.irecv, buf, 1 - me)] if me < 2 else []
            t0 = time.perf_counter()
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
            launched = time.perf_counter()
            engine_vote()
            return launched - t0

        out = []
        for _ in range(20):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            behind_transfer()
            out.append(time.perf_counter() - t0)
        rows["256 MiB P2P then engine vote (host blocked until)"] = out
        p2p = []
        for _ in range(20):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            ops = [dist.P2POp(dist.isend if me == 0 else dist.irecv, buf, 1 - me)] if me < 2 else []
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
            sync()
            p2p.append(time.perf_counter() - t0)
        rows["256 MiB P2P alone + sync"] = p2p
    for name, samples in rows.items():
        m = slowest_median(samples, device)
        if me == 0:
            print(f"{name:<52} {m:9.1f} µs")
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        timed(lambda: engine_vote(), True)
        prof.disable()
        if me == 0:
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
