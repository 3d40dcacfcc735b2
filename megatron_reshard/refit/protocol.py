"""The order of one refit, stated once and run by both sides.

Torch + stdlib only (the receiver imports it). A training rank (``RefitSender``, one
group: its stage's) and a generation rank (``ReceiverSession``, one group per training
PP stage) run the same steps on their refit groups, in the same order, so every
collective of one side meets its peer on the other:

0. the version check (``version.agree_version``: one small all-reduce per group): the
   refit's version must increase the weights' version; a refusal is raised on every rank
   alike before any byte moves, and leaves the groups usable;
1. in the groups where some rank has not done so yet (a new sender or session: the
   version check says which), the plan fingerprints compared over the group
   (``RefitLoop.verify_plan``: one small all-gather per group, stage order), the planner
   option among them; the same gather carries each rank's node, from which every rank of
   the group derives the same link model and so the same plans (``refit.loop``);
2. the bulk params of every stage the rank takes part in (``RefitLoop.run``);
3. per stage in order, the stage's other params (payload ``other_params``) in chunks of at
   most ``staging_bytes`` (``packed.chunk_items``, the same cuts on both sides), each
   chunk one packed broadcast from the group's rank 0 (the stage's first train rank);
   on CUDA each chunk is waited for before the next (NCCL holds the freed buffer until
   its stream is past it), so one packed buffer is alive at a time;
4. the commit vote (``commit.commit_refit``): the version the training side sends, and
   whether a destination saw a checksum mismatch.

A failure at any step is posted on the groups' fault boards (``faults.fault_scope``:
every peer raises it within a poll) and latches the protocol broken: its groups are not
used again and a new refit needs new refit groups. What moves a misc chunk differs by side
(the sender gathers its TP shards and broadcasts, the receiver receives and writes into
vLLM's storage): each side passes its own ``move_chunk``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron_reshard.refit.commit import CommitOutcome, Findings, commit_refit
from megatron_reshard.groups.faults import RefitError, fault_scope, wait_device
from megatron_reshard.refit.packed import chunk_items
from megatron_reshard.refit.loop import RefitLoop, RefitStats
from megatron_reshard.refit.order import MiscItem
from megatron_reshard.refit.version import Refusal, agree_version

# move_chunk(stage, items): one packed broadcast of those items of the stage, this side's part
MoveChunk = Callable[[int, list[MiscItem]], None]


@dataclass
class RefitRound:
    """What one refit did on this rank: the bulk stats, the vote and the step times."""

    bulk: RefitStats
    outcome: CommitOutcome
    verify_s: Optional[float]  # None: the plan was verified in an earlier refit
    bulk_s: float
    misc_s: float
    version: Optional[int] = None  # what the version check agreed on
    mode: str = "full"             # "delta": agreed by every rank in the version check
    full_reason: Optional[str] = None  # why full (refit.delta_vote), None for a delta refit
    delta_wanted: bool = False         # the training side asks for deltas: keep a base
    version_s: float = 0.0  # step 0, the version check's vote (waits for the slowest rank)
    commit_s: float = 0.0   # step 4, the commit vote

    @property
    def bulk_bytes_moved(self) -> int:
        """The bulk bytes this rank moved: its owned boxes, except that the params moved
        as deltas count what really went over the wire (headers included)."""
        d = self.bulk.delta
        if d is None:
            return self.bulk.local_bytes
        return self.bulk.local_bytes - d["held_bytes"] + d["wire_bytes"]


class RefitProtocol:
    """One side of the refit protocol over its refit groups (see module docstring)."""

    def __init__(self, side: str, loop: RefitLoop, groups: Mapping[int, Optional[Any]],
                 misc_items: Mapping[int, Sequence[MiscItem]], staging_bytes: int,
                 pp_size: int):
        """``groups``: stage -> group for the stages this rank takes part in; ``misc_items``:
        this rank's other params per stage (the stages it takes part in)."""
        self.side = side
        self.loop = loop
        self.groups = dict(groups)
        self.misc_items = {s: list(items) for s, items in misc_items.items()}
        self.staging_bytes = staging_bytes
        self.pp_size = pp_size
        self.broken: Optional[str] = None  # why the groups cannot be used again

    def check_usable(self, message: Callable[[str], str]) -> None:
        """RefitError when an earlier refit broke the groups; ``message(why)`` says so and
        how to recover."""
        if self.broken is not None:
            raise RefitError(message(self.broken))

    @contextmanager
    def _latching(self, on_failure: Optional[Callable[[str], None]]):
        """Any failure inside: posted on the groups' boards, the groups latched broken,
        ``on_failure(reason)`` called, then re-raised."""
        try:
            with fault_scope(self.groups.values()):
                yield
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            if on_failure is not None:
                on_failure(self.broken)
            raise

    def verify_plan(self, stages: Optional[Sequence[int]] = None) -> float:
        """Step 1 on its own over the groups of ``stages`` (None: every group; communication:
        one small all-gather per group); seconds."""
        t0 = time.perf_counter()
        self.loop.verify_plan(stages)
        return time.perf_counter() - t0

    def run(self, move_chunk: MoveChunk, *, version: Optional[int] = None,
            allow_version_reuse: bool = False, last_version: Optional[int] = None,
            held_version: Optional[int] = None, device: Optional[torch.device] = None,
            on_write: Optional[Callable[[list[str]], None]] = None,
            on_failure: Optional[Callable[[str], None]] = None,
            delta_vote: Optional[list] = None, refusal: Optional[Refusal] = None,
            misc_nonfinite: Optional[Mapping[int, Sequence[int]]] = None) -> RefitRound:
        """Steps 0 to 4 (1: where some rank of a group has not checked the plan). ``version``: what the training side sends
        (None: the default, see ``refit.version``; always None on the generation side),
        ``allow_version_reuse`` and ``last_version`` (its sender's last) likewise;
        ``held_version``: the generation side's weights' version. ``device``: waited for
        after each packed chunk when CUDA; ``on_write(names)``: before params are written
        (the receiver's weight state); ``on_failure(reason)``: after the latch is set,
        before the error propagates. A ``RefitRefused`` (``VersionRefused``, ``TensorsRefused``)
        when step 0 refuses.
        ``delta_vote``: this rank's columns of the delta/full vote taken with step 0
        (``refit.delta_vote``); the bulk step then runs in the agreed mode. ``refusal``: this
        training rank cannot send its tensors as they are (``megatron.live_views``): every
        rank raises ``TensorsRefused`` at step 0. ``misc_nonfinite``: stage -> positions
        among the stage's other params that held NaN or Inf (``check_finite``), read at
        step 4 (filled by ``move_chunk``)."""
        tv = time.perf_counter()
        with self._latching(on_failure):
            agreed = agree_version(self.groups, side=self.side, version=version,
                                   allow_reuse=allow_version_reuse, held=held_version,
                                   last_sent=last_version, pp_size=self.pp_size,
                                   delta_vote=delta_vote, plan_unchecked=not self.loop.verified,
                                   refusal=refusal,
                                   param_names=self.loop.param_names(other=True))
        version_s = time.perf_counter() - tv
        if agreed.refused:  # every rank alike, nothing moved: the groups stay usable
            raise agreed.error(agreed.refused)
        with self._latching(on_failure):
            # the groups where some rank (this one or a peer) has not checked the plan yet
            verify_s = self.verify_plan(agreed.check_plan) if agreed.check_plan else None
            t0 = time.perf_counter()
            bulk = self.loop.run(on_write=on_write, mode=agreed.mode)
            t1 = time.perf_counter()
            for stage, items in self.misc_items.items():
                for chunk in chunk_items(items, self.staging_bytes):
                    move_chunk(stage, chunk)
                    if device is not None and device.type == "cuda":
                        wait_device(device, self.groups.values(), "a packed broadcast")
            t2 = time.perf_counter()
            outcome = commit_refit(self.groups, side=self.side,
                                   version=agreed.version if self.side == "src" else None,
                                   checksum_failed=bool(bulk.checksum_mismatches),
                                   pp_size=self.pp_size,
                                   findings=self._findings(bulk, misc_nonfinite or {}))
        return RefitRound(bulk, outcome, verify_s, t1 - t0, t2 - t1, agreed.version,
                          agreed.mode, agreed.full_reason, agreed.delta_wanted,
                          version_s, time.perf_counter() - t2)

    def _findings(self, bulk: RefitStats, misc_nonfinite: Mapping[int, Sequence[int]]
                  ) -> Findings:
        """What this rank found, by stage index (``commit.Findings``): a stage's bulk params
        in the payload's order, then its other params."""
        bulk_names = self.loop.param_names()
        checksum, nonfinite = {}, {}
        bad = set(bulk.checksum_mismatches)
        for stage in self.groups:
            names = bulk_names.get(stage, [])
            checksum[stage] = [i for i, n in enumerate(names) if n in bad]
            nonfinite[stage] = list(bulk.nonfinite.get(stage, ())) + [
                len(names) + i for i in misc_nonfinite.get(stage, ())]
        return Findings(checksum, nonfinite, self.loop.param_names(other=True))


__all__ = ["MoveChunk", "RefitProtocol", "RefitRound"]
