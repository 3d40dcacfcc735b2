"""The transfer order of a refit, derived from the payload alone (identical on every rank).

Torch + stdlib only (the receiver imports it). Which bulk params each PP stage moves and in
which order, where the batches are cut, which params travel outside the bulk path, and the
fingerprint ``RefitLoop.verify_plan`` compares over each refit group.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch

from megatron_reshard.layout import placements_to_plain
from megatron_reshard.metadata import dtype_from_str


class MiscItem(NamedTuple):
    """A param outside the bulk path (payload ``other_params``): moved by a packed broadcast."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class TransferLayout(NamedTuple):
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


def stage_params(info: Mapping[str, Any]) -> dict[int, list[dict]]:
    """Bulk params of the payload grouped by PP stage, in payload order.

    Payload order is ``layer_names`` order, then each layer's ``per_layer_params`` order.
    A param without ``pp_stage`` belongs to stage 0.
    """
    per_layer = info.get("per_layer_params", {})
    out: dict[int, list[dict]] = {}
    for layer in info.get("layer_names", []):
        for param in per_layer.get(layer, []):
            out.setdefault(int(param.get("pp_stage", 0)), []).append(param)
    listed = set(info.get("layer_names", []))
    unlisted = [layer for layer, params in per_layer.items() if params and layer not in listed]
    if unlisted:
        raise ValueError(f"refit payload: per_layer_params has layers missing from layer_names: "
                         f"{unlisted}")
    return out


def transfer_layouts(params: Sequence[Mapping[str, Any]]) -> list[TransferLayout]:
    """One ``TransferLayout`` per param. Built once per loop: the same objects on every call
    let the engine find its cached batch by identity."""
    return [TransferLayout(p["name"], tuple(p["global_shape"]), wire_dtype(p["dtype"]),
                           p["src_mesh_info"], tuple(p["src_placements"]),
                           p["dst_mesh_info"], tuple(p["dst_placements"])) for p in params]


def misc_items_by_stage(info: Mapping[str, Any]) -> dict[int, list[MiscItem]]:
    """Params outside the bulk path (payload ``other_params``) per PP stage, in payload order.

    ``other_params`` is a list of ``{"name", "shape", "dtype", "pp_stage"}`` (the train
    side's form) or a dict ``{name: {"shape", "dtype", "pp_stage"}}``. ``pp_stage`` is
    required when the payload's ``pp_size`` is above 1 (no stage is guessed for a param).
    """
    pp_size = int(info.get("pp_size", 1))
    other = info.get("other_params") or []
    entries = ([(name, entry) for name, entry in other.items()] if isinstance(other, Mapping)
               else [(entry.get("name"), entry) for entry in other])
    out: dict[int, list[MiscItem]] = {}
    seen: set = set()
    for name, entry in entries:
        if not isinstance(name, str) or name in seen:
            raise ValueError(f"other_params: entry {entry!r} has a missing or repeated name")
        seen.add(name)
        stage = entry.get("pp_stage")
        if stage is None:
            if pp_size > 1:
                raise ValueError(f"other_params[{name!r}] has no 'pp_stage' but the payload has "
                                 f"pp_size={pp_size}")
            stage = 0
        if not 0 <= int(stage) < pp_size:
            raise ValueError(f"other_params[{name!r}]: pp_stage={stage} is not in 0..{pp_size - 1}")
        shape = tuple(int(s) for s in entry["shape"])
        out.setdefault(int(stage), []).append(MiscItem(name, shape, wire_dtype(entry["dtype"])))
    return out


def plan_fingerprint(params: Sequence[Mapping[str, Any]],
                     misc_items: Optional[Sequence[MiscItem]] = None,
                     options: Optional[Mapping[str, int]] = None) -> int:
    """63-bit fingerprint of an ordered transfer list (names, shapes, dtypes, meshes, placements),
    plus the misc layout and the options that must match on every rank (batching, staging)."""
    h = hashlib.sha256()
    if options:
        h.update(repr(sorted(options.items())).encode())
    for p in params:
        row = (p["name"], tuple(int(s) for s in p["global_shape"]), str(wire_dtype(p["dtype"])),
               p["src_mesh_info"].key(), tuple(map(_plain_key, placements_to_plain(p["src_placements"]))),
               p["dst_mesh_info"].key(), tuple(map(_plain_key, placements_to_plain(p["dst_placements"]))))
        h.update(repr(row).encode())
    if misc_items is not None:
        h.update(b"|misc|")
        for name, shape, dtype in misc_items:
            h.update(repr((name, tuple(shape), str(dtype))).encode())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def _plain_key(p: dict) -> tuple:
    return tuple(sorted(p.items()))


def batch_bounds(params: Sequence[Mapping[str, Any]], batch_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges cutting ``params`` into batches of at most ``batch_bytes``
    global bytes (at least one param each). Depends on the payload only."""
    bounds, start, acc = [], 0, 0
    for i, p in enumerate(params):
        numel = 1
        for s in p["global_shape"]:
            numel *= int(s)
        nbytes = numel * wire_dtype(p["dtype"]).itemsize
        if i > start and acc + nbytes > batch_bytes:
            bounds.append((start, i))
            start, acc = i, 0
        acc += nbytes
    if start < len(params):
        bounds.append((start, len(params)))
    return bounds
