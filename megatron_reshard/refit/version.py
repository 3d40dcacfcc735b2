"""The version check that opens every refit: versions only increase, unless asked.

Torch + stdlib only (both sides run it). Before any byte moves, every rank of every refit
group votes (one small MAX all-reduce per group, stage order): the training ranks the
version they send (or that they take the default) and whether they allow reuse, and the
last version their sender sent; the generation ranks the version their weights hold
(``receiver.state.WeightState.version``, kept by the worker across senders). So a
restarted trainer with no history is checked against what the generation side holds.

Every rank computes the same decision from the same sums: the refit's version (the given
one, or one more than the highest of the sender's last and the weights' version), or a
refusal naming both versions. With training PP > 1 a second round tells each group what
the generation ranks saw in the other groups. The same vote says which groups hold a rank
that has not compared plan fingerprints yet (a new sender, or a ``prepare_refit`` again on
groups that already refitted): every rank of exactly those groups runs the plan check
before the bulk, so neither side waits in a check the other skipped. A training rank
whose model tensors changed beyond what its sender can follow (``megatron.live_views``)
votes its group rank and the first such param's stage index: every rank of its group
raises ``TensorsRefused`` naming both (other groups learn it in the second round). A
refusal is raised on every rank alike, outside any fault scope: nothing moved, the groups
stay usable, and a refit with a higher version (or ``allow_version_reuse=True``), or with
the tensors back as they were, may follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_reshard.groups.collectives import all_reduce, control_device, group_rank
from megatron_reshard.errors import BadInputError
from megatron_reshard.refit.commit import NO_VERSION
from megatron_reshard.refit.delta_vote import VOTE_WIDTH, decide_mode, dst_vote, src_vote


class RefitRefused(BadInputError):
    """A refit refused by the version check on every rank alike, before any byte moved;
    the groups stay usable."""


class VersionRefused(RefitRefused):
    """The refit's version does not increase the weights' version (or the training ranks
    disagree on it); refused on every rank before any byte moved."""


class TensorsRefused(RefitRefused):
    """A rank's tensors changed in a way the refit cannot follow: a training rank's (a
    param gone, or its shape or dtype changed since the source was built:
    ``megatron.live_views``) or a generation rank's (a vLLM param re-allocated in another
    shape, dtype or device since ``prepare_refit``: ``receiver.live_targets``); refused on
    every rank before any byte moved."""


class NonFiniteRefused(RefitRefused):
    """A training rank's weights hold NaN or Inf (or an FP8 scale is not finite and > 0)
    and its sender checks them (``check_finite``); refused on every rank before any byte
    moved: the generation side keeps its version, consistent."""


# what a refusal is about -> the code voted (so every rank of a group names it alike)
REFUSAL_KINDS = {"tensors": 1, "nonfinite": 2, "targets": 3}


class Refusal(NamedTuple):
    """A rank's reason to refuse the refit (its own text), the stage index of the first
    bulk param it names (-1: none), which every rank of the group can name, and what it is
    about (``REFUSAL_KINDS``). ``stage``: the stage whose params ``param_index`` counts
    (None: every group's; a generation rank refuses in every group, its param is in one)."""

    text: str
    param_index: int = -1
    kind: str = "tensors"
    stage: Optional[int] = None

    def vote(self, stage: int, rank: int) -> list[int]:
        """This rank's refusal columns in the group of ``stage``: rank, param, kind."""
        index = self.param_index if self.stage in (None, stage) else -1
        return [rank + 1, index + 1, REFUSAL_KINDS[self.kind]]


# per kind: which side refuses, and what its peers say of it (the refusing rank says more)
_PEER_TEXT = {1: ("training", "holds model tensors its sender cannot send as they are now"),
              2: ("training", "holds NaN or Inf in its weights (check_finite)"),
              3: ("generation", "holds vLLM params that changed since prepare_refit")}


def _peer_refusal(kind: int, rank: int, stage: int, named: str) -> str:
    side, what = _PEER_TEXT[kind]
    return (f"{side} group rank {rank} of stage {stage}'s refit group {what}{named}: "
            f"nothing moved, see the error there")


def _elsewhere_refusal(first: Sequence[int],
                       param_names: Optional[Mapping[int, Sequence[str]]]) -> str:
    """A refusal in another stage's group (``first``: its stage, rank, param index, each
    plus one, and kind), as the generation ranks passed it on."""
    stage, rank, index = (v - 1 for v in first[:3])
    names = (param_names or {}).get(stage, ())
    named = f" ({names[index]} among them)" if 0 <= index < len(names) else ""
    return "in another PP stage's refit group: " + _peer_refusal(first[3], rank, stage, named)


@dataclass(frozen=True)
class VersionDecision:
    version: Optional[int]  # the version this refit carries (None when refused)
    refused: str = ""       # why not, the same on every rank of a group
    mode: str = "full"      # "delta" only when every rank of every group holds the base
    full_reason: Optional[str] = None  # why full (refit.delta_vote), None for a delta
    base: Optional[int] = None         # the version a delta is cut from
    check_plan: tuple[int, ...] = ()   # the stages whose groups run the plan check first
    delta_wanted: bool = False         # the training side asks for deltas (the delta package)
    error: type = VersionRefused       # what a refusal raises (TensorsRefused: a training
                                       # rank's tensors changed beyond re-binding)


def _row(side: str, version: Optional[int], allow_reuse: bool, held: Optional[int],
         last_sent: Optional[int]) -> list[int]:
    """``[explicit max, -explicit min, any default, any explicit, allow, not allow,
    held, last sent]``: summed by MAX over the group."""
    if side == "dst":
        return [NO_VERSION, NO_VERSION, 0, 0, 0, 0,
                NO_VERSION if held is None else int(held), NO_VERSION]
    given = version is not None
    return [int(version) if given else NO_VERSION, -int(version) if given else NO_VERSION,
            0 if given else 1, 1 if given else 0, 1 if allow_reuse else 0, 0 if allow_reuse else 1,
            NO_VERSION, NO_VERSION if last_sent is None else int(last_sent)]


def _decide(stage: int, row: list[int]) -> VersionDecision:
    vmax, neg_vmin, any_default, any_given, allow, deny, held, last = row
    where = f"stage {stage}'s refit group"
    if any_default and any_given:
        return VersionDecision(None, f"the training ranks of {where} disagree on the version: "
                                     f"some pass version={vmax}, others none")
    if any_given and vmax != -neg_vmin:
        return VersionDecision(None, f"the training ranks of {where} disagree on the version: "
                                     f"{-neg_vmin} .. {vmax}")
    if allow and deny:
        return VersionDecision(None, f"the training ranks of {where} disagree on "
                                     f"allow_version_reuse")
    floor = max(held, last)
    if not any_given:
        return VersionDecision(max(floor, 0) + 1)
    if floor != NO_VERSION and vmax <= floor and not allow:
        what = (f"the generation ranks hold version {held}" if held >= last
                else f"this training side's last refit sent version {last}")
        return VersionDecision(None, f"refit version {vmax} does not increase the weights' "
                                     f"version: {what} ({where}). A restarted trainer replaying "
                                     f"older weights? Pass a higher version, or "
                                     f"allow_version_reuse=True to send it anyway")
    return VersionDecision(vmax)


def _error_of(kinds: Sequence[int]) -> type:
    return NonFiniteRefused if REFUSAL_KINDS["nonfinite"] in kinds else TensorsRefused


def agree_version(groups: Mapping[int, Any], *, side: str, version: Optional[int] = None,
                  allow_reuse: bool = False, held: Optional[int] = None,
                  last_sent: Optional[int] = None, pp_size: int = 1,
                  delta_vote: Optional[list] = None, plan_unchecked: bool = False,
                  refusal: Optional[Refusal] = None,
                  param_names: Optional[Mapping[int, Sequence[str]]] = None) -> VersionDecision:
    """Vote over every group (stage order) and return the common decision (module doc).
    ``version``/``allow_reuse``/``last_sent``: the training side's; ``held``: the
    generation side's weights' version; ``plan_unchecked``: this rank has not compared plan
    fingerprints over its groups yet. ``delta_vote``: this rank's columns of the mode
    vote (``refit.delta_vote.src_vote`` / ``dst_vote``; None: no delta from this rank).
    ``refusal``: this training rank refuses the refit (its tensors changed beyond
    re-binding); every rank of its group then refuses, naming the rank and the param
    (``param_names``: the bulk param names per stage, as the payload orders them)."""
    if delta_vote is None:
        delta_vote = src_vote(False, 0, None) if side == "src" else dst_vote(1, None)
    if len(delta_vote) != VOTE_WIDTH:
        raise BadInputError(f"delta_vote has {len(delta_vote)} columns, expected {VOTE_WIDTH}")
    decisions, modes, check_plan, tensors, kinds = {}, {}, [], [], []
    first: list[int] = []
    for stage in sorted(groups):
        group = groups[stage]
        mine = [0, 0, 0] if refusal is None else refusal.vote(stage, group_rank(group))
        vote = torch.tensor(_row(side, version, allow_reuse, held, last_sent)
                            + [int(bool(plan_unchecked))] + list(delta_vote) + mine,
                            dtype=torch.int64, device=control_device(group))
        all_reduce(vote, group, dist.ReduceOp.MAX, "the version check")
        row = vote.tolist()
        decisions[stage] = _decide(stage, row[:8])
        if row[8]:
            check_plan.append(stage)
        modes[stage] = decide_mode(row[9:9 + VOTE_WIDTH], f"stage {stage}'s refit group")
        rank_plus_one, index_plus_one, kind = row[9 + VOTE_WIDTH:]
        if rank_plus_one:
            names = (param_names or {}).get(stage, ())
            named = (f" ({names[index_plus_one - 1]} among them)"
                     if 0 < index_plus_one <= len(names) else "")
            tensors.append(refusal.text if refusal is not None else
                           _peer_refusal(kind, rank_plus_one - 1, stage, named))
            kinds.append(kind)
            # the first by stage, for the other stages' training ranks (second round)
            first = first or [stage + 1, rank_plus_one, index_plus_one, kind]
    # tensors a rank cannot send or write come first: nothing may move from such a rank
    refused = list(dict.fromkeys(tensors)) + [d.refused for d in decisions.values() if d.refused]
    error = _error_of(kinds) if tensors else VersionRefused
    versions = sorted({d.version for d in decisions.values() if not d.refused})
    if not refused and len(versions) > 1:
        refused = [f"the stages' refit groups carry different versions: {versions}"]
    full = [m.full_reason for m in modes.values() if m.mode != "delta"]
    bases = sorted({m.base for m in modes.values() if m.mode == "delta"})
    if not full and len(bases) > 1:
        full = [f"the stages' refit groups hold bases of different versions: {bases}"]
    if pp_size > 1:  # tell each group's training ranks what the other stages' groups decided
        for stage in sorted(groups):
            group = groups[stage]
            # every generation rank saw every group's first round: they vote the same
            named_refusal = first if side == "dst" and first else [0] * 4
            flag = torch.tensor([1 if (side == "dst" and refused) else 0,
                                 1 if (side == "dst" and full) else 0, *named_refusal],
                                dtype=torch.int64, device=control_device(group))
            all_reduce(flag, group, dist.ReduceOp.MAX, "the version check (all stages)")
            refused_elsewhere, full_elsewhere, *elsewhere = flag.tolist()
            if elsewhere[0] and not refused:
                refused = [_elsewhere_refusal(elsewhere, param_names)]
                error = _error_of([elsewhere[3]])
            elif refused_elsewhere and not refused:
                refused = ["the refit's version was refused in another PP stage's refit group "
                           "(see the errors there)"]
            if full_elsewhere and not full:
                full = ["another PP stage's refit group needs a full refit"]
    wanted = any(m.wanted for m in modes.values())
    if refused:
        return VersionDecision(None, "; ".join(refused), check_plan=tuple(check_plan),
                               delta_wanted=wanted, error=error)
    version_ = versions[0] if versions else None
    if full:
        return VersionDecision(version_, full_reason="; ".join(dict.fromkeys(full)),
                               check_plan=tuple(check_plan), delta_wanted=wanted)
    return VersionDecision(version_, mode="delta", base=bases[0] if bases else None,
                           check_plan=tuple(check_plan), delta_wanted=wanted)


__all__ = ["NonFiniteRefused", "REFUSAL_KINDS", "RefitRefused", "Refusal", "TensorsRefused",
           "VersionDecision", "VersionRefused", "agree_version"]
