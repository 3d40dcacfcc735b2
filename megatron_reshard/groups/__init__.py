"""Process groups and faults: the cross-world refit group and how failures cross it.

Torch + stdlib only. ``comm`` builds the refit group over training + generation ranks from
an explicit TCPStore and tears it down; ``faults`` gives every group a fault board, so a
rank that fails tells every peer, and every wait on a group polls that board instead of
hanging. A group carries the name of the transport its ranks agreed on at join
(``comm.TRANSPORT_NAMES``); the engine builds the transport itself (``engine.refit_transport``).
This package imports nothing of the engine: the engine sits above it.
"""

from megatron_reshard.groups.faults import PeerFailure, RefitError, RefitTimeout
from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group

__all__ = ["PeerFailure", "RefitError", "RefitTimeout", "create_refit_group",
           "destroy_refit_group"]
