"""What RL loops do to the training model's storage between refits (tests and demos only).

``move_params_(model, how, rank)``: ``"apply"`` runs what ``Module.to()`` / ``.cuda()`` run
(``model._apply``) with a copy, so every param and buffer moves to new memory; ``"data"``
offloads and onloads every param through ``param.data = ...`` (new memory, same objects);
``"data_rank0"`` does that on training rank 0 only. The values stay the same; a sender that
kept views of the old memory would send them stale from the next weight change on.
"""

from __future__ import annotations

import torch

MOVES = ("apply", "data", "data_rank0")


@torch.no_grad()
def move_params_(model: torch.nn.Module, how: str, rank: int) -> None:
    if how not in MOVES:
        raise ValueError(f"unknown move {how!r}: expected one of {MOVES}")
    if how == "apply":
        model._apply(lambda t: t.clone())
        return
    if how == "data_rank0" and rank != 0:
        return
    for p in model.parameters():
        offloaded = p.data.to("cpu", copy=True)  # what an offload to host memory keeps
        p.data = offloaded.to(p.device, copy=True)
