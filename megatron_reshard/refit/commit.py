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

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_reshard.groups.collectives import all_reduce, control_device, group_rank

NO_VERSION = -(1 << 62)  # what a generation rank votes for the version (MAX ignores it)
CHECKSUM_MISMATCH = 1


@dataclass(frozen=True)
class CommitOutcome:
    """What every rank learns from the vote: ``ok``, the version, and why not when not ok."""

    ok: bool
    version: Optional[int]
    reason: str = ""


def commit_refit(groups: Mapping[int, Any], *, side: str, version: Optional[int],
                 checksum_failed: bool, pp_size: int) -> CommitOutcome:
    """Vote over every group (stage order) and return the common outcome (see module doc)."""
    rows: dict[int, list[int]] = {}
    for stage in sorted(groups):
        group = groups[stage]
        me = group_rank(group)
        v = NO_VERSION if version is None else int(version)
        vote = torch.tensor([CHECKSUM_MISMATCH if checksum_failed else 0,
                             me + 1 if checksum_failed else 0, v, NO_VERSION if version is None
                             else -v], dtype=torch.int64, device=control_device(group))
        all_reduce(vote, group, dist.ReduceOp.MAX, "the commit vote")
        rows[stage] = vote.tolist()
    reason = _reason(rows)
    versions = {stage: row[2] for stage, row in rows.items()}
    if pp_size > 1:  # tell the single-stage training ranks what the other stages saw
        for stage in sorted(groups):
            group = groups[stage]
            flag = torch.tensor([1 if (side == "dst" and reason) else 0], dtype=torch.int64,
                                device=control_device(group))
            all_reduce(flag, group, dist.ReduceOp.MAX, "the commit vote (all stages)")
            if flag.item() and not reason:
                reason = "the refit failed in another PP stage's group (see the errors there)"
    version_seen = max(versions.values()) if versions else None
    return CommitOutcome(ok=not reason, version=None if version_seen in (None, NO_VERSION)
                         else version_seen, reason=reason)


def _reason(rows: Mapping[int, list[int]]) -> str:
    problems = []
    for stage, (code, rank_plus_one, vmax, neg_vmin) in sorted(rows.items()):
        if code == CHECKSUM_MISMATCH:
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


__all__ = ["CHECKSUM_MISMATCH", "CommitOutcome", "NO_VERSION", "commit_refit"]
