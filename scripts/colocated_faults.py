"""Colocated transport under faults, two processes on one device (a GPU: CUDA IPC; or CPU).

    python scripts/colocated_faults.py                   # one GPU
    python scripts/colocated_faults.py --device cpu      # shared memory

Needs torch only. Process 0 plays the training rank, process 1 the generation rank, as in
``bench_colocated.py`` (its Qwen3-30B-A3B-shaped buffers, ``--layers`` layers, cut into
the refit loop's batches of ``--batch-mib`` and moved as the loop moves them: ``overlap``,
then ``flush``). Each case runs a loop of refits on a fresh colocated refit group; at refit
``--at`` the victim kills itself (SIGKILL) or stops itself (SIGSTOP) mid-refit, after its
first batch (the generation rank's copies of it may still run: a training rank killed
then dies under them).
Reported per case: how long the survivor took to fail after the fault (the victim stores
the time just before it signals itself), the survivor's error, and whether the refits
before the fault were bit-exact. Cases: the training rank killed, the generation rank
killed, the training rank stopped, the generation rank stopped (a stopped rank's survivor
must fail by the group's timeout, ``--timeout``, plus the margin of 5 s; a stopped
generation rank's copies out of the training rank's memory may have begun).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_colocated import (SLICES, SMALL, gen_buffers, loop_batches,  # noqa: E402
                             train_buffers, wire)

CASES = {"kill_train": (0, signal.SIGKILL), "kill_gen": (1, signal.SIGKILL),
         "stop_train": (0, signal.SIGSTOP), "stop_gen": (1, signal.SIGSTOP)}
MARGIN_S = 5.0


def _bit_exact(transfers, c: dict, layers: int, device, dtype, added: int) -> bool:
    """Every destination equals the training values of this refit, regenerated here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ref = train_buffers(c, layers, device, dtype)
    for v in ref.values():
        for _ in range(added):  # the training side's steps, one rounding each
            v.add_(1)
    expect, _ = wire(c, layers, ref, None, dtype)
    want = {t.name: t.src for t in expect}
    for t in transfers:
        w = want[t.name]
        w = torch.stack(w) if isinstance(w, list) else w
        if not torch.equal(t.dst.reshape(w.shape), w):
            return False
    return True


def run(rank: int, args, case: str, port: int, results) -> None:
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.engine import Planner
    from megatron_reshard.engine.refit_transport import transport_of

    import faulthandler

    faulthandler.dump_traceback_later(args.timeout + 30, exit=True)  # a hang shows where
    victim, sig = CASES[case]
    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    dtype = torch.bfloat16
    control = torch.distributed.TCPStore("127.0.0.1", port + 1, None, False,
                                         timeout=timedelta(seconds=60))  # the parent's
    group = create_refit_group("127.0.0.1", port, rank, 2, "gloo", args.timeout,
                               transport="colocated", who=("train rank 0", "gen rank 0")[rank])
    c = (SMALL if args.small else SLICES)["qwen3_30b_a3b"]
    train = train_buffers(c, args.layers, device, dtype) if rank == 0 else None
    gen = gen_buffers(c, args.layers, device, dtype) if rank == 1 else None
    transfers, _ = wire(c, args.layers, train, gen, dtype)
    planner, exact, error, failed_at = Planner(), [], None, None
    transport, batches = transport_of(group), loop_batches(transfers, args.batch_mib)
    for step in range(args.refits):
        if rank == 0:  # new values each refit: an in-place "optimizer step"
            for v in train.values():
                v.add_(1)
        try:
            for b, batch in enumerate(batches):
                if step == args.at and rank == victim and b == min(1, len(batches) - 1):
                    control.set("fault_at", repr(time.time()))
                    os.kill(os.getpid(), sig)
                transport.move(batch, group, planner=planner, agree=step == 0, overlap=True)
            transport.flush()
        except Exception as exc:  # noqa: BLE001 - what the survivor says is the result
            error, failed_at = f"{type(exc).__name__}: {exc}", time.time()
            break
        if rank == 1:
            exact.append(_bit_exact(transfers, c, args.layers, device, dtype, step + 1))
    fault_at = float(control.get("fault_at")) if error is not None else None
    results.put({"case": case, "rank": rank, "error": error, "refits_bit_exact": exact,
                 "failed_after_s": None if fault_at is None else failed_at - fault_at})
    results.close()
    results.join_thread()  # the report is sent before the hard exit below
    os._exit(0)  # no teardown handshake with a dead or stopped peer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--refits", type=int, default=6)
    ap.add_argument("--at", type=int, default=3)
    ap.add_argument("--batch-mib", type=float, default=512)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--port", type=int, default=29651)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows, ok = [], True
    for k, case in enumerate(args.cases):
        results = ctx.Queue()
        port = args.port + 10 * k
        control = torch.distributed.TCPStore("127.0.0.1", port + 1, None, True,
                                             timeout=timedelta(seconds=60),
                                             wait_for_workers=False)  # outlives a victim
        procs = [ctx.Process(target=run, args=(r, args, case, port, results)) for r in (0, 1)]
        for p in procs:
            p.start()
        victim = CASES[case][0]
        got = results.get(timeout=args.timeout + 60)  # the survivor's report
        if CASES[case][1] == signal.SIGSTOP:
            procs[victim].kill()  # a stopped process is killed once its peer has reported
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        bound = args.timeout + MARGIN_S
        got["within_timeout_plus_5s"] = (got["failed_after_s"] is not None
                                         and got["failed_after_s"] < bound)
        ok = ok and got["error"] is not None and got["within_timeout_plus_5s"] and \
            all(got["refits_bit_exact"] or [True])
        rows.append(got)
        del control
        print(json.dumps(got), flush=True)
    env = {"torch": torch.__version__, "device": args.device, "timeout_s": args.timeout,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
