"""One process of a refit launch whose generation side fails in ``prepare_refit``; run as a
plain script (one per rank), so that its exit status, including anything that happens at
interpreter exit, is the process's own.

    python tests/prepare_failure_ranks.py launch --fault float32 --transport p2p

``launch`` starts every rank as its own process (training TP2 on a real megatron-core dense
model, generation TP2 with vLLM-layout params), waits for all of them and prints, as JSON,
each process's exit status, stderr and end time, and when the fault was armed. Generation rank 1 holds a model that cannot take the refit (``--fault``); every
rank's own code lets the library's error propagate, uncaught, as a user's script would.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FAULTS = ("float32", "shape", "rename")
TRAIN, GEN = 2, 2


def _cfg(args):
    from megatron_reshard.tools.run_config import RefitRunConfig

    return RefitRunConfig(model="dense", train_world=TRAIN, train_tp=2, train_pp=1, train_ep=1,
                          gen_world=GEN, gen_tp=2, refits=2, verify=False,
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

        run_training_rank(args.rank, cfg, control, torch.device("cpu"))
        return
    from megatron_reshard.megatron.payload import decode_payload
    from megatron_reshard.tools.e2e import ModuleWorker
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.wire.records import RefitPayload

    dist.init_process_group("gloo", store=dist.PrefixStore("world/gen", control), rank=args.rank,
                            world_size=GEN, timeout=timedelta(seconds=60))
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(RefitPayload.of(payload).hf_config, args.rank, GEN, 1,
                                  torch.bfloat16)
    if args.rank == 1:
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
    its stderr and when it ended, and when generation rank 1 found its model broken."""
    from megatron_reshard.tools.worlds import free_ports

    port = free_ports(2)[0]
    common = ["--port", str(port), "--fault", args.fault, "--transport", args.transport,
              "--timeout-s", str(args.timeout_s)]
    procs = {f"{role} {r}": subprocess.Popen([sys.executable, __file__, role, "--rank", str(r),
                                              *common],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)
             for role, n in (("train", TRAIN), ("gen", GEN)) for r in range(n)}
    out = {}
    deadline = time.monotonic() + args.wait_s
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a hang: the caller sees status None
            proc.kill()
            stdout, stderr = proc.communicate()
            proc.returncode = None
        out[name] = {"status": proc.returncode, "stderr": stderr, "ended": time.time(),
                     "stdout": stdout}
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
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
