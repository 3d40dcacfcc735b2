"""End-to-end checksums of one refit stage (``RefitLoop(verify_checksums=True)``).

Torch + stdlib only. Each source adds, per param it sends, the checksum of every overlap of
its box with a destination's box into the stage's table (row: destination rank); each
destination keeps the checksum of the box it received. One SUM all-reduce of the table per
stage, then each destination compares its own row (``megatron_reshard.refit.integrity``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_reshard.engine.kernel_copies import PermutedRows
from megatron_reshard.layout.geometry import Box
from megatron_reshard.groups.collectives import all_reduce, control_device, group_size
from megatron_reshard.refit.finite import FiniteCheck, all_finite
from megatron_reshard.refit.integrity import (MODULUS, ChecksumTable, box_checksum, mismatches,
                                        source_overlaps)


def buffer_checksum(buf, box: Box, origin: tuple, finite: Optional[list] = None) -> torch.Tensor:
    """``box_checksum`` of a tensor, or of a list of tensors (one per index of dim 0): the
    checksum is a sum over the box's elements, so it is the sum of the members' parts.
    ``finite``: as for ``box_checksum``."""
    if isinstance(buf, PermutedRows):  # a kernel's order: its elements gathered back
        buf = buf.read()
    if not isinstance(buf, (list, tuple)):
        return box_checksum(buf, box, origin, finite)
    total = None
    for g in range(*box[0]):
        part = box_checksum(buf[g - origin[0]].unsqueeze(0), ((g, g + 1),) + tuple(box[1:]),
                            (g,) + tuple(origin[1:]), finite)
        total = part if total is None else (total + part).remainder_(MODULUS)
    return total if total is not None else torch.zeros((), dtype=torch.int64)


class SourceOverlaps:
    """Per (stage, param index): the (destination rank, box) pairs this source counts.
    From the payload alone, so computed once per loop."""

    def __init__(self, stages: Mapping[int, Sequence[Mapping[str, Any]]],
                 ranks: Mapping[int, int]) -> None:
        self._stages, self._ranks = stages, ranks
        self._cache: dict[tuple[int, int], list] = {}

    def get(self, stage: int, index: int) -> list:
        key = (stage, index)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = source_overlaps(self._stages[stage][index],
                                                     self._ranks[stage])
        return got


class StageChecksums:
    """The checksums of one stage's part of one run, on one side."""

    def __init__(self, side: str, stage: int, group: Optional[Any], rank: int,
                 params: Sequence[Mapping[str, Any]], overlaps: SourceOverlaps,
                 finite: Optional[FiniteCheck] = None) -> None:
        """``finite``: (training side, ``check_finite``) gets each param's finite flag,
        taken in the checksum's pass over the chunks where this rank counts the param."""
        self.side, self.stage, self.group, self.rank = side, stage, group, rank
        self.finite = finite
        self.params, self.overlaps = params, overlaps
        self.table = ChecksumTable(group_size(group), len(params))
        self.got: dict[int, torch.Tensor] = {}  # destination: param index -> checksum received

    def add(self, index: int, box: Box, buf) -> None:
        """Param ``index``, held as ``box`` in ``buf``, after the engine moved it (before any
        post hook): a source counts each overlap, a destination what it received."""
        origin = tuple(a for a, _ in box)
        if self.side == "src":
            overlaps = self.overlaps.get(self.stage, index)
            flags: Optional[list] = [] if self.finite is not None and overlaps else None
            for dst, sub in overlaps:  # they tile the box (the destinations tile the tensor)
                self.table.add(dst, index, buffer_checksum(buf, sub, origin, flags))
            if self.finite is not None:  # a replica this rank does not count: its own pass
                self.finite.add(index, torch.stack(flags).all() if flags else
                                None if flags is not None else all_finite(buf))
        else:
            self.got[index] = buffer_checksum(buf, box, origin)

    def check(self) -> list[str]:
        """One SUM all-reduce of the table; a destination returns the names whose received
        bytes differ from the sources' (a source returns [])."""
        table = self.table.dense(control_device(self.group))
        all_reduce(table, self.group, dist.ReduceOp.SUM,
                   f"the checksum exchange of stage {self.stage}")
        if self.side != "dst":
            return []
        return mismatches(table[self.rank], self.got, [p.name for p in self.params])
