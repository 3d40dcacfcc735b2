"""Routed-expert tensors on the packed path (gpt-oss's experts): each EP rank holds only its
own, the packed broadcast leaves from the stage's first train rank, so the wanted ones are
first shared over the expert-parallel group.

Collective over this rank's EP group (every EP group of the stage does the same, with the
same names); nothing happens without EP. The owner of global expert ``e`` is EP rank
``e // experts_per_rank`` (Megatron's contiguous expert blocks).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputError

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def share_expert_tensors(out: dict[str, torch.Tensor], names: Iterable[str],
                         metadata: Mapping[str, dict], experts_per_rank: int,
                         device: torch.device) -> None:
    """Fill ``out`` with the full tensors of the per-expert ``names`` (in the order given,
    the same on every rank) by broadcasts from their owning EP rank."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1 or experts_per_rank < 1:
        return
    group = ps.get_expert_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    me = ps.get_expert_model_parallel_rank()
    for name in names:
        m = _EXPERT.search(name)
        if m is None:
            continue
        owner = int(m.group(1)) // experts_per_rank
        if owner == me:
            if name not in out:
                raise BadInputError(f"EP rank {me} should hold {name} (experts "
                                 f"{me * experts_per_rank}..{(me + 1) * experts_per_rank - 1}) "
                                 f"but its model has no such tensor")
            tensor = out[name].contiguous()
        else:
            meta = metadata[name]
            tensor = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"].removeprefix("torch.")),
                                 device=device)
        dist.broadcast(tensor, src=ranks[owner], group=group)
        out[name] = tensor
