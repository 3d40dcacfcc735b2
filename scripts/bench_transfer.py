"""Transfer benchmark launcher: engine vs raw P2P vs gather+broadcast, same run.

    torchrun --nproc-per-node 4 scripts/bench_transfer.py [--sizes 64M 1G] [--iters 10] \
        [--out bench_out/transfer] [--p2p-channels 32] [--cross-world]
    torchrun --nproc-per-node 4 scripts/bench_transfer.py --device cpu --small   # gloo smoke

Everything lives in megatron_reshard.bench.transfer_main (``main(argv)``); ``--help``
lists the options, its docstring the layouts and columns.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_reshard.bench.transfer_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
