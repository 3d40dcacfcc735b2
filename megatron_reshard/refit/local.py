"""This rank's side of each bulk param of a refit stage, checked before any communication.

Torch + stdlib only (the receiver imports it). ``local_params`` pairs each param this rank
holds a side of with its ``LocalParamSpec`` and its box of the global tensor, and raises
when a spec is missing or a hook-free spec's tensor does not match the payload.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import Box, rank_region
from megatron_reshard.engine.members import members_problem
from megatron_reshard.layout.permuted_rows import PermutedRows
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec
from megatron_reshard.wire.records import ParamRecord


class LocalParam(NamedTuple):
    """A param this rank holds a side of: its spec and the box of the global tensor it holds."""

    spec: LocalParamSpec
    box: Box


def local_params(params: Sequence[ParamRecord], local_map: HFToLocalParamMap, side: str,
                 rank: int, stage: int) -> list[Optional[LocalParam]]:
    """Per param of the stage: a ``LocalParam`` where this rank (``rank`` in the stage's
    group) holds the ``side`` ("src" or "dst") of it, else None.

    Raises ValueError when a spec is missing or a hook-free spec's tensor does not match the
    payload (shape of this rank's box, wire dtype).
    """
    where = f"{side} group rank {rank} (stage {stage})"
    mine: list[Optional[LocalParam]] = []
    for p in params:
        got = rank_region(p.global_shape, p.mesh(side), p.placements(side), rank)
        if got is None:
            mine.append(None)
            continue
        box, local_shape = got
        name = p.name
        spec = local_map.get(name)
        if spec is None:
            raise BadInputError(f"{name}: no local spec on {side} group rank {rank} of stage "
                             f"{stage}, which holds region {list(box)} of this param")
        if spec.pre is None:
            _check_base(name, where, spec.base, box, tuple(local_shape), p.torch_dtype)
        mine.append(LocalParam(spec, box))
    return mine


def _check_base(name: str, where: str, base: Any, box: Box, local_shape: tuple,
                dtype: torch.dtype) -> None:
    """A hook-free spec's ``base``: a tensor of this rank's local shape and the wire dtype,
    a list of tensors, one per index of dim 0 (the engine's members, engine/members.py),
    or a box in a kernel's permuted-row order (layout/permuted_rows.PermutedRows)."""
    if isinstance(base, (list, tuple)):
        device = base[0].device.type if len(base) and isinstance(base[0], torch.Tensor) \
            else "cpu"
        why = members_problem(base, local_shape, dtype, device)
        if why:
            raise BadInputError(f"{name}: {where} holds region {list(box)} as a list of tensors: "
                             f"expected {why}")
        return
    if not isinstance(base, (torch.Tensor, PermutedRows)):
        raise BadInputError(f"{name}: {where} has a spec without pre hook whose base is "
                         f"{type(base).__name__}, not a tensor")
    if tuple(base.shape) != local_shape:
        raise BadInputError(f"{name}: {where} holds region {list(box)} in a local tensor of shape "
                         f"{list(local_shape)}, but its local tensor has shape "
                         f"{list(base.shape)}")
    if base.dtype != dtype:
        raise BadInputError(f"{name}: {where}: wire dtype {dtype} but local tensor dtype "
                         f"{base.dtype}")


def first_tensor_is_cuda(mine: Iterable[Optional[LocalParam]]) -> Optional[bool]:
    """Whether the first local tensor among ``mine`` is on CUDA; None if there is none (all
    params held through pre hooks, or none held)."""
    for entry in mine:
        if entry is None:
            continue
        base = entry.spec.base
        if isinstance(base, (list, tuple)) and base:
            base = base[0]
        if isinstance(base, PermutedRows):
            base = base.storage
        if isinstance(base, torch.Tensor):
            return base.is_cuda
    return None
