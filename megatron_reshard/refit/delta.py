"""Delta refits: what each side keeps, and the vote that decides delta or full.

Torch + stdlib only (the receiver imports it). A delta refit sends, per bulk param the
plan moves in one hop, only the elements whose bits changed since the last committed
refit (``refit.delta_transport`` moves them). It needs a *base* on both sides:

- the training side keeps the bits it last sent for each eligible param's local view
  (``TrainBase``, under ``DeltaConfig.budget_bytes``);
- the generation side's base is its own storage, valid while the session that committed
  version B still sees consistent weights at B (``dst_vote``).

Which params can go as a delta (``delta_plans``) depends on the payload only, so every
rank decides alike: a plan with no local copy (``eligible``), and not a weight the
generation side quantizes from BF16 (``record_eligible``: it holds no BF16 base). Others
travel full, inside the same refit, through the engine. The mode itself is voted in the
version check (``refit.version``) with the columns built here: delta only if every
training rank holds a base of version B and every generation rank of every group holds
consistent weights committed at B by this session; anything else is a full refit with the
reason, on every rank alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import rank_region
from megatron_reshard.engine.param_plan import ParamPlan
from megatron_reshard.refit.commit import NO_VERSION

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


# -- eligibility (payload-derived: the same on every rank) -------------------------

def eligible(plan: ParamPlan) -> bool:
    """No local copy: every op a send between two ranks, from a source (phase 0) or, for
    replica completion, from the destination member that received the stripe (phase 1,
    forwarded as a delta of its own). A local copy (a rank on both sides, which refit
    groups do not have) goes full through the engine."""
    return bool(plan.ops) and all(op.src != op.dst for op in plan.ops)


# Where the generation side quantizes a weight (block FP8 or MXFP8 from BF16 on the wire:
# ``fp8.plan``, ``"gen_quant": "receiver"``) it holds FP8 bytes and scales, never the BF16
# a delta would be cut from: applying a BF16 delta would need a BF16 copy of the region on
# the generation rank (2 bytes per element beside the 1-byte FP8 storage) and a tile's
# scale follows the amax of all its elements, so every touched tile is quantized again.
# Such a weight goes full (BF16 through the engine, quantized on write) inside a delta
# refit; the sender-quantized ones (FP8 bytes + scales on the wire) are diffed as bytes.
RECEIVER_QUANTIZED = "receiver"


def record_eligible(record: Any) -> bool:
    """Whether a payload record may go as a delta at all (payload-derived: alike on every
    rank): not a weight the generation side quantizes from BF16."""
    return getattr(record, "gen_quant", None) != RECEIVER_QUANTIZED


def delta_plans(records: Sequence[Any], plans: Sequence[ParamPlan]) -> list[Optional[ParamPlan]]:
    """Per bulk param of a stage: its plan when it goes as a delta, else None (full)."""
    return [plan if eligible(plan) and record_eligible(rec) else None
            for rec, plan in zip(records, plans)]


# -- the vote (columns appended to the version check's row, reduced by MAX) ----------

# column order: src wants, src does not want, src has no base (a code), src base version
# (max, -min), dst not ready (a code), dst base version (max, -min)
VOTE_WIDTH = 8
SRC_NO_BASE = {1: "the training side holds no base yet (its first refit, or a new sender)",
               2: "the training side's base is over its budget",
               3: "the refit group's transport is not the process-group path (the colocated "
                  "transport reads at memcpy speed: no delta there)",
               4: "the training side's last refit did not commit (its base was dropped)"}
DST_NOT_READY = {1: "a generation rank's session has not committed a refit yet (a new "
                    "payload, new groups or a restarted worker)",
                 2: "a generation rank's weights are inconsistent after a failed refit",
                 3: "a generation rank's weights changed version since its session's last "
                    "refit",
                 4: "a generation rank holds a delta param through a hook or a list of "
                    "tensors (not its storage in place)",
                 5: "vLLM's own conversion rewrote a generation rank's storage after the "
                    "last refit (receiver.staged_conversion: block FP8), so it does not "
                    "hold the bytes a delta is cut from",
                 6: "a generation rank's storage of a delta param was written outside the "
                    "refits since its last committed refit (its base digest differs: "
                    "refit.base_digest), so a delta would land on other bytes than the "
                    "sender's base"}


def _pair(version: Optional[int]) -> list[int]:
    return [NO_VERSION, NO_VERSION] if version is None else [int(version), -int(version)]


def src_vote(wants: bool, no_base: int, base_version: Optional[int]) -> list[int]:
    if not wants:
        return [0, 1, 0, NO_VERSION, NO_VERSION, 0, NO_VERSION, NO_VERSION]
    return [1, 0, int(no_base), *_pair(None if no_base else base_version), 0,
            NO_VERSION, NO_VERSION]


def dst_vote(not_ready: int, base_version: Optional[int]) -> list[int]:
    return [0, 0, 0, NO_VERSION, NO_VERSION, int(not_ready),
            *_pair(None if not_ready else base_version)]


@dataclass(frozen=True)
class ModeDecision:
    mode: str                     # "full" or "delta"
    full_reason: Optional[str]    # why full (None for a delta refit)
    base: Optional[int] = None    # the version a delta is cut from
    wanted: bool = True           # the training side asks for deltas (a base is worth keeping)


def decide_mode(cols: Sequence[int], where: str) -> ModeDecision:
    """The mode from one group's reduced columns (the same on every rank of the group)."""
    wants, not_wants, no_base, s_max, s_negmin, not_ready, d_max, d_negmin = cols
    if not wants:
        return ModeDecision("full", "delta refits are off (RefitSender(delta=False))",
                            wanted=False)
    if not_wants:
        return ModeDecision("full", f"the training ranks of {where} disagree on delta")
    # every side's reason is said (a new sender on new groups: both sides lack a base)
    why = []
    if no_base:
        why.append(SRC_NO_BASE.get(no_base, "the training side holds no base"))
    elif s_max != -s_negmin:
        why.append(f"the training ranks hold bases of different versions: "
                   f"{-s_negmin} .. {s_max}")
    if not_ready:
        why.append(DST_NOT_READY.get(not_ready, "a generation rank holds no base"))
    if why:
        return ModeDecision("full", "; ".join(why) + f" ({where})")
    if d_max != -d_negmin or d_max != s_max:
        return ModeDecision("full", f"the base versions differ in {where}: training side "
                                    f"{s_max}, generation ranks {-d_negmin} .. {d_max}")
    return ModeDecision("delta", None, s_max)


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


