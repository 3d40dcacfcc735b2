"""Transfer benchmark launcher: engine vs raw P2P vs gather+broadcast, same run.

    torchrun --nproc-per-node 4 scripts/bench_transfer.py [--sizes 64M 1G] [--iters 10] \
        [--out bench_out/transfer] [--p2p-channels 32] [--cross-world]
    torchrun --nproc-per-node 4 scripts/bench_transfer.py --device cpu --small   # gloo smoke

Everything lives in megatron_reshard.tools.bench.transfer_main (``main(argv)``); ``--help``
lists the options, its docstring the layouts and columns.
"""

import sys

from megatron_reshard.tools.bench.transfer_main import main

if __name__ == "__main__":
    sys.exit(main())
