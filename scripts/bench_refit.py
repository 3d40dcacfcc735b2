"""Refit benchmark launcher: whole-model refit vs raw P2P vs gather+broadcast, same run.

    torchrun --nproc-per-node 4 scripts/bench_refit.py [--case moe|dense|all] [--layers 4] \
        [--iters 5] [--out bench_out/refit] [--p2p-channels N]
    torchrun --nproc-per-node 4 scripts/bench_refit.py --device cpu --backend gloo --small

Everything lives in megatron_reshard.tools.bench.refit_main (``main(argv)``); ``--help`` lists
the options, its docstring the cases and columns.
"""

import sys

from megatron_reshard.tools.bench.refit_main import main

if __name__ == "__main__":
    sys.exit(main())
