"""Delta refits against full refits on CPU (gloo): bytes and time per refit, same run.

    python scripts/bench_delta.py                      # 0.1% .. 100% changed, ±1 ulp steps
    python scripts/bench_delta.py --change random --fractions 0.01,0.05 --json /tmp/d.json
    python scripts/bench_delta.py --small --iters 1    # smoke run

What it measures: ``megatron_reshard/tools/bench/delta_bench.py`` (module docstring).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_reshard.tools.bench.delta_bench import FRACTIONS, default_opts, run, table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--change", choices=["ulp", "random"], default="ulp")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--gen", type=int, default=2, help="generation ranks (gen TP)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--checksums", action="store_true", help="end-to-end checksums on")
    ap.add_argument("--small", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    opts = default_opts(gen=args.gen, layers=args.layers, hidden=args.hidden, ffn=args.ffn,
                        vocab=args.vocab, iters=args.iters, change=args.change,
                        checksums=args.checksums,
                        fractions=[float(f) for f in args.fractions.split(",")])
    if args.small:
        opts.update(layers=2, hidden=64, ffn=160, vocab=500)
    summary = run(opts)
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
