"""Deterministic test data for benchmarks: any box of a global tensor, built locally.

Value at global flat index ``i`` is ``(i + salt) mod 251 - 125``: small integers, exact in
bf16/fp16/fp32, different in neighbouring elements, so a misplaced byte shows. A rank
builds only its own box, never the global tensor.

Signatures::

    chunk_bounds(n, parts, index) -> (lo, hi)         # torch.chunk rules
    pattern_values(global_shape, box, dtype, device, salt=0) -> Tensor   # box: [(lo, hi)] per dim
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of chunk ``index`` when ``n`` items are cut into ``parts`` torch.chunk chunks
    (ceil-sized, trailing chunks short or empty)."""
    size = -(-n // parts)
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def pattern_values(global_shape: Sequence[int], box: Sequence[tuple[int, int]],
                   dtype: torch.dtype, device: torch.device, salt: int = 0) -> torch.Tensor:
    """The part ``box`` of the deterministic global tensor (contiguous, on ``device``)."""
    if len(box) != len(global_shape):
        raise ValueError(f"pattern_values: box {list(box)} does not match shape {list(global_shape)}")
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    shape = [hi - lo for lo, hi in box]
    acc = torch.full([1] * len(shape), salt % 251, dtype=torch.int32, device=device)
    for d, (lo, hi) in enumerate(box):
        term = (torch.arange(lo, hi, dtype=torch.int64, device=device) * (strides[d] % 251)) % 251
        view = [1] * len(shape)
        view[d] = hi - lo
        acc = (acc + term.to(torch.int32).view(view)) % 251
    return (acc.expand(shape) - 125).to(dtype).contiguous()
