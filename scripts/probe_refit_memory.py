"""Does a long-lived refit process keep memory per refit? tracemalloc and live-object
counts on the training and the generation rank (``tools.refit_memory``; CPU, gloo).

    PYTHONPATH=. python scripts/probe_refit_memory.py --warmup 30 --refits 1000 --windows 5
    PYTHONPATH=. python scripts/probe_refit_memory.py --refits 500 --windows 6 --measure native

Prints, per side and per window of ``--refits`` refits after the warm-up, the Python bytes
(tracemalloc) and the native figures (glibc's bytes in use, RSS, CPU tensors) per refit,
then the top growing sites of the last window (ours first, by traceback) and the types
whose live-object count grew. ``--delta``: delta refits; ``--adam``: an Adam step before
each refit. ``--measure native``: the native figures alone, per window (tracemalloc's own
tables, held by the C allocator, grow with what it traces). ``--json PATH`` also writes
the raw figures.
"""

import argparse
import json

from megatron_reshard.tools.refit_memory import probe_job, report_lines
from megatron_reshard.tools.worlds import WorkerPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--refits", type=int, default=500, help="refits per window")
    ap.add_argument("--windows", type=int, default=2, help="windows of --refits refits")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--delta", action="store_true", help="delta refits (RefitSender(delta=True))")
    ap.add_argument("--adam", action="store_true", help="an Adam step before each refit")
    ap.add_argument("--measure", choices=("traced", "native"), default="traced",
                    help="native: the native figures alone (no tracemalloc, whose own tables "
                         "the C allocator holds, no type counts kept)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pool = WorkerPool(2)
    try:
        train, gen = pool.run(probe_job, 2, args.warmup, args.refits, args.windows, args.top,
                              args.delta, args.adam, measure=args.measure, num_ports=2,
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
