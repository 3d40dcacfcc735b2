"""``megatron-reshard soak``'s options (no torch here: the CLI's ``--help`` stays fast);
the soak itself is ``tools.soak``."""

from __future__ import annotations

import argparse

# the fault kinds, as tools.soak.FAULTS names them (listed here without importing torch)
FAULT_KINDS = ("kill_train", "stop_train", "kill_gen", "stop_gen", "kill_store_host",
               "stop_store_host", "tamper_gen", "restart_old_checkpoint", "truncated_payload",
               "foreign_payload", "gen_reload", "params_moved")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--refits", type=int, default=1000, help="refits to run (at least)")
    p.add_argument("--faults", type=int, default=100, help="faults to inject (at least)")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    p.add_argument("--gen", type=int, default=2, help="generation ranks (vLLM TP size)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: every rank on cuda:0, the colocated transport")
    p.add_argument("--timeout-s", type=float, default=5.0, help="the refit groups' timeout")
    p.add_argument("--models", default="dense,moe", help="model presets, switched in turn")
    p.add_argument("--switch-every", type=int, default=100, help="refits between model switches")
    p.add_argument("--sample-every", type=int, default=10,
                   help="refits between leak samples (RSS, fds, threads, children, GPU memory)")
    p.add_argument("--kinds", default="", help=f"comma-separated fault kinds (default: all): "
                                               f"{', '.join(FAULT_KINDS)}")
    p.add_argument("--transports", default="p2p,colocated",
                   help="on CPU, the transports a group build picks from (a GPU: colocated)")
    p.add_argument("--checksums", choices=("on", "off", "mixed"), default="mixed",
                   help="verify_checksums on both sides; mixed: seeded per group build")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this long, reporting what was reached")
    p.add_argument("--report", default=None, help="write the report as JSON here (kept "
                                                  "up to date while the soak runs)")
    p.add_argument("--trace-python-memory", action="store_true",
                   help="trace Python allocations in every rank (tracemalloc; slower) and "
                        "report the sites that grew most")
    p.add_argument("--rebuild-models", action="store_true",
                   help="build the model again at every switch, in the same process (the "
                        "soak's old way), to measure what that costs: the report's "
                        "growth_by_event per_switch")
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    return p


DESCRIPTION = ("Refit in a loop between a long-lived training world (real megatron-core, dense "
               "and MoE, Adam steps) and a generation world, full and delta refits, with faults "
               "from a seeded schedule at random points; every invariant checked after every "
               "refit and fault, leaks sampled; prints the counters, exit status 1 on any "
               "violation (issue 52).")


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="soak", description=DESCRIPTION))


__all__ = ["FAULT_KINDS", "add_arguments", "build_parser"]
