"""Kill or stop one side of a refit loop run by two independent launchers; time the survivor.

    python scripts/fault_check.py --backend nccl --fault kill --victim train   # 2 GPUs
    python scripts/fault_check.py --backend gloo --fault stop --victim gen     # CPU

Two separate processes (no torchrun, no shared supervisor) join one refit group: a training
side holding full tensors of a small Qwen3-shaped model (training world 1) and a generation
side holding them in vLLM layout (the worker extension, gen world 1). They refit in a loop;
in refit 3 the victim kills (SIGKILL) or stops (SIGSTOP) itself inside a pre hook. The
survivor must raise within the group's timeout + 5 s; the script prints how long it took
and what it said, and the generation side's weight state when it survived. Exit status 0
when the survivor failed in time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

CFG = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
           intermediate_size=1024, num_hidden_layers=4, vocab_size=1000,
           tie_word_embeddings=False, gated=True, qk_norm=True, family="qwen3")
MARGIN_S = 5.0


def _side(args) -> None:
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.refit.commit import commit_refit
    from megatron_reshard.refit.version import agree_version
    from megatron_reshard.wire.metadata import restore_refit_info_placements
    from megatron_reshard.refit.packed import broadcast_packed, pack_entries
    from megatron_reshard.receiver import MegatronReshardWorkerExtension
    from megatron_reshard.refit.loop import RefitLoop
    from megatron_reshard.refit.order import misc_items_by_stage, stage_params
    from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx
    from megatron_reshard.testing.vllm_like import (build_plain_payload, build_vllm_like_model,
                                                    grouped_hf_tensors, random_hf_state_dict)

    cuda = args.backend == "nccl"
    device = torch.device("cuda", 0 if args.role == "train" else 1) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    full = random_hf_state_dict(CFG, seed=0)
    payload = build_plain_payload(CFG, full, {"tp_size": 1}, {"tp_size": 1}, 1, 1)
    rank = 0 if args.role == "train" else 1
    victim = args.victim == args.role
    state = {"refit": 0}

    def fault(spec: LocalParamSpec) -> None:  # arm one pre hook to kill or stop this process
        inner = spec.pre

        def pre(base):
            if victim and state["refit"] == 3:
                with open(args.fault_file, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
            return inner(base) if inner is not None else RefitCtx(buf=base)

        spec.pre = pre

    out = {"role": args.role, "refits": 0, "error": None, "failed_at": None}
    try:
        if args.role == "train":
            group = create_refit_group("127.0.0.1", args.port, 0, 2, args.backend, args.timeout_s,
                                       device=device if cuda else None, who="train process")
            restore_refit_info_placements(payload)
            grouped = grouped_hf_tensors(full)
            specs = HFToLocalParamMap({p.name: LocalParamSpec(base=grouped[p.name].to(device))
                                       for p in stage_params(payload)[0]})
            fault(specs.specs[sorted(specs.specs)[len(specs.specs) // 2]])
            misc = misc_items_by_stage(payload)
            loop = RefitLoop(payload, specs, "src", {0: group}, misc_items=misc)
            for k in range(1, args.refits + 1):
                state["refit"] = k
                agree_version({0: group}, side="src", version=k)  # the protocol's first step
                loop.run()
                items = misc.get(0, [])
                if items:
                    broadcast_packed(pack_entries(items), group, 0, device,
                                     {n: full[n].to(device) for n, _, _ in items})
                outcome = commit_refit({0: group}, side="src", version=k, checksum_failed=False,
                                       pp_size=1)
                out["refits"] = k if outcome.ok else out["refits"]
        else:
            class Worker(MegatronReshardWorkerExtension):
                def get_refit_model(self):
                    return model

            model = build_vllm_like_model(CFG, 0, 1, 1, torch.bfloat16, device=device)
            worker = Worker()
            worker.init_refit_groups("127.0.0.1", [args.port], rank, 2, args.backend,
                                     args.timeout_s)
            worker.prepare_refit(payload)
            session = worker.refit_worker_state.require_session()
            fault(session.local_map.specs[sorted(session.local_map.specs)[0]])
            try:
                for k in range(1, args.refits + 1):
                    state["refit"] = k
                    worker.refit()
                    out["refits"] = k
            finally:
                out["weights"] = worker.refit_weights_state()
    except Exception as exc:  # noqa: BLE001 - the survivor's error is the measurement
        out.update(error=f"{type(exc).__name__}: {exc}", failed_at=time.time())
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # do not wait for communicators of a broken group at interpreter exit


def _launch(args) -> int:
    from megatron_reshard.tools.worlds import free_ports

    fault_file = tempfile.mktemp(prefix="refit_fault_")
    port = free_ports(1)[0]
    procs = {}
    for role in ("train", "gen"):
        cmd = [sys.executable, __file__, "--role", role, "--port", str(port), "--backend",
               args.backend, "--fault", args.fault, "--victim", args.victim, "--timeout-s",
               str(args.timeout_s), "--refits", str(args.refits), "--fault-file", fault_file]
        procs[role] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True)
    survivor = "gen" if args.victim == "train" else "train"
    try:
        text, _ = procs[survivor].communicate(timeout=args.timeout_s + 120)
    except subprocess.TimeoutExpired:
        text = ""
    for proc in procs.values():  # the victim: dead, or stopped (kill it now)
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else {"error": None, "failed_at": None}
    fault_at = float(open(fault_file).read()) if os.path.exists(fault_file) else None
    took = (res["failed_at"] - fault_at) if res.get("failed_at") and fault_at else None
    ok = took is not None and took < args.timeout_s + MARGIN_S
    print(f"{args.backend}: {args.fault} the {args.victim} process in refit 3 -> the {survivor} "
          f"survivor failed {'after %.2f s' % took if took is not None else 'NOT AT ALL'} "
          f"(timeout {args.timeout_s:g} s): {str(res.get('error'))[:300]}")
    if "weights" in res:
        w = res["weights"]
        print(f"  weights: {w['state']}, version {w['version']}, started_from {w['started_from']}, "
              f"{len(w['overwritten'])} params overwritten")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="nccl")
    p.add_argument("--fault", choices=["kill", "stop"], default="kill")
    p.add_argument("--victim", choices=["train", "gen"], default="train")
    p.add_argument("--timeout-s", type=float, default=20.0, help="the refit group's timeout")
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--role", choices=["train", "gen"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fault-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        _side(args)
        return 0
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
