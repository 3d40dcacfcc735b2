"""Packed broadcast: many small full tensors as one flat byte buffer over a process group.

Torch + stdlib only. Parameters outside the exact bulk path (attention, embeddings, norms,
router) are small; the training side sends them whole, one buffer per PP stage, and each
generation rank slices what it needs. Both sides derive the buffer's entries (each
tensor's byte offset, ``pack_entries``) from the same ordered ``(name, shape, dtype)``
list, so no offsets travel with the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputError, MissingEntryError
from megatron_reshard.groups.faults import wait_collective


@dataclass(frozen=True)
class PackedEntry:
    """Where one tensor sits in a packed buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # byte offset in the flat buffer
    nbytes: int


def pack_entries(items: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> list[PackedEntry]:
    """The entries of ``items`` in one packed buffer, in order, each aligned to 16 bytes."""
    entries, offset = [], 0
    for name, shape, dtype in items:
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        entries.append(PackedEntry(name, tuple(int(s) for s in shape), dtype, offset, nbytes))
        offset += (nbytes + 15) // 16 * 16
    return entries


def chunk_items(items: Sequence[tuple[str, Sequence[int], torch.dtype]], budget: int
                ) -> list[list[tuple[str, Sequence[int], torch.dtype]]]:
    """Consecutive runs of ``items`` whose packed buffer fits ``budget`` bytes.

    Bounds the memory of the packed path: one buffer of at most ``budget`` bytes is alive at
    a time (an item larger than the budget travels alone). Depends on the items and the
    budget only, so both sides cut at the same places.
    """
    chunks: list[list] = []
    current: list = []
    for item in items:
        if current and buffer_bytes(pack_entries(current + [item])) > budget:
            chunks.append(current)
            current = []
        current.append(item)
    if current:
        chunks.append(current)
    return chunks


def buffer_bytes(entries: Sequence[PackedEntry]) -> int:
    return 0 if not entries else (entries[-1].offset + entries[-1].nbytes + 15) // 16 * 16


def pack(entries: Sequence[PackedEntry], tensors: dict[str, torch.Tensor],
         device: torch.device) -> torch.Tensor:
    """Copy ``tensors`` into one flat uint8 buffer, each at its entry."""
    flat = torch.zeros(buffer_bytes(entries), dtype=torch.uint8, device=device)
    for entry in entries:
        t = tensors.get(entry.name)
        if t is None:
            raise MissingEntryError(f"packed broadcast: no tensor for {entry.name!r}")
        if tuple(t.shape) != entry.shape or t.dtype != entry.dtype:
            raise BadInputError(f"packed broadcast: {entry.name!r} expected shape {list(entry.shape)} "
                             f"dtype {entry.dtype}, found shape {list(t.shape)} dtype {t.dtype}")
        # copy straight into the buffer: a strided view (a de-interleaved q/k/v) needs no
        # contiguous temporary
        flat[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape).copy_(
            t.detach())
    return flat


def unpack(entries: Sequence[PackedEntry], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of each entry inside ``flat`` (no copies)."""
    return {e.name: flat[e.offset:e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
            for e in entries}


def broadcast_packed(entries: Sequence[PackedEntry], group: Optional[dist.ProcessGroup],
                     root: int, device: torch.device,
                     tensors: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Broadcast the tensors of ``entries`` from group rank ``root``; return views on every rank.

    ``group`` may be a raw ProcessGroup that is not registered with c10d (a refit group
    across two worlds) or None for the default world. ``tensors`` is needed on ``root`` only.
    """
    if not entries:
        return {}
    rank = dist.get_rank() if group is None else group.rank()
    if rank == root:
        if tensors is None:
            raise BadInputError(f"packed broadcast: rank {rank} is the root but has no tensors")
        flat = pack(entries, tensors, device)
    else:
        flat = torch.empty(buffer_bytes(entries), dtype=torch.uint8, device=device)
    if group is None:
        dist.broadcast(flat, src=root)
    else:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        wait_collective(group.broadcast([flat], opts), group, "the packed broadcast", [root])
    return unpack(entries, flat)
