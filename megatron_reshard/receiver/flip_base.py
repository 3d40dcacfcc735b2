"""The base check at the flip of a staged delta refit (issue 53).

Torch + stdlib only. A staged delta refit's flip writes only what the deltas change: it
applies the recorded payloads into the live params, and leaves the params no delta touches
as they are. Both are right only while the live storage still holds version N, the base
the deltas were cut from. The delta vote proved that at the refit's start (the session's
``delta.base_digest.HeldBase``, compared with the mirror of the live params); anything that
writes the live storage between that start and the flip (vLLM's ``sleep(level=2)`` +
``wake_up`` leaves zeros at the same addresses, a user's ``load_weights``, a post-load
step) would make the flip leave neither N nor N+1 behind while the state says N+1.

So before it writes anything the flip digests, on the flip's stream, the live bytes of every
param it would not copy whole, record by record as the base was taken (the same views, so
the same digests while the bytes are the same), and compares them with the base in one
host read. A param whose bytes differ is copied whole from staging instead (staging holds
N+1 whole, the commit vote checked it): exact whatever was written, and nothing refused.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

import torch

from megatron_reshard.delta.base_digest import HeldBase, digests
from megatron_reshard.receiver.staged_deltas import live_view, storage_key


class FlipBase(NamedTuple):
    """What the check found: the params whose live bytes are not the base (to copy whole),
    and the params and bytes it read."""

    changed: list[str]
    checked: int
    checked_bytes: int


def check_flip_base(base: Optional[HeldBase], held: Sequence[tuple[str, torch.Tensor]],
                    staging: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor],
                    names: Iterable[str]) -> FlipBase:
    """The params of ``names`` (staged, not copied whole by the flip) whose live bytes are not
    the base. ``base``: the session's at the refit's start (None: nothing proves the live
    bytes, every one of ``names`` is changed); ``held``: the session's records held in place
    for deltas, ``(HF name, view of a staging tensor)`` (``RefitLoop.held_in_place``). A
    param with a record missing from the base is changed; a param with no record at all
    takes no delta and was not written by the refit (a param kept as loaded): not checked."""
    names = set(names)
    if not names:
        return FlipBase([], 0, 0)
    if base is None:
        return FlipBase(sorted(names), 0, 0)
    target_of = {storage_key(t): n for n, t in staging.items()}
    index = {name: i for i, name in enumerate(base.names)}
    changed, views, rows, owners = set(), [], [], []
    for name, view in held:
        target = target_of.get(storage_key(view))
        if target not in names:
            continue
        if name not in index:
            changed.add(target)
            continue
        views.append(live_view(view, staging[target], live[target]))
        rows.append(index[name])
        owners.append(target)
    if views:
        now = digests(views)
        was = base.digests.to(now.device)[torch.tensor(rows, device=now.device)]
        differ = (now != was).tolist()  # the one host read
        changed.update(t for t, d in zip(owners, differ) if d)
    return FlipBase(sorted(changed), len(set(owners)),
                    sum(v.numel() * v.element_size() for v in views))


__all__ = ["FlipBase", "check_flip_base"]
