"""Run-time integrity check of a refit: per-parameter checksums, sources against receivers.

Torch + stdlib only. The checksum of a box of a global tensor is

    sum over its elements e of  bits(e) · w_0(i_0) · w_1(i_1) · …   (mod P = 2^31 - 1)

where ``bits`` is the element's bit pattern as an integer and ``w_d`` a fixed odd weight
per global index of dim ``d``. It is a sum over elements, so a box's checksum is the sum of
the checksums of any boxes that tile it: each destination rank's region can be checked
against what the sources hold of it, wherever the plan cut it. It depends on global
positions, so a row landing in the wrong place, swapped halves (gate/up) or a transposed
block change it, and it reads bits, so it is exact for every dtype (NaNs included).
Everything runs on the tensors' device in int64 (products stay below 2^62; sums are
reduced mod P), in chunks of at most ``CHUNK_ELEMENTS``: no host copy of the data.

Who counts what: of a replicated source, only the replica at coordinate 0 of every
``Replicate`` mesh axis (the *canonical* holder) contributes, so each element is counted
once. Each canonical source adds, for every destination rank, the checksum of its box's
overlap with that rank's region into a table ``[group ranks, params]``; one SUM
all-reduce over the refit group gives every destination rank the expected value of its
own regions, which it compares with the checksum of what it received.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch.distributed.tensor import Replicate

from megatron_reshard.layout.geometry import Box, box_intersect, box_numel, rank_region

if TYPE_CHECKING:  # a type only: the wire records import nothing of this module
    from megatron_reshard.wire.records import ParamRecord

MODULUS = (1 << 31) - 1
CHUNK_ELEMENTS = 1 << 22
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _weights(start: int, stop: int, dim: int, device: torch.device) -> torch.Tensor:
    """Odd weights in [1, 2^31) for global indices ``start..stop-1`` of tensor dim ``dim``."""
    idx = torch.arange(start, stop, dtype=torch.int64, device=device)
    mixed = (idx * 2654435761 + (dim + 1) * 40503 + 97) % MODULUS
    return mixed | 1


def box_checksum(local: torch.Tensor, box: Box, origin: Sequence[int],
                 finite: Optional[list] = None) -> torch.Tensor:
    """Checksum (an int64 scalar tensor on ``local``'s device) of global box ``box``, whose
    element at global index ``g`` is ``local[g - origin]``. ``finite``: a list that gets,
    per chunk of a float box, whether its elements are all finite (a bool tensor: the
    ``check_finite`` test in the same pass over the chunk, ``refit.finite``)."""
    if box_numel(box) == 0:
        return torch.zeros((), dtype=torch.int64, device=local.device)
    view = local[tuple(slice(a - o, b - o) for (a, b), o in zip(box, origin))]
    if view.dim() == 0:
        view = view.reshape(1)
        box = ((0, 1),)
    bits = view.view(_BITS[view.element_size()])  # the bit pattern, as integers
    weights = [_weights(a, b, d, local.device) for d, (a, b) in enumerate(box)]
    total = torch.zeros((), dtype=torch.int64, device=local.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, box_numel(box) // max(1, bits.shape[0])))
    floats = finite is not None and view.dtype in _FLOATS
    for r0 in range(0, bits.shape[0], rows):
        if floats:
            finite.append(torch.isfinite(view[r0:r0 + rows]).all())
        part = bits[r0:r0 + rows].to(torch.int64).remainder_(MODULUS)
        # contract the last dim first: (x · w_last).sum(-1), then the next one, ...
        for d in range(part.dim() - 1, 0, -1):
            part = (part * weights[d]).remainder_(MODULUS).sum(-1).remainder_(MODULUS)
        part = (part * weights[0][r0:r0 + rows]).remainder_(MODULUS).sum().remainder_(MODULUS)
        total = (total + part).remainder_(MODULUS)
    return total


def is_canonical_holder(mesh, placements: Sequence, rank: int) -> bool:
    """Whether ``rank`` is the one replica of its box that the sources' checksums count."""
    coord = mesh.coordinate_of(rank)
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))


def source_overlaps(param: "ParamRecord", rank: int) -> list[tuple[int, Box]]:
    """For a canonical source ``rank`` of payload param ``param`` (a ``wire.records.ParamRecord``): (destination group rank,
    overlap of this rank's box with that rank's region) for every non-empty overlap."""
    mine = rank_region(param.global_shape, param.src_mesh_info, param.src_placements,
                       rank)
    if mine is None or not is_canonical_holder(param.src_mesh_info, param.src_placements,
                                               rank):
        return []
    out = []
    for dst in param.dst_mesh_info.ranks():
        region = rank_region(param.global_shape, param.dst_mesh_info,
                             param.dst_placements, dst)[0]
        sub = box_intersect(mine[0], region)
        if sub is not None:
            out.append((int(dst), sub))
    return out


class ChecksumTable:
    """Expected checksums ``[group ranks, params]`` of one stage, filled by the sources."""

    def __init__(self, group_size: int, num_params: int):
        self.group_size, self.num_params = group_size, num_params
        self._cells: list[tuple[int, int]] = []
        self._values: list[torch.Tensor] = []

    def add(self, dst_rank: int, param_index: int, value: torch.Tensor) -> None:
        self._cells.append((dst_rank, param_index))
        self._values.append(value)

    def dense(self, device: torch.device) -> torch.Tensor:
        """The table as an int64 tensor (zeros where this rank added nothing)."""
        table = torch.zeros(self.group_size * max(1, self.num_params), dtype=torch.int64,
                            device=device)
        if self._values:
            index = torch.tensor([r * self.num_params + i for r, i in self._cells],
                                 dtype=torch.int64, device=device)
            table.index_put_((index,), torch.stack(self._values).to(device), accumulate=True)
        return table.view(self.group_size, max(1, self.num_params))


def mismatches(expected_row: torch.Tensor, got: dict[int, torch.Tensor],
               names: Sequence[str]) -> list[str]:
    """Names of the params whose received checksum differs from the expected one."""
    if not got:
        return []
    index = sorted(got)
    mine = torch.stack([got[i] for i in index]).to(expected_row.device)
    want = expected_row[index].remainder(MODULUS)
    bad = (mine != want).nonzero().flatten().tolist()  # the one host sync of the check
    return [names[index[k]] for k in bad]


__all__ = ["ChecksumTable", "MODULUS", "box_checksum", "is_canonical_holder", "mismatches",
           "source_overlaps"]
