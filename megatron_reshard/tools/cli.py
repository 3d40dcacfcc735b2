"""Command line: ``megatron-reshard demo | bench | plan | soak | clean-shm``.

Each command's module is imported only when it runs, so ``--help`` is fast and the
package root stays free of Megatron: the parser is built from modules that import no
torch (``demo_options``, ``plan_cli``'s options over ``presets``; the package root loads
its engine names lazily). Every command checks its options before it starts a
process: a wrong value ends the command at once with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from megatron_reshard import __version__

_BENCH_MODULES = {"refit": "megatron_reshard.tools.bench.refit_main",
                  "transfer": "megatron_reshard.tools.bench.transfer_main"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default, unless the help
    already states it or there is none to state (flags, options whose default is computed)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or "default:" in text or action.default is None
                or action.default is argparse.SUPPRESS or isinstance(action.default, bool)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


class CliParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message (see prog --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(command: str, problems: Sequence[str]) -> int:
    """Print what is wrong with a command's options on one line; returns exit status 2."""
    print(f"megatron-reshard {command}: error: " + "; ".join(problems), file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="megatron-reshard", formatter_class=HelpFormatter,
        description="Shard-to-shard weight refit from Megatron-Core training ranks into "
                    "vLLM-layout generation ranks.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,plan,soak,clean-shm}")

    from megatron_reshard.tools import demo_options

    demo_options.add_arguments(sub.add_parser(
        "demo", help="run a real refit between a Megatron training world and a generation "
                     "world on this machine, verify it bit for bit, print a summary",
        description=demo_options.__doc__, formatter_class=HelpFormatter))

    bench = sub.add_parser(
        "bench", help="GPU benchmarks under torchrun (refit or transfer), with the same-run "
                      "raw P2P and gather+broadcast figures",
        formatter_class=HelpFormatter,
        description="Launch a benchmark under torchrun on this machine's GPUs. Options after "
                    "the kind go to the benchmark (see `python -m "
                    "megatron_reshard.tools.bench.refit_main --help`, or transfer_main); they are "
                    "checked before torchrun starts.")
    bench.add_argument("kind", choices=sorted(_BENCH_MODULES),
                       help="refit: whole refits of model slices; transfer: raw layouts")
    bench.add_argument("--nproc", type=int, default=4,
                       help="processes (GPUs), half training and half generation ranks; "
                            "refit takes 2 or 4, transfer any even number")

    plan = sub.add_parser("plan", help="print the transfer plan of one layout (no communication)")
    from megatron_reshard.tools import plan_cli

    plan_cli.add_arguments(plan)
    plan.formatter_class = HelpFormatter  # after add_arguments, which sets its own
    from megatron_reshard.tools import soak_options

    soak_options.add_arguments(sub.add_parser("soak", help="refits in a loop with faults at "
                                              "random points, every invariant checked (issue 52)",
                                              description=soak_options.DESCRIPTION,
                                              formatter_class=HelpFormatter))
    from megatron_reshard.tools import clean_shm

    clean_shm.add_arguments(sub.add_parser("clean-shm", help="list (--yes: unlink) torch's "
                                           "/dev/shm files that killed processes left behind",
                                           description=clean_shm.DESCRIPTION,
                                           formatter_class=HelpFormatter))
    for command in (parser, *sub.choices.values()):
        _give_defaults_a_help_line(command)
    return parser


def _give_defaults_a_help_line(parser: argparse.ArgumentParser) -> None:
    """argparse prints no help line, so no default, for an option without help text."""
    for action in parser._actions:
        if (action.help is None and action.option_strings and action.default is not None
                and action.default is not argparse.SUPPRESS):
            action.help = "default: %(default)s"


def bench_problems(kind: str, nproc: int, rest: Sequence[str]) -> list[str]:
    """What is wrong with a benchmark launch, found before torchrun starts any process."""
    import importlib

    import torch

    problems = []
    if kind == "refit" and nproc not in (2, 4):
        problems.append(f"--nproc {nproc}: expected 2 or 4 for bench refit "
                        "(1 or 2 training ranks and as many generation ranks)")
    if kind == "transfer" and (nproc < 2 or nproc % 2):
        problems.append(f"--nproc {nproc}: expected an even number >= 2 for bench transfer "
                        "(half sources, half destinations)")
    parser = importlib.import_module(_BENCH_MODULES[kind]).build_parser()
    parser.prog = f"megatron-reshard bench {kind}"

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # the benchmark's own parser, made to report here instead of exiting
    try:
        args = parser.parse_args(list(rest))
    except ValueError as err:
        return problems + [str(err)]
    checks = {"--iters": (getattr(args, "iters", None), 1),
              "--warmup": (getattr(args, "warmup", None), 0),
              "--layers": (getattr(args, "layers", None), 1),
              "--staging-mib": (getattr(args, "staging_mib", None), 1),
              "--streams": (getattr(args, "streams", None), 1)}
    for option, (value, low) in checks.items():
        if value is not None and value < low:
            problems.append(f"{option} {value}: expected an integer >= {low}")
    if getattr(args, "timeout_s", None) is not None and not args.timeout_s > 0:
        problems.append(f"--timeout-s {args.timeout_s}: expected a number > 0")
    want_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    if getattr(args, "backend", None) == "nccl" and not want_cuda:
        problems.append("--backend nccl: expected --device cuda (nccl runs on GPUs)")
    gpus = torch.cuda.device_count()
    if want_cuda and not gpus:
        problems.append("--device cuda: expected a CUDA GPU, found none (use --device cpu)")
    elif want_cuda and gpus < nproc:
        problems.append(f"--nproc {nproc}: expected at most the {gpus} CUDA GPUs here")
    if args.device is None and not want_cuda:
        smoke = "--device cpu --backend gloo --small" if kind == "refit" else "--device cpu --small"
        problems.append(f"no CUDA GPU here; the benchmarks run on GPUs (add '{smoke}' for a CPU "
                        "smoke run)")
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":  # only the benchmarks take pass-through options
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("demo", "bench"):  # quieter logs in the processes these start
        from megatron_reshard.tools.launch_env import apply_launch_defaults

        apply_launch_defaults()
    if args.command == "demo":
        from megatron_reshard.tools import demo_options

        problems = demo_options.problems(args)  # before the demo and its worker pool load
        if problems:
            return fail("demo", problems)
        from megatron_reshard.tools import demo

        return demo.run(args)
    if args.command == "bench":
        import subprocess

        if "--" in rest:  # `bench refit --nproc 2 -- --small`: the separator is not an option
            rest.remove("--")
        problems = bench_problems(args.kind, args.nproc, rest)
        if problems:
            return fail(f"bench {args.kind}", problems)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "-m", _BENCH_MODULES[args.kind], *rest]
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    if args.command == "plan":
        from megatron_reshard.tools import plan_cli

        return plan_cli.run(args)
    if args.command == "soak":
        from megatron_reshard.tools import soak

        return soak.run(args)
    if args.command == "clean-shm":
        from megatron_reshard.tools import clean_shm

        return clean_shm.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
