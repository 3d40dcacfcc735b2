"""Where a staged refit keeps each param of version N+1 (issue 53): the tiers.

Torch + stdlib only. In model order, the longest prefix of the params that fits
``staging_budget_bytes`` is staged in ``device`` memory (the param's own device), the next
run that fits ``host_staging_budget_bytes`` in ``host`` memory (pinned where the params are
on a GPU, so the copies to and from the device are DMA), and the rest is ``in_place``:
received into the live params once the pause has begun (``receiver.staging``). A prefix,
not a first fit: everything received after the first in-place param's batch lands inside
the pause, so the budgets are best spent on the params that arrive first.

The transfer cannot receive into host memory on a GPU (NCCL moves device memory), so a
host-staged param is received through a *bounce*: ``bounce_host_specs`` gives its receive
recipe a ``pre`` hook that copies the staged bytes into a device buffer of the same size
and strides (the base a delta or a partial write needs) and a ``post`` hook that copies the
buffer back into the host staging tensor after the batch, on the transfer's stream. A bounce
lives for one batch of the refit loop: at most ``batch_bytes`` of device memory beside the
device tier. On a CPU the bounce is a host buffer (the same code path, one copy more).
A param held through a hook votes a delta refit down (``delta.eligible.dst_hooked``), so a
session with a host tier refits in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.wire.spec import RefitCtx

TIERS = ("device", "host", "in_place")


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_budget(value: Any, name: str = "staging_budget_bytes") -> Optional[int]:
    """A staging budget checked: None (no bound) or an int >= 0 (bytes)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadInputError(f"prepare_refit option {name}: expected None or an int >= 0 "
                            f"(bytes of staging memory), found {value!r}")
    return value


@dataclass
class TierPlan:
    """Each tier's params, in model order (see module doc)."""

    device: list = field(default_factory=list)
    host: list = field(default_factory=list)
    in_place: list = field(default_factory=list)

    def tier_of(self) -> dict[str, str]:
        return {n: tier for tier in TIERS for n in getattr(self, tier)}


def plan_tiers(params: Mapping[str, torch.Tensor], device_budget: Optional[int],
               host_budget: Optional[int] = 0) -> TierPlan:
    """The tiers of ``params`` (model order) under the two budgets (None: no bound)."""
    plan, names = TierPlan(), list(params)
    at = 0
    for tier, budget in (("device", device_budget), ("host", host_budget)):
        left = None if budget is None else int(budget)
        while at < len(names):
            size = tensor_bytes(params[names[at]])
            if left is not None and size > left:
                break
            if left is not None:
                left -= size
            getattr(plan, tier).append(names[at])
            at += 1
    plan.in_place = names[at:]
    return plan


def allocate(live: torch.Tensor, tier: str) -> torch.Tensor:
    """A staging tensor for ``live``: same size, strides and dtype (the flip is a straight
    copy of its bytes, ``staged_deltas.live_view`` maps regions), on the tier's memory."""
    host = tier == "host"
    return torch.empty_strided(live.size(), live.stride(), dtype=live.dtype,
                               device="cpu" if host else live.device,
                               pin_memory=host and live.is_cuda)


class _Bounce:
    """A host-staged param's receive recipe wrapped in a device buffer (see module doc)."""

    def __init__(self, spec: Any, device: torch.device, tally: dict):
        self.inner_pre, self.inner_post = spec.pre, spec.post
        self.device = device
        self.tally = tally

    def pre(self, base: Any) -> RefitCtx:
        inner = self.inner_pre(base) if self.inner_pre is not None else RefitCtx(buf=base)
        host = inner.buf
        bounce = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype,
                                     device=self.device)
        bounce.copy_(host, non_blocking=True)  # the staged bytes: a delta's or a box's base
        self.tally["bounced_bytes"] += tensor_bytes(host)
        return RefitCtx(buf=bounce, extra={"bounce_inner": inner})

    def post(self, ctx: RefitCtx) -> None:
        inner = ctx.extra["bounce_inner"]
        inner.buf.copy_(ctx.buf, non_blocking=True)  # on the transfer's stream, after it
        if self.inner_post is not None:
            self.inner_post(inner)


def bounce_host_specs(local_map: Any, host_staging: Mapping[str, torch.Tensor],
                      device: torch.device, tally: dict) -> list[str]:
    """Give every receive recipe of ``local_map`` that writes into a host staging tensor a
    device bounce (in place: the refit loop holds these spec objects). The HF names wrapped.
    A recipe whose buffer is no single tensor (a list of members) is refused by name."""
    keys = {t.untyped_storage().data_ptr(): n for n, t in host_staging.items()}
    wrapped = []
    for hf_name, spec in local_map.specs.items():
        base = spec.base
        if isinstance(base, (list, tuple)):
            if any(isinstance(m, torch.Tensor) and m.untyped_storage().data_ptr() in keys
                   for m in base):
                raise BadInputError(f"{hf_name}: held as a list of tensors, which the host "
                                    f"staging tier cannot bounce; raise staging_budget_bytes "
                                    f"or set host_staging_budget_bytes=0")
            continue
        if not isinstance(base, torch.Tensor) or base.untyped_storage().data_ptr() not in keys:
            continue
        bounce = _Bounce(spec, device, tally)
        spec.pre, spec.post = bounce.pre, bounce.post
        wrapped.append(hf_name)
    return wrapped


__all__ = ["TIERS", "TierPlan", "allocate", "bounce_host_specs", "check_budget", "plan_tiers",
           "tensor_bytes"]
