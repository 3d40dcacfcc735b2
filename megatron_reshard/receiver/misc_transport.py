"""The default transport of the params outside the bulk path (payload ``other_params``).

Torch + stdlib only. Per PP stage the stage's group rank 0 (its first train rank)
broadcasts one flat uint8 buffer of the stage's other params in payload order
(``megatron_reshard.refit.packed``); a caller may pass its own ``MiscReceiver`` instead.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from megatron_reshard.groups.collectives import control_device
from megatron_reshard.refit.packed import broadcast_packed, pack_entries
from megatron_reshard.refit.order import MiscItem

# receive_misc(stage, group, items) -> {hf_name: full tensor} for the stage's other params
MiscReceiver = Callable[[int, Optional[Any], list[MiscItem]], Mapping[str, torch.Tensor]]


def receive_misc_packed(stage: int, group: Optional[Any], items: list[MiscItem],
                        device: Optional[torch.device] = None) -> Mapping[str, torch.Tensor]:
    """Receive ``items`` of ``stage`` as one packed broadcast from the group's rank 0."""
    return broadcast_packed(pack_entries(items), group, 0, device or control_device(group))


__all__ = ["MiscReceiver", "receive_misc_packed"]
