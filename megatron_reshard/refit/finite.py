"""The opt-in check that training weights are finite (``RefitSender(check_finite=True)``).

Torch + stdlib only. NaN or Inf in a training weight is refit like any other value unless
asked: with ``check_finite`` the training side looks at every buffer it sends (the bulk
params, where the end-to-end checksums run: in the same pass over each chunk,
``integrity.box_checksum``; the packed other params, before their broadcast), and a param
holding one makes the commit vote fail on every rank, naming the param and the training
rank (``commit.Findings``): the generation side's weights are then marked inconsistent,
never committed. Buffers of other dtypes (FP8 bytes, integers) are not looked at.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_reshard.engine.kernel_copies import PermutedRows

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(buf: Any) -> Optional[torch.Tensor]:
    """A bool scalar tensor (no host sync): every element of ``buf`` (a tensor, a list of
    per-index tensors, or a kernel's permuted rows) is finite; None for non-float dtypes."""
    if isinstance(buf, PermutedRows):
        buf = buf.read()
    parts = list(buf) if isinstance(buf, (list, tuple)) else [buf]
    if not parts or parts[0].dtype not in FLOATS:
        return None
    flags = [torch.isfinite(p).all() for p in parts]
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


class FiniteCheck:
    """The finite flags of one stage's params in one run, read once at its end."""

    def __init__(self) -> None:
        self._indexes: list[int] = []
        self._flags: list[torch.Tensor] = []

    def add(self, index: int, flag: Optional[torch.Tensor]) -> None:
        """Param ``index``'s flag (``all_finite``; None: not looked at)."""
        if flag is not None:
            self._indexes.append(index)
            self._flags.append(flag)

    def bad(self) -> list[int]:
        """The indexes whose buffer held NaN or Inf (one host sync)."""
        if not self._flags:
            return []
        ok = torch.stack([f.to(self._flags[0].device) for f in self._flags]).tolist()
        return [i for i, good in zip(self._indexes, ok) if not good]


__all__ = ["FLOATS", "FiniteCheck", "all_finite"]
