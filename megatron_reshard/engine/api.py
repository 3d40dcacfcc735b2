"""Public verbs and value types of the transfer engine (see docs/DESIGN.md, Engine API)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .execute import xfer_batch
from .plan import Planner


@dataclass
class DTensorRef:
    """A rank's local shard together with the global shape of the tensor it belongs to."""

    local: torch.Tensor
    global_shape: tuple

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)


@dataclass
class Transfer:
    """One parameter of a batch: global shape, dtype, both layouts, this rank's tensors.

    ``src``/``dst`` are this rank's local source shard / destination storage (any strides;
    ``dst`` is written in place), ``None`` on a rank outside that side.
    """

    name: str
    global_shape: tuple
    dtype: torch.dtype
    src_mesh: Any
    src_placements: list
    dst_mesh: Any
    dst_placements: list
    src: Optional[torch.Tensor] = None
    dst: Optional[torch.Tensor] = None


def xferdtensor(src: Optional[DTensorRef], src_mesh, src_placements: Sequence,
                dst: Optional[DTensorRef], dst_mesh, dst_placements: Sequence, group,
                stream=None, *, planner: Optional[Planner] = None,
                name: str = "<xferdtensor>") -> None:
    """Reshard one tensor: ``xfer_batch`` of a single ``Transfer``.

    ``src``/``dst`` are ``DTensorRef`` or ``None`` on a rank outside that side. A rank
    holding neither still calls (it takes part in the agreement step) but, not knowing
    the dtype, does not vote on the batch fingerprint.
    """
    refs = [r for r in (src, dst) if r is not None]
    if len(refs) == 2 and src.global_shape != dst.global_shape:
        raise ValueError(f"xferdtensor: param {name!r}: src and dst global shapes differ: "
                         f"{src.global_shape} vs {dst.global_shape}")
    if refs:
        shape, dtype, vote = refs[0].global_shape, refs[0].local.dtype, True
    else:
        # Outside both meshes: no bytes to move here; the shape only needs to be valid.
        shape, dtype, vote = _placeholder_shape(src_placements, dst_placements), torch.uint8, False
    t = Transfer(name, shape, dtype, src_mesh, list(src_placements), dst_mesh,
                 list(dst_placements), src.local if src is not None else None,
                 dst.local if dst is not None else None)
    xfer_batch([t], group, stream=stream, planner=planner, _vote=vote)


def _placeholder_shape(*placement_lists: Sequence) -> tuple:
    ndim = 1
    for pl in placement_lists:
        for p in pl:
            d = getattr(p, "dim", None) if not isinstance(p, dict) else p.get("dim")
            if d is not None and d >= 0:
                ndim = max(ndim, d + 1)
    return (0,) * ndim
