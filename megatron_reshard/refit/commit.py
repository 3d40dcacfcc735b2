"""The commit step that ends every refit: all ranks agree that it landed everywhere.

Torch + stdlib only (both sides run it). After the data of a refit (bulk, packed params,
the optional checksum exchange), every rank of every refit group votes: whether it failed
the integrity check, and (training ranks) the refit's version. One small MAX all-reduce
per group in stage order; with training PP > 1 a second round carries each generation
rank's view of all groups back to every group, because a training rank belongs to one
group only and must not report success while another stage's group failed.

The generation side advances its weight version only on an ``ok`` outcome, which every
rank of every group computes alike. A rank that raised before the vote never reaches it:
its peers learn of it through the groups' fault boards (``megatron_reshard.groups.faults``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_reshard.groups.collectives import all_reduce, control_device, group_rank

NO_VERSION = -(1 << 62)  # what a generation rank votes for the version (MAX ignores it)
CHECKSUM_MISMATCH = 1
# a finding (checksum mismatch, non-finite weights) travels as one int64 per kind, reduced by
# MAX: (group rank + 1) << 40 | count << 20 | (first param's stage index + 1), so every rank
# of the group names the rank, the param and how many more; the highest rank's wins
_COUNT_CAP, _INDEX_CAP = (1 << 20) - 1, (1 << 20) - 1
KINDS = ("checksum", "nonfinite")


@dataclass(frozen=True)
class Findings:
    """What this rank found wrong during a refit, per stage: the stage indexes (the payload's
    bulk params in order, then the stage's other params) of the params whose received bytes
    differ from the sources' (``checksum``, generation side) or whose training weights hold
    NaN or Inf (``nonfinite``, training side with ``check_finite``). ``names``: stage ->
    the names of those indexes (this rank's stages; other stages are named by number)."""

    checksum: Mapping[int, Sequence[int]] = field(default_factory=dict)
    nonfinite: Mapping[int, Sequence[int]] = field(default_factory=dict)
    names: Mapping[int, Sequence[str]] = field(default_factory=dict)

    def code(self, kind: str, stage: int, rank: int) -> int:
        bad = sorted(getattr(self, kind).get(stage, ()))
        if not bad:
            return 0
        return (rank + 1) << 40 | min(len(bad), _COUNT_CAP) << 20 | min(bad[0] + 1, _INDEX_CAP)

    def name(self, stage: int, index: int) -> str:
        names = self.names.get(stage, ())
        return names[index] if 0 <= index < len(names) else f"param #{index} of stage {stage}"


def _decode(code: int) -> tuple[int, int, int]:
    """(group rank, count, first index) of a finding's code."""
    return (code >> 40) - 1, (code >> 20) & _COUNT_CAP, (code & _INDEX_CAP) - 1


@dataclass(frozen=True)
class CommitOutcome:
    """What every rank learns from the vote: ``ok``, the version, and why not when not ok."""

    ok: bool
    version: Optional[int]
    reason: str = ""


def commit_refit(groups: Mapping[int, Any], *, side: str, version: Optional[int],
                 checksum_failed: bool, pp_size: int,
                 findings: Optional[Findings] = None) -> CommitOutcome:
    """Vote over every group (stage order) and return the common outcome (see module doc).
    ``findings``: what this rank found per stage (``checksum_failed`` without them: a
    mismatch this rank cannot name)."""
    findings = findings or Findings()
    # the stages where this rank's mismatches are (all of them when it cannot say)
    named = any(findings.checksum.values())
    rows: dict[int, list[int]] = {}
    for stage in sorted(groups):
        group = groups[stage]
        me = group_rank(group)
        failed = bool(findings.checksum.get(stage)) if named else checksum_failed
        v = NO_VERSION if version is None else int(version)
        vote = torch.tensor([CHECKSUM_MISMATCH if failed else 0,
                             me + 1 if failed else 0, v, NO_VERSION if version is None
                             else -v, *(findings.code(k, stage, me) for k in KINDS)],
                            dtype=torch.int64, device=control_device(group))
        all_reduce(vote, group, dist.ReduceOp.MAX, "the commit vote")
        rows[stage] = vote.tolist()
    reason = _reason(rows, findings)
    versions = {stage: row[2] for stage, row in rows.items()}
    if pp_size > 1:  # tell the single-stage training ranks what the other stages saw
        first = _first_finding(rows) if side == "dst" and reason else [0] * 3
        for stage in sorted(groups):
            group = groups[stage]
            flag = torch.tensor([1 if (side == "dst" and reason) else 0, *first],
                                dtype=torch.int64, device=control_device(group))
            all_reduce(flag, group, dist.ReduceOp.MAX, "the commit vote (all stages)")
            failed, stage_plus_one, kind, code = flag.tolist()
            if failed and not reason:
                reason = "the refit failed in another PP stage's group"
                if stage_plus_one:
                    reason += ": " + _finding_text(KINDS[kind], stage_plus_one - 1, code,
                                                   findings)
                else:
                    reason += " (see the errors there)"
    version_seen = max(versions.values()) if versions else None
    return CommitOutcome(ok=not reason, version=None if version_seen in (None, NO_VERSION)
                         else version_seen, reason=reason)


def _first_finding(rows: Mapping[int, list[int]]) -> list[int]:
    """[stage + 1, kind, code] of the first finding by stage (every generation rank sees
    every group: they all compute the same); zeros when none was named."""
    for stage, row in sorted(rows.items()):
        for kind, code in enumerate(row[4:]):
            if code:
                return [stage + 1, kind, code]
    return [0, 0, 0]


def _finding_text(kind: str, stage: int, code: int, findings: Findings) -> str:
    rank, count, index = _decode(code)
    more = f" (and {count - 1} more there)" if count > 1 else ""
    if kind == "checksum":
        return (f"group rank {rank} of stage {stage}'s group received bytes whose checksums "
                f"differ from the sources' for {findings.name(stage, index)}{more}")
    return (f"training group rank {rank} of stage {stage}'s group holds NaN or Inf in "
            f"{findings.name(stage, index)}{more} (check_finite)")


def _reason(rows: Mapping[int, list[int]], findings: Findings) -> str:
    problems = []
    for stage, (code, rank_plus_one, vmax, neg_vmin, *named) in sorted(rows.items()):
        for kind, value in zip(KINDS, named):
            if value:
                problems.append(_finding_text(kind, stage, value, findings))
        if code == CHECKSUM_MISMATCH and not named[0]:
            problems.append(f"group rank {rank_plus_one - 1} of stage {stage}'s group received "
                            f"bytes whose checksums differ from the sources'")
        if vmax == NO_VERSION:
            problems.append(f"no training rank of stage {stage}'s group sent a version")
        elif -neg_vmin != vmax:
            problems.append(f"the training ranks of stage {stage}'s group disagree on the "
                            f"version: {-neg_vmin} .. {vmax}")
    versions = {row[2] for row in rows.values()}
    if len(versions) > 1:
        problems.append(f"the stages' groups carry different versions: {sorted(versions)}")
    return "; ".join(problems)


__all__ = ["CHECKSUM_MISMATCH", "CommitOutcome", "Findings", "NO_VERSION", "commit_refit"]
