"""Does a long-lived refit process keep memory per refit? tracemalloc and live-object
counts on the training and the generation rank (``tools.refit_memory``; CPU, gloo).

    PYTHONPATH=. python scripts/probe_refit_memory.py --warmup 30 --refits 500

Prints, per side, the traced bytes per refit in two windows of ``--refits`` refits after
the warm-up, the top growing sites of the second window (ours first, by traceback) and the
types whose live-object count grew. ``--json PATH`` also writes the raw figures.
"""

import argparse
import json

from megatron_reshard.tools.refit_memory import probe_job, report_lines
from megatron_reshard.tools.worlds import WorkerPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--refits", type=int, default=500, help="refits per window (two windows)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pool = WorkerPool(2)
    try:
        train, gen = pool.run(probe_job, 2, args.warmup, args.refits, args.top, num_ports=2,
                              timeout_s=args.timeout_s)
    finally:
        pool.close()
    for side, out in (("training rank", train), ("generation rank", gen)):
        print("\n".join(report_lines(side, out)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "train": train, "gen": gen}, f, indent=1)


if __name__ == "__main__":
    main()
