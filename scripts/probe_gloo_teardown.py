"""Where a failed gloo refit group's teardown spends its time, on a survivor (CPU only).

Three ranks in a refit group whose timeout is 8 s. Rank 0 waits (``faults.wait_works``) on
an operation with rank 1: a recv, or an all-reduce that rank 1 never joins (rank 2 does).
Then rank 1 is SIGKILLed ("kill"), or rank 2 posts a failure while rank 1 stays alive and
silent for 30 s ("post"). Rank 0 prints how long it took to raise, to run
``destroy_refit_group`` (the second half of the cases), to drop its last reference to the
group (with a ``gc.collect()``), and how long its process took to exit after that.

    PYTHONPATH=. python scripts/probe_gloo_teardown.py
"""

import gc
import multiprocessing as mp
import os
import signal
import time

import torch

from megatron_reshard.groups import faults
from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.tools.worlds import free_ports

TIMEOUT_S = 8.0


def _rank(rank: int, port: int, op: str, mode: str, destroy: bool, out) -> None:
    pg = create_refit_group("127.0.0.1", port, rank, 3, "gloo", TIMEOUT_S, who=f"rank {rank}")
    t = torch.zeros(4)
    pg.allreduce([t]).wait()
    if rank == 0:
        work = pg.allreduce([t]) if op == "allreduce" else pg.recv([t], 1, 0)
        t0 = time.monotonic()
        try:
            faults.wait_works([work], pg, op, [1])
        except Exception as exc:  # noqa: BLE001 - the failure is the subject
            out.put(("raised", time.monotonic() - t0, type(exc).__name__))
        del work
        t0 = time.monotonic()
        if destroy:
            destroy_refit_group(pg, 20)
        out.put(("destroy_refit_group", time.monotonic() - t0, ""))
        t0 = time.monotonic()
        del pg
        gc.collect()
        out.put(("drop the group", time.monotonic() - t0, ""))
        out.put(("exit", time.time(), ""))
        return
    if rank == 2 and op == "allreduce":
        pg.allreduce([t])  # joins; the all-reduce never completes without rank 1
    time.sleep(0.5)
    if rank == 1 and mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2 and mode == "post":
        faults.board_of(pg).post("planted")
    if rank == 1:
        time.sleep(30)
    destroy_refit_group(pg, 20)


def main() -> None:
    ctx = mp.get_context("spawn")
    print(f"faults module: {faults.__file__}; group timeout {TIMEOUT_S:g} s")
    for destroy in (False, True):
        for op in ("recv", "allreduce"):
            for mode in ("kill", "post"):
                out = ctx.Queue()
                port = free_ports(1)[0]
                procs = [ctx.Process(target=_rank, args=(r, port, op, mode, destroy, out))
                         for r in range(3)]
                for p in procs:
                    p.start()
                procs[0].join()
                exited = time.time()
                got = [out.get() for _ in range(4)]
                steps = ", ".join(f"{name} {s:.2f} s" for name, s, _ in got[:3]
                                  if destroy or name != "destroy_refit_group")
                print(f"{op:9} {mode:4}: {got[0][2]}; {steps}; exit {exited - got[3][1]:.2f} s",
                      flush=True)
                for p in procs:
                    p.kill()


if __name__ == "__main__":
    main()
