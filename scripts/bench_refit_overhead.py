"""The fixed cost of one refit, phase by phase, on the CPU (issue 51 item 4).

    python scripts/bench_refit_overhead.py [--preset moe] [--refits 60] [--warmup 5]

Everything lives in megatron_reshard.tools.bench.refit_overhead (its docstring says what is
measured and printed).
"""

import sys

from megatron_reshard.tools.bench.refit_overhead import main

if __name__ == "__main__":
    sys.exit(main())
