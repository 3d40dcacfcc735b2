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

The digest is a position-weighted sum of the bytes, read as 32-bit words where the tensor
allows (contiguous, 4-byte aligned, a whole number of words: no conversion pass) else as
one integer per element (its bit pattern) widened to int32. The words are laid out in rows
of ``COLS``; word ``(r, c)`` of pass ``k`` (``ROWS`` rows a pass) weighs
``w[c] * v[r] * (2k + 1)``, all odd and fixed pseudo-random, each row's sum taken in
wrapping int32 and the row sums weighed in wrapping int64. A changed word changes it (an odd weight times a non-zero
change is non-zero modulo 2^32), and a swap or a shift almost surely does. Why rows: on
CPU torch reduces along the last dim many times faster than over a whole tensor (measured:
docs/DESIGN.md). It guards against accidents, not against an adversary.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

COLS = 1024           # words per row
ROWS = 4096           # rows per pass (bounds the temporaries: 16 MiB of int32)
_WIDE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_WEIGHTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_TAIL = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as an int64: the weight of the short last row


def _weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The column weights (int32, ``COLS``) and the row weights of a pass (int64,
    ``ROWS``), odd, fixed, made once per device."""
    got = _WEIGHTS.get(device)
    if got is None:
        g = torch.Generator().manual_seed(0x5EED_D16E)
        w = torch.randint(-(1 << 31), 1 << 31, (COLS,), generator=g, dtype=torch.int32) | 1
        v = torch.randint(-(1 << 62), 1 << 62, (ROWS,), generator=g, dtype=torch.int64) | 1
        got = _WEIGHTS[device] = (w.to(device), v.to(device))
    return got


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat int32 tensor: its words where it can be viewed so, else one
    bit pattern per element, widened."""
    t = t.detach()
    size = t.element_size()
    if t.is_contiguous() and (t.numel() * size) % 4 == 0 and t.data_ptr() % 4 == 0:
        return t.reshape(-1).view(torch.int32)
    flat = t.reshape(-1)
    if size == 8:
        return flat.view(torch.int32)  # a copy of the element (reshape) viewed as two words
    return flat.view(_WIDE[size]).to(torch.int32)


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``t``'s device (no host sync; five kernels for a tensor of at
    most ``ROWS`` rows of words)."""
    words = _words(t)
    w, v = _weights(words.device)
    full = words.numel() // COLS
    grid = words[:full * COLS].view(full, COLS)
    parts = []
    for k, r0 in enumerate(range(0, full, ROWS)):
        rows = grid[r0:r0 + ROWS]
        sums = (rows * w).sum(-1, dtype=torch.int32)
        part = (sums.to(torch.int64) * v[:rows.shape[0]]).sum()
        parts.append(part if k == 0 else part * (2 * k + 1))  # each pass's own odd factor
    tail = words[full * COLS:]
    if tail.numel():  # the last, short row
        part = (tail * w[:tail.numel()]).sum(dtype=torch.int32).to(torch.int64)
        parts.append(part * _TAIL)
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One digest per tensor, stacked (compared in one host sync)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([tensor_digest(t) for t in tensors])


class HeldBase(NamedTuple):
    """A generation rank's delta base as its last commit left it: the params it held in
    place for deltas (names, in order) and one digest each."""

    names: tuple[str, ...]
    digests: torch.Tensor


class BaseChanges(NamedTuple):
    """What differs from a ``HeldBase`` now (both empty: the storage is the base)."""

    held_changed: list[str]    # params that entered or left the held set
    written_outside: list[str]  # params still held whose bytes differ


def take_base(held: Sequence[tuple[str, torch.Tensor]]) -> HeldBase:
    """The base of ``held`` (``RefitLoop.held_in_place``: (name, tensor) pairs)."""
    return HeldBase(tuple(name for name, _ in held), digests([t for _, t in held]))


def base_changes(base: HeldBase, held: Sequence[tuple[str, torch.Tensor]]) -> BaseChanges:
    """Compare ``held`` now with ``base``, by name. A different set of names (a param
    re-bound to storage held through a hook, or a hook put on a spec since the commit) is
    a base that cannot be trusted: the names that changed, and no digest pass (the refit
    goes full anyway). The same names: those whose digest differs."""
    names = tuple(name for name, _ in held)
    if names != base.names:
        now, was = set(names), set(base.names)
        # the same set in another order or count (never seen): every name is in question
        return BaseChanges(sorted(now ^ was) or sorted(now), [])
    now_digests = digests([t for _, t in held]).to(base.digests.device)
    differ = (now_digests != base.digests).nonzero().flatten().tolist()
    return BaseChanges([], [names[i] for i in differ])


__all__ = ["COLS", "BaseChanges", "HeldBase", "base_changes", "digests", "take_base",
           "tensor_digest"]