def dst_ready_code(session_version: Optional[int], weights: Any, hooked: bool,
                   rewritten: bool = False) -> int:
    """0 when this generation rank's storage is the base of version ``session_version``,
    else the reason's code (``DST_NOT_READY``); ``rewritten``: the session forgot its base
    because vLLM's conversion rewrote the storage after its last commit. (Code 6, the
    storage written outside the refits, is the session's own finding: its base digests.)"""
    if hooked:
        return 4
    if not weights.consistent:
        return 2
    if session_version is None:
        return 5 if rewritten else 1
    if weights.version != session_version:
        return 3
    return 0


def dst_hooked(mine_by_stage: Mapping[int, Sequence[Any]],
               records_by_stage: Optional[Mapping[int, Sequence[Any]]] = None) -> bool:
    """Whether this generation rank holds a bulk param other than as a plain tensor of its
    storage (a pre hook, or a list of tensors): a delta needs the old bits in place. All
    held params count (not only the eligible ones: no plan is built for the vote, so a
    refit whose sender does not ask for deltas costs nothing more), except those whose
    record already sends them full (``record_eligible``: a weight this rank quantizes)."""
    for stage, mine in mine_by_stage.items():
        records = None if records_by_stage is None else records_by_stage.get(stage)
        for i, held in enumerate(mine):
            if held is None:
                continue
            if records is not None and not record_eligible(records[i]):
                continue
            if held.spec.pre is not None or not isinstance(held.spec.base, torch.Tensor):
                return True
    return False


__all__ = ["DEFAULT_BUDGET_BYTES", "DeltaConfig", "ModeDecision", "TrainBase", "VOTE_WIDTH",
           "decide_mode", "delta_plans", "dst_hooked", "dst_ready_code", "dst_vote",
           "eligible", "record_eligible", "src_vote"]
