"""Refit benchmark launcher: whole-model refit vs raw P2P vs gather+broadcast, same run.

    torchrun --nproc-per-node 4 scripts/bench_refit.py [--case moe|dense|all] [--layers 4] \
        [--iters 5] [--out bench_out/refit] [--p2p-channels N]
    torchrun --nproc-per-node 4 scripts/bench_refit.py --device cpu --backend gloo --small

Everything lives in megatron_reshard.bench.refit_main (``main(argv)``); ``--help`` lists
the options, its docstring the cases and columns.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_reshard.bench.refit_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
