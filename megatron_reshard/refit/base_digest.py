"""The digest of a generation rank's delta base: a delta is applied only onto the bytes
its session committed (issue 50, item 2).

Torch + stdlib only (the receiver imports it). A delta refit writes only the elements that
changed, onto what the generation rank holds; if anything wrote that storage since the last
committed refit (a user, a post-load step, a bug), the delta lands on wrong bytes and the
result stays wrong, with checksums off, through every later delta. So after a commit the
session keeps a digest of each param it may take deltas into, and before the next refit it
computes them again: one differing digest and this rank votes "no base" (the refit goes
full on every rank, the reason and the params named). docs/DESIGN.md ("Delta base
verification") has the measured choice against forcing the end-to-end checksums on.

The digest is a position-weighted sum of the bytes, read as 64-bit words where the tensor
allows (contiguous, 8-byte aligned, a whole number of words: no conversion pass) else as
integers of the element's width widened to int64: ``sum_i word_i * w(i)`` with wrapping
int64 arithmetic, ``w`` odd and pseudo-random per position (``SLAB`` fixed weights times
an odd factor per slab), so a changed, swapped or shifted element changes it. It is not a
cryptographic hash: it guards against accidents, not against an adversary.
"""

from __future__ import annotations

from typing import Sequence

import torch

SLAB = 1 << 20  # words per pass (bounds the int64 temporaries: 16 MiB)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    got = _WEIGHTS.get(device)
    if got is None:
        g = torch.Generator().manual_seed(0x5EED_D16E)
        w = torch.randint(-(1 << 62), 1 << 62, (SLAB,), generator=g, dtype=torch.int64) | 1
        got = _WEIGHTS[device] = w.to(device)
    return got


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat integer tensor: int64 words where possible, else one integer
    per element (bit pattern)."""
    t = t.detach()
    if t.is_contiguous() and (t.numel() * t.element_size()) % 8 == 0 \
            and t.data_ptr() % 8 == 0:
        return t.reshape(-1).view(torch.int64)
    return t.reshape(-1).view(_BITS[t.element_size()])


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``t``'s device (no host sync)."""
    words = _words(t)
    w = _weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for i, start in enumerate(range(0, words.numel(), SLAB)):
        part = words[start:start + SLAB]
        n = part.numel()
        if part.dtype != torch.int64:
            part = part.to(torch.int64)
        total += (part * w[:n]).sum() * (2 * i + 1)
    return total


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One digest per tensor, stacked (compared in one host sync)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([tensor_digest(t) for t in tensors])


__all__ = ["SLAB", "digests", "tensor_digest"]
