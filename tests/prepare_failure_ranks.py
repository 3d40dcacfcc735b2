"""One process of a refit launch in which one rank fails; run as a plain script (one per
rank), so that its exit status, including anything that happens at interpreter exit, is
the process's own.

    python tests/prepare_failure_ranks.py launch --fault float32 --transport p2p

``launch`` starts every rank as its own process (training TP2 on a real megatron-core dense
model, generation TP2 with vLLM-layout params), waits for all of them and prints, as JSON,
each process's exit status, stderr, stdout and end time, and when the fault happened.
``--fault float32|shape|rename``: generation rank 1 holds a model that cannot take the
refit and fails in ``prepare_refit``. ``--fault stop-train``: training rank 1 stops itself
(SIGSTOP) after the first refit; the launcher kills it once every other process has ended.
Every rank's own code lets the library's error propagate, uncaught, as a user's script
would, and prints ``RAISED_AT <time>`` to stdout when it does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

MODEL_FAULTS = ("float32", "shape", "rename")  # generation rank 1's model cannot take the refit
FAULTS = (*MODEL_FAULTS, "stop-train")        # training rank 1 stops (SIGSTOP) after refit 1
TRAIN, GEN = 2, 2


def _cfg(args):
    from megatron_reshard.tools.run_config import RefitRunConfig

    return RefitRunConfig(model="dense", train_world=TRAIN, train_tp=2, train_pp=1, train_ep=1,
                          gen_world=GEN, gen_tp=2, refits=3, verify=False,
                          ports=(args.port, args.port + 1), timeout_s=args.timeout_s,
                          quiet=True, transport=args.transport)


def _broken_model(model: torch.nn.Module, fault: str) -> torch.nn.Module:
    """The one generation rank's model, broken the way ``fault`` says."""
    if fault == "float32":
        return model.to(torch.float32)
    name, param = next((n, p) for n, p in model.named_parameters() if p.dim() == 2)
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    leaf = name.rsplit(".", 1)[-1]
    if fault == "shape":
        setattr(owner, leaf, torch.nn.Parameter(param.data[:-1].clone(), requires_grad=False))
    else:  # rename: the param is held under another name
        delattr(owner, leaf)
        owner.register_parameter(leaf + "_renamed",
                                 torch.nn.Parameter(param.data, requires_grad=False))
    return model


def rank_main(args) -> None:
    cfg = _cfg(args)
    control = dist.TCPStore(cfg.host, args.port, None, args.role == "train" and args.rank == 0,
                            timeout=timedelta(seconds=60), wait_for_workers=False)
    if args.role == "train":
        from megatron_reshard.tools.e2e import run_training_rank

        def stop_after_first(ctx):
            if args.fault == "stop-train" and args.rank == 1 and ctx["step"] == 0:
                print(f"FAULT_AT {time.time()!r}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)

        run_training_rank(args.rank, cfg, control, torch.device("cpu"),
                          after_each_refit=stop_after_first)
        return
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.tools.e2e import ModuleWorker
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.wire.records import RefitPayload

    dist.init_process_group("gloo", store=dist.PrefixStore("world/gen", control), rank=args.rank,
                            world_size=GEN, timeout=timedelta(seconds=60))
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(RefitPayload.of(payload).hf_config, args.rank, GEN, 1,
                                  torch.bfloat16)
    if args.rank == 1 and args.fault in MODEL_FAULTS:
        model = _broken_model(model, args.fault)
        print(f"FAULT_AT {time.time()!r}", flush=True)
    worker = ModuleWorker(model)
    worker.init_refit_groups(cfg.host, [args.port + 1], None, TRAIN + GEN, "gloo", cfg.timeout_s)
    worker.prepare_refit(payload)
    for _ in range(cfg.refits):
        worker.refit()
    worker.destroy_refit_groups(cfg.timeout_s)


def launch(args) -> dict:
    """Every rank as its own process; returns, per process ("train 0", ...), its exit status,
    its stderr and when it ended, and when the fault happened ("fault_at")."""
    from megatron_reshard.tools.worlds import free_ports

    port = free_ports(2)[0]
    common = ["--port", str(port), "--fault", args.fault, "--transport", args.transport,
              "--timeout-s", str(args.timeout_s)]
    procs = {f"{role} {r}": subprocess.Popen([sys.executable, __file__, role, "--rank", str(r),
                                              *common],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)
             for role, n in (("train", TRAIN), ("gen", GEN)) for r in range(n)}
    ended: dict = {}
    deadline = time.monotonic() + args.wait_s
    stopped = "train 1" if args.fault == "stop-train" else None
    while time.monotonic() < deadline and len(ended) < len(procs) - bool(stopped):
        for name, proc in procs.items():  # each end time on its own (the pipes are small)
            if name not in ended and name != stopped and proc.poll() is not None:
                ended[name] = time.time()
        time.sleep(0.05)
    out = {}
    for name, proc in procs.items():
        hung = proc.poll() is None  # the stopped process, or a hang: the caller sees None
        if hung:
            proc.kill()
        stdout, stderr = proc.communicate()
        out[name] = {"status": None if hung else proc.returncode, "stderr": stderr,
                     "ended": ended.get(name, time.time()), "stdout": stdout}
    marks = [ln for r in out.values() for ln in r["stdout"].splitlines() if ln.startswith("FAULT_AT ")]
    out["fault_at"] = float(marks[0].split()[1]) if marks else None
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["launch", "train", "gen"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fault", choices=FAULTS, default="float32")
    p.add_argument("--transport", choices=["p2p", "colocated"], default="p2p")
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--wait-s", type=float, default=240.0)
    args = p.parse_args()
    if args.role == "launch":
        print(json.dumps(launch(args), indent=1))
        return 0
    try:
        rank_main(args)
    except BaseException:
        print(f"RAISED_AT {time.time()!r}", flush=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
