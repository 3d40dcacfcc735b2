"""Run a real refit on this machine and check it bit for bit.

Starts a training world (a real megatron-core GPT model; by default MoE with GQA under
TP2×PP2×EP2 on 4 processes, the dense model under TP2×PP2) and a generation world (2
processes holding vLLM-layout parameters, gen TP2) as separate torch.distributed worlds,
joins them with one refit group per training PP stage, runs setup, then several refits
with the training weights changed between them, and verifies every generation parameter
against the reference (full HF tensors gathered on the training side, sliced by the vLLM
layout). Runs on CPU with gloo; for GPUs see scripts/refit_torchrun.py.

The layout is checked against the model before any process starts: a size the model
cannot be split by ends the demo at once with one line on stderr.

Exit status: 0 when every refit is bit-exact, 1 otherwise, 2 for invalid options.
"""

from __future__ import annotations

import argparse

from megatron_reshard.tools.run_config import add_run_arguments, config_from_args

# (This module is the demo's help text and options, apart from ``demo``, which runs it: the
# CLI builds its parser from them without importing torch, so ``--help`` is fast.)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser)
    parser.add_argument("--backend", choices=["gloo"], default="gloo",
                        help="process-group backend; the demo runs on CPU (on GPUs: "
                             "scripts/refit_torchrun.py)")
    parser.add_argument("--device", choices=["cpu"], default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true",
                        help="print the summary as one JSON object on stdout (progress is silent)")


def problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the demo's options, the layout against the model included; found
    before any process starts (ports are picked only once the options pass)."""
    return config_from_args(args, ports=(0,) * (1 + max(args.train_pp, 0))).problems()


__all__ = ["add_arguments", "problems"]
