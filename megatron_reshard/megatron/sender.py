"""Train-side refit session: the sending half of one refit, every step.

``RefitSender`` wraps a ``MegatronRefitSource`` and the rank's refit group (one group per
training PP stage; a train rank belongs to its own stage's group). Per refit it runs the
shared ``RefitLoop`` (side ``"src"``: bulk FFN params straight from the live shards), then
the stage's other params as one packed broadcast from the stage's first train rank.
Options that enter the plan fingerprint (batch and staging bytes, misc items) must match
the receiver's; a mismatch is reported at the first refit on every rank of the group.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from megatron_reshard.metadata import restore_refit_info_placements
from megatron_reshard.packed import broadcast_packed, packed_layout
from megatron_reshard.refit_loop import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_STAGING_BYTES,
    RefitLoop,
    misc_items_by_stage,
)


class RefitSender:
    """Sends this train rank's shards to the generation ranks of its stage's refit group."""

    def __init__(self, source: Any, group: Any, *, device: Optional[torch.device] = None,
                 num_streams: int = 2, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        self.source = source
        self.group = group
        self.stage = source.stage
        self.device = device or torch.device("cpu")
        # The payload dict is restored in place; keep our own copy of the plain form.
        info = restore_refit_info_placements(dict(source.payload))
        self.misc_items = misc_items_by_stage(info).get(self.stage, [])
        self.misc_layout = packed_layout(self.misc_items)
        self.loop = RefitLoop(info, source.build_hf_to_local_param_map(), "src",
                              {self.stage: group}, num_streams=num_streams,
                              batch_bytes=batch_bytes, staging_bytes=staging_bytes,
                              misc_items=misc_items_by_stage(info))
        self.is_misc_root = source.stage_local_rank == 0

    def refit(self) -> dict:
        """Send every param once. Collective over the train world (TP gather of the other
        params) and over the refit group; every train rank calls it."""
        t0 = time.perf_counter()
        others = self.source.gather_other_params()
        t1 = time.perf_counter()
        bulk = self.loop.run()
        t2 = time.perf_counter()
        if self.misc_layout:
            tensors = None
            if self.is_misc_root:
                tensors = {name: others[name].to(self.device) for name, _, _ in self.misc_items}
            broadcast_packed(self.misc_layout, self.group, 0, self.device, tensors)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t3 = time.perf_counter()
        return {"bulk_params": bulk.params, "bulk_bytes": bulk.local_bytes,
                "gather_other_s": t1 - t0, "bulk_s": t2 - t1, "misc_s": t3 - t2,
                "refit_s": t3 - t0}
