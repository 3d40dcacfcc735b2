"""A payload entering a generation rank: checked and parsed once, and what it says of the
generation layout beyond its records.

Torch + stdlib only. ``restore_payload`` is the receiver's boundary: the plain payload
(decoded msgpack or the training side's dict) becomes a frozen ``wire.RefitPayload``
(whole-payload validation and the schema version included); nothing after it reads the
payload as a dict.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Shard

from megatron_reshard.placements import BlockShard
from megatron_reshard.wire.placement_rules import is_expert_param
from megatron_reshard.wire.records import RefitPayload


def restore_payload(payload: Any, where: str = "this rank") -> RefitPayload:
    """The payload as records: validated (``RefitPayloadError``), its schema version checked
    (``ValueError``), meshes and placements restored. The input is not changed; records
    pass through as they are."""
    if isinstance(payload, RefitPayload):
        return payload
    return RefitPayload.from_plain(payload, where)


def gen_ep_size(payload: RefitPayload) -> int:
    """Generation EP size: ``gen_layout["ep"]`` (or ``"ep_size"``) if given, else read off the
    expert placements (the mesh axis that splits the experts' dim 0)."""
    layout = payload.gen_layout or {}
    for key in ("ep", "ep_size"):
        if layout.get(key):
            return int(layout[key])
    for p in payload.params():
        if is_expert_param(p.name):
            for axis, pl in enumerate(p.dst_placements):
                if isinstance(pl, (Shard, BlockShard)) and pl.dim == 0:
                    return int(p.dst_mesh_info.shape[axis])
            return 1
    return 1


__all__ = ["gen_ep_size", "restore_payload"]
