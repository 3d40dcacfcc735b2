"""Golden reference transport: whole tensors, then slice. Slow, simple, obviously right.

For every transfer, every destination rank receives the complete local shard of one holder
of each distinct source region (plain blocking send/recv in one global order that every
rank follows, so nothing can deadlock), assembles the full tensor, and copies its own
region out of it. It shares only the geometry (who owns which box) with the engine: no
planner, no schedule, no staging, no transport abstraction. Tests compare the engine
against it bit for bit.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_reshard.layout.geometry import shard_ownerships
from .plan import layout_key
from megatron_reshard.groups.collectives import resolve_group


def xfer_batch_reference(transfers: Sequence, group=None, *, stream=None, staging_bytes=None,
                         planner=None, agree: bool = True) -> None:
    """Same signature and effect as ``xfer_batch``; the options are accepted and ignored
    (no streams, no staging, no plan cache: whole tensors move and get sliced)."""
    group = resolve_group(group)
    me = group.rank()
    for t in transfers:
        key = layout_key(t.global_shape, t.src_mesh, t.src_placements, t.dst_mesh,
                         t.dst_placements, f"reference: param {t.name!r} on rank {me}")
        shape, s_shape, s_ranks, s_dims, d_shape, d_ranks, d_dims = key
        src = shard_ownerships(shape, s_shape, s_ranks, s_dims)
        dst = shard_ownerships(shape, d_shape, d_ranks, d_dims)
        device = (t.src if t.src is not None else t.dst).device if (
            t.src is not None or t.dst is not None) else torch.device("cpu")
        # One holder (the first in mesh order) per distinct source region.
        providers, seen = [], set()
        for r in s_ranks:
            boxes = src[r].boxes
            if boxes and boxes not in seen:
                seen.add(boxes)
                providers.append(r)
        full = torch.empty(shape, dtype=t.dtype, device=device) if me in dst else None
        for p in providers:
            for d in d_ranks:
                if d == p:
                    if me == d:
                        _place(full, src[p], t.src)
                    continue
                if me == p:
                    whole = torch.empty(t.src.shape, dtype=t.dtype, device=device)
                    payload = whole.copy_(t.src).reshape(-1).view(torch.uint8)
                    group.send([payload], d, 0).wait()
                elif me == d:
                    got = torch.empty(src[p].local_shape, dtype=t.dtype, device=device)
                    group.recv([got.reshape(-1).view(torch.uint8)], p, 0).wait()
                    _place(full, src[p], got)
        if full is not None:
            for piece in dst[me].pieces:
                t.dst[piece.index(piece.box)] = full[_slices(piece.box)]


def _slices(box) -> tuple:
    return tuple(slice(s, e) for s, e in box)


def _place(full: torch.Tensor, own, local: torch.Tensor) -> None:
    for piece in own.pieces:
        full[_slices(piece.box)] = local[piece.index(piece.box)]

