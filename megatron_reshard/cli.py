"""Command line: ``megatron-reshard demo | bench | plan``.

Each command's module is imported only when it runs, so ``--help`` is fast and the
package root stays free of Megatron.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-reshard",
        description="Shard-to-shard weight refit from Megatron-Core training ranks into "
                    "vLLM-layout generation ranks.")
    sub = parser.add_subparsers(dest="command", required=True)

    from megatron_reshard import demo

    demo.add_arguments(sub.add_parser(
        "demo", help="run a real refit between a Megatron training world and a generation "
                     "world on this machine, verify it bit for bit, print a summary",
        description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))

    bench = sub.add_parser(
        "bench", help="GPU benchmarks under torchrun (refit or transfer), with the same-run "
                      "raw P2P and gather+broadcast figures",
        description="Launch a benchmark under torchrun on this machine's GPUs. Extra "
                    "arguments after the kind go to the benchmark script (see its --help).")
    bench.add_argument("kind", choices=["refit", "transfer"])
    bench.add_argument("--nproc", type=int, default=4, help="GPUs to use (default 4)")

    plan = sub.add_parser("plan", help="print the transfer plan of one layout (no communication)")
    from megatron_reshard import plan_cli

    plan_cli.add_arguments(plan)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":  # only the benchmarks take pass-through options
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from megatron_reshard import demo

        return demo.run(args)
    if args.command == "bench":
        import subprocess

        module = {"refit": "megatron_reshard.bench.refit_main",
                  "transfer": "megatron_reshard.bench.transfer_main"}[args.kind]
        import torch

        if not torch.cuda.is_available() and "--device" not in rest:
            print("megatron-reshard bench: no CUDA GPU here; the benchmarks run on GPUs "
                  "(add '--device cpu --backend gloo --small' for a CPU smoke run)",
                  file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "-m", module, *rest]
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    if args.command == "plan":
        from megatron_reshard import plan_cli

        return plan_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
