"""The vote that decides a delta or a full refit: columns appended to the version check's
row (``refit.version``), reduced by MAX. Delta only if every training rank holds a base of
version B and every generation rank of every group holds consistent weights committed at B
by this session; anything else is a full refit with the reason, on every rank alike. (What
each side keeps: the ``delta`` package.)

Torch + stdlib only (the receiver imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_reshard.refit.commit import NO_VERSION

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
                    "delta.base_digest), so a delta would land on other bytes than the "
                    "sender's base",
                 7: "the params a generation rank holds in place for deltas are not those "
                    "of its last committed refit (a param re-bound to other storage, or "
                    "given a hook, since: delta.base_digest), so its base cannot be trusted "
                    "for a delta"}


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


def dst_ready_code(session_version: Optional[int], weights: Any, hooked: bool,
                   rewritten: bool = False) -> int:
    """0 when this generation rank's storage is the base of version ``session_version``,
    else the reason's code (``DST_NOT_READY``); ``rewritten``: the session forgot its base
    because vLLM's conversion rewrote the storage after its last commit. (Code 6, the
    storage written outside the refits, and 7, the set of params held in place changed, are
    the session's own findings: its base digests.)"""
    if hooked:
        return 4
    if not weights.consistent:
        return 2
    if session_version is None:
        return 5 if rewritten else 1
    if weights.version != session_version:
        return 3
    return 0


__all__ = ["DST_NOT_READY", "ModeDecision", "SRC_NO_BASE", "VOTE_WIDTH", "decide_mode",
           "dst_ready_code", "dst_vote", "src_vote"]
