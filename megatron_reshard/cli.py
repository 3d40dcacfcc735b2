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
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")

    plan = sub.add_parser("plan", help="print the transfer plan of one layout (no communication)")
    from megatron_reshard import plan_cli

    plan_cli.add_arguments(plan)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from megatron_reshard import demo

        return demo.run(args)
    if args.command == "bench":
        import subprocess

        module = {"refit": "megatron_reshard.bench.refit_main",
                  "transfer": "megatron_reshard.bench.transfer_main"}[args.kind]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "-m", module, *args.rest]
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    if args.command == "plan":
        from megatron_reshard import plan_cli

        return plan_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
