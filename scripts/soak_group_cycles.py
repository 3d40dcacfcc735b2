"""The soak's rebuild loop in small (issue 52): what one refit group build + teardown leaves
on a long-lived rank, without models. Three processes: rank 0 hosts the group's store (a
training rank), ranks 1 and 2 live across every cycle (generation ranks). Each cycle builds
a gloo refit group, runs one all-reduce, and every ``--fail-every``-th cycle fails it (rank
2 posts a failure while rank 0 waits on a recv; the survivors retire the group) before all
ranks destroy it. Rank 1 prints its RSS (as is and after ``malloc_trim``), fds and threads
every ``--every`` cycles, after waiting out the failed groups' retirement.

    PYTHONPATH=. python scripts/soak_group_cycles.py --cycles 600 --fail-every 3
"""

import argparse
import ctypes
import multiprocessing as mp
import os
import time

import torch

from megatron_reshard.groups import faults
from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.tools.worlds import free_ports

TIMEOUT_S = 3.0


def _figures() -> dict:
    def rss() -> float:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

    out = {"rss_mib": rss()}
    ctypes.CDLL(None).malloc_trim(0)
    out["rss_trimmed_mib"] = rss()
    out["fds"] = len(os.listdir("/proc/self/fd"))
    out["threads"] = len(os.listdir("/proc/self/task"))
    return out


def _rank(rank: int, ports: list, fail_every: int, every: int, out) -> None:
    torch.set_num_threads(1)
    t = torch.zeros(1024)
    for cycle, port in enumerate(ports):
        group = create_refit_group("127.0.0.1", port, rank, 3, "gloo", TIMEOUT_S,
                                   who=f"rank {rank}")
        group.allreduce([t]).wait()
        failing = fail_every and cycle % fail_every == fail_every - 1
        if failing and rank == 0:
            try:
                faults.wait_works([group.recv([t], 1, 0)], group, "a recv", [1])
            except faults.RefitError:
                pass
        elif failing and rank == 2:
            faults.post_failure([group], RuntimeError("planted"))
        elif failing:
            try:
                group.board.raise_if_failed("waiting")
                while not group.board.failed:
                    time.sleep(faults.POLL_S)
                    group.board.raise_if_failed("waiting")
            except faults.RefitError:
                faults.retire(group)
        destroy_refit_group(group, timeout_s=10.0)
        del group
        if (cycle + 1) % every == 0:  # every rank waits: the next join is bounded
            time.sleep(TIMEOUT_S + faults.RETIRE_MARGIN_S + 0.5 if fail_every else 0)
            if rank == 1:
                out.put((cycle + 1, _figures()))
    if rank == 1:
        out.put(None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=600)
    p.add_argument("--fail-every", type=int, default=3, help="0: no failures")
    p.add_argument("--every", type=int, default=50, help="cycles between samples")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = free_ports(args.cycles)
    procs = [ctx.Process(target=_rank, args=(r, ports, args.fail_every, args.every, out))
             for r in range(3)]
    for proc in procs:
        proc.start()
    t0 = time.time()
    while (item := out.get()) is not None:
        cycle, figs = item
        print(f"cycle {cycle}: " + ", ".join(f"{k} {v:g}" for k, v in figs.items())
              + f" ({time.time() - t0:.0f} s)", flush=True)
    for proc in procs:
        proc.join(60)


if __name__ == "__main__":
    main()
