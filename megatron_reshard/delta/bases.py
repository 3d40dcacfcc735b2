"""What the training side keeps for delta refits: ``TrainBase``, the bits it last sent for
each eligible param's local view, under ``DeltaConfig``'s budget, valid once the refit
committed. The generation side's base is its own storage, proven by its digests
(``delta.base_digest``). Which params go as deltas: ``delta.eligible``; the vote that
decides delta or full: ``refit.delta_vote``.

Torch + stdlib only (the receiver imports the package).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from megatron_reshard.engine.param_plan import ParamPlan
from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import rank_region

KEEP_PLACES = ("device", "pinned")
DEFAULT_BUDGET_BYTES = 1 << 30  # delta=True: keep at most 1 GiB of base per training rank


@dataclass(frozen=True)
class DeltaConfig:
    """``budget_bytes``: the most base memory a training rank keeps (over it: full refits,
    reason reported); ``keep``: where the base lives, ``"device"`` (beside the weights) or
    ``"pinned"`` (host memory, pinned when CUDA is present)."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES
    keep: str = "device"

    def __post_init__(self):
        if int(self.budget_bytes) < 0:
            raise BadInputError(f"DeltaConfig.budget_bytes must be >= 0, got {self.budget_bytes}")
        if self.keep not in KEEP_PLACES:
            raise BadInputError(f"DeltaConfig.keep must be one of {KEEP_PLACES}, got {self.keep!r}")

    @classmethod
    def of(cls, delta: Union[bool, "DeltaConfig", None]) -> Optional["DeltaConfig"]:
        """``False``/``None``: off; ``True``: the default budget; a config as it is."""
        if delta is None or delta is False:
            return None
        if delta is True:
            return cls()
        if isinstance(delta, cls):
            return delta
        raise BadInputError(f"delta must be False, True or a DeltaConfig, got {delta!r}")


# -- the training side's base ---------------------------------------------------------

class TrainBase:
    """The bits a training rank last sent for each eligible param it holds, per stage.

    Filled during every refit (full: a copy after the engine read the buffer; delta: the
    transport writes the new bits in after cutting the delta), valid once the refit
    committed (``committed``); any failure drops it (``dropped``)."""

    def __init__(self, config: DeltaConfig, stage: int, records: Sequence[Any],
                 plans: Sequence[Optional[ParamPlan]], rank: int, dtypes: Sequence[torch.dtype]):
        self.config = config
        self.stage = stage
        self.tensors: dict[int, torch.Tensor] = {}
        self.version: Optional[int] = None
        self._failed = False  # the last refit failed: the base was dropped
        need = 0
        self.held: list[int] = []
        for i, (rec, plan) in enumerate(zip(records, plans)):
            if plan is None:
                continue
            got = rank_region(rec.global_shape, rec.mesh("src"), rec.placements("src"), rank)
            if got is None:
                continue
            self.held.append(i)
            need += math.prod(got[1]) * dtypes[i].itemsize
        self.need_bytes = need

    @property
    def over_budget(self) -> bool:
        return self.need_bytes > int(self.config.budget_bytes)

    def no_base_code(self) -> int:
        """0 when a committed base is held, else the reason's code (``SRC_NO_BASE``)."""
        if self.over_budget:
            return 2
        if self.version is not None:
            return 0
        return 4 if self._failed else 1

    def slot(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """The base tensor of param ``index``, allocated like ``like`` on first use."""
        got = self.tensors.get(index)
        if got is None or got.shape != like.shape or got.dtype != like.dtype:
            if self.config.keep == "pinned":
                got = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                                  pin_memory=torch.cuda.is_available())
            else:
                got = torch.empty_like(like, memory_format=torch.contiguous_format)
            self.tensors[index] = got
        return got

    def capture(self, index: int, buf: Any) -> None:
        """Keep what a full refit sent for param ``index`` (within the budget)."""
        if self.over_budget:
            return
        self.version = None  # in progress: no valid base until the commit
        self.slot(index, as_tensor(buf)).copy_(as_tensor(buf))

    def committed(self, version: Optional[int]) -> None:
        if not self.over_budget and set(self.held) <= set(self.tensors):
            self.version = version
            self._failed = False

    def dropped(self) -> None:
        self.tensors.clear()
        self.version = None
        self._failed = True

    def report(self) -> dict:
        return {"budget_bytes": int(self.config.budget_bytes), "need_bytes": self.need_bytes,
                "kept_bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
                "keep": self.config.keep, "version": self.version}


def as_tensor(buf: Any) -> torch.Tensor:
    """A local side as one tensor (a list of per-index tensors, the engine's members, is
    stacked: a copy, read only)."""
    if isinstance(buf, (list, tuple)):
        return torch.stack(list(buf))
    return buf


__all__ = ["DEFAULT_BUDGET_BYTES", "DeltaConfig", "KEEP_PLACES", "TrainBase", "as_tensor"]
