"""A thousand refits with faults at random points (issue 52): ``megatron-reshard soak``.

    python scripts/soak.py --refits 1000 --faults 100 --seed 0 --report soak.json
    python scripts/soak.py --device cuda --refits 1000 --faults 20    # one GPU, colocated

See ``megatron_reshard/tools/soak.py`` for what runs and what is checked.
"""

import sys

from megatron_reshard.tools.soak import run
from megatron_reshard.tools.soak_options import build_parser

if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
