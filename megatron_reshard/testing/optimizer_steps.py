"""Real optimizer steps on a training model between refits (tests and benchmarks).

``adam_step_(model, step)``: one ``torch.optim.AdamW`` step (betas 0.9 / 0.95, eps 1e-8,
weight decay 0.01, lr 1e-6 by default) over FP32 master copies of the model's params,
then the params take the master weights rounded to their own dtype, as mixed-precision
training does. Gradients are seeded by step and param name (equal on replicas, so
replicated params stay equal), standing in for a backward pass: Adam normalises them,
so each element moves by about ``lr`` whatever their scale, and at RL learning rates
1-3% of the BF16 elements change per step (``scripts/measure_change_rate.py`` measures it
with real forward and backward passes).
"""

from __future__ import annotations

import zlib

import torch

_STATE_ATTR = "_megatron_reshard_master_adam"


@torch.no_grad()
def adam_step_(model: torch.nn.Module, step: int, lr: float = 1e-6) -> None:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        masters = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW([torch.nn.Parameter(m) for m in masters.values()], lr=lr,
                                betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
        state = (list(masters), opt)
        object.__setattr__(model, _STATE_ATTR, state)
    names, opt = state
    params = dict(model.named_parameters())
    masters = opt.param_groups[0]["params"]
    for name, master in zip(names, masters):
        g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{name}".encode()))
        # drawn on the CPU (the same gradients on every device), then moved to the master's
        master.grad = torch.randn(master.shape, generator=g).to(master.device)
    opt.step()
    for name, master in zip(names, masters):
        params[name].data.copy_(master.to(params[name].dtype))


__all__ = ["adam_step_"]
