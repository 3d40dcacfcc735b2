"""Refit on GPUs under torchrun: one launch covers both worlds.

    torchrun --nproc-per-node 4 scripts/refit_torchrun.py --train-world 2 --train-tp 2 \
        --train-pp 1 --train-ep 1 --gen-world 2 --gen-tp 2

Processes ``0 .. train_world-1`` are the training world (megatron-core, NCCL), the rest
the generation world (vLLM-layout parameters); they do not use torchrun's rendezvous for
their worlds but explicit stores (as two separate launchers would), and one NCCL refit
group per training PP stage. Every refit is verified bit for bit against the reference.
Prints one JSON summary line (``REFIT_SUMMARY {...}``) from rank 0; exit status 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    from megatron_reshard.tools.launch_env import apply_nccl_defaults

    apply_nccl_defaults()  # before torch.distributed can initialise NCCL
    import torch
    import torch.distributed as dist

    from megatron_reshard.tools.e2e import run_rank, share_verdict, summarize
    from megatron_reshard.tools.run_config import add_run_arguments, config_from_args

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--port-base", type=int, default=None,
                        help="first of 1 + train-pp TCP ports (default MASTER_PORT + 100)")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.train_world + args.gen_world:
        print(f"torchrun world {world} != train world {args.train_world} + gen world "
              f"{args.gen_world}", file=sys.stderr)
        return 2
    base = args.port_base or int(os.environ.get("MASTER_PORT", "29500")) + 100
    cfg = config_from_args(args, ports=tuple(base + i for i in range(1 + args.train_pp)))
    cfg = type(cfg)(**{**cfg.__dict__, "host": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       "quiet": rank not in (0, args.train_world)})
    result = run_rank(rank, cfg)
    # Gather every rank's summary through the control store (the worlds are separate).
    store = dist.TCPStore(cfg.host, cfg.ports[0], world, False)
    store.set(f"result/{rank}", json.dumps(result))
    verdict = None
    if rank == 0:
        results = [json.loads(store.get(f"result/{r}")) for r in range(world)]
        summary = summarize(cfg, results)
        print("REFIT_SUMMARY " + json.dumps(summary), flush=True)
        verdict = "ok" if summary["verified"] or not cfg.verify else "fail"
    verdict = share_verdict(store, rank, world, verdict)
    if dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
