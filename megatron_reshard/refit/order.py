"""The transfer order of a refit, derived from the payload alone (identical on every rank).

Torch + stdlib only (the receiver imports it). Which bulk params each PP stage moves and in
which order, where the batches are cut, which params travel outside the bulk path, and the
fingerprint ``RefitLoop.verify_plan`` compares over each refit group.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch

from megatron_reshard.layout.placements import placements_to_plain
from megatron_reshard.wire.metadata import dtype_from_str
from megatron_reshard.wire.records import ParamRecord, RefitPayload


class MiscItem(NamedTuple):
    """A param outside the bulk path (payload ``other_params``): moved by a packed broadcast."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class BulkTransfer(NamedTuple):
    """A bulk param as the engine's ``Transfer`` takes it, but the tensors."""

    name: str
    global_shape: tuple
    dtype: torch.dtype
    src_mesh: Any
    src_placements: tuple
    dst_mesh: Any
    dst_placements: tuple


def wire_dtype(value: Any) -> torch.dtype:
    """Torch dtype of a payload dtype string (``"torch.bfloat16"``); ValueError if unknown."""
    return dtype_from_str(value)


def stage_params(info: Any) -> dict[int, list[ParamRecord]]:
    """Bulk records of the payload grouped by PP stage, in payload order.

    Payload order is ``layer_names`` order, then each layer's ``per_layer_params`` order.
    A param without ``pp_stage`` belongs to stage 0. ``info``: a ``RefitPayload`` (or a
    refit info dict, parsed here).
    """
    return RefitPayload.of(info).stage_params()


def bulk_transfers(params: Sequence[ParamRecord]) -> list[BulkTransfer]:
    """One ``BulkTransfer`` per param. Built once per loop: the same objects on every call
    let the engine find its cached batch by identity."""
    return [BulkTransfer(p.name, p.global_shape, p.torch_dtype, p.src_mesh_info,
                         p.src_placements, p.dst_mesh_info, p.dst_placements) for p in params]


def misc_items_by_stage(info: Any) -> dict[int, list[MiscItem]]:
    """Params outside the bulk path (payload ``other_params``) per PP stage, in payload order
    (``wire.records.MiscRecord``; a dict ``info`` is parsed here, which refuses a missing or repeated
    name and, with ``pp_size`` above 1, a missing ``pp_stage``)."""
    out: dict[int, list[MiscItem]] = {}
    for m in RefitPayload.of(info).other_params or ():
        out.setdefault(m.pp_stage or 0, []).append(MiscItem(m.name, m.shape,
                                                            wire_dtype(m.dtype)))
    return out


def plan_fingerprint(params: Sequence[ParamRecord],
                     misc_items: Optional[Sequence[MiscItem]] = None,
                     options: Optional[Mapping[str, int]] = None) -> int:
    """63-bit fingerprint of an ordered transfer list (names, shapes, dtypes, meshes, placements),
    plus the misc items and the options that must match on every rank (batching, staging)."""
    h = hashlib.sha256()
    if options:
        h.update(repr(sorted(options.items())).encode())
    for p in params:
        row = (p.name, p.global_shape, str(p.torch_dtype),
               p.src_mesh_info.key(), tuple(map(_plain_key, placements_to_plain(p.src_placements))),
               p.dst_mesh_info.key(), tuple(map(_plain_key, placements_to_plain(p.dst_placements))))
        h.update(repr(row).encode())
    if misc_items is not None:
        h.update(b"|misc|")
        for name, shape, dtype in misc_items:
            h.update(repr((name, tuple(shape), str(dtype))).encode())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def plan_parts(params: Sequence[ParamRecord], misc_items: Optional[Sequence[MiscItem]],
               options: Mapping[str, int]) -> dict[str, int]:
    """The parts of ``plan_fingerprint`` one by one, so that a mismatch can name the part
    that differs: "transfers" (the ordered transfer list, as a 63-bit hash), "misc_items"
    (its hash; -1 when none were given) and each option's own value."""
    parts = {"transfers": plan_fingerprint(params),
             "misc_items": -1 if misc_items is None else plan_fingerprint([], misc_items)}
    parts.update((k, int(v)) for k, v in options.items())
    return parts


def _plain_key(p: dict) -> tuple:
    return tuple(sorted(p.items()))


def batch_bounds(params: Sequence[ParamRecord], batch_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges cutting ``params`` into batches of at most ``batch_bytes``
    global bytes (at least one param each). Depends on the payload only."""
    return byte_bounds([math.prod(p.global_shape) * p.torch_dtype.itemsize for p in params],
                       batch_bytes)


def byte_bounds(sizes: Sequence[int], batch_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges cutting items of ``sizes`` bytes, in order, into batches of
    at most ``batch_bytes`` (at least one item each): the refit loop's batch cut."""
    bounds, start, acc = [], 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and acc + nbytes > batch_bytes:
            bounds.append((start, i))
            start, acc = i, 0
        acc += nbytes
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds
