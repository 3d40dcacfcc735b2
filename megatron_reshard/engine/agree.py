"""The agreement step: one small MAX all-reduce, so that bad input fails on every rank.

Each rank votes (``Vote``) its first problem, the number of transfers, its staging
budget (the schedule's rounds depend on it), the batch fingerprint (as ``fp`` and
``-fp``, so the MAX gives both the max and the min), the hash of the stride signatures
its cached schedule was built for, the global shape of the first transfer (for a rank
given no tensors) and a signature of which of its tensors are not standard-contiguous. A problem on any rank, or ranks whose descriptions differ, make
every rank raise ``ValueError`` before any data moves. Only then, on that failure path,
more exchanges say what differs: every failing rank's message goes to every rank, and
for differing descriptions the first differing param and each rank's view of it.

On NCCL this all-reduce also creates the group communicator that coalesced P2P rounds
use. It is the only host sync of a call: ``start`` launches it, the caller launches its
first round's pack meanwhile, and ``conclude`` waits (docs/DESIGN.md, "The agreement on
the hot path", says why the vote stays on every call and what it costs).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.groups.faults import boards_of, wait_collective, wait_event

from .checks import Problem
from .p2p import P2PChannel

NO_VOTE = -(2 ** 62)  # a slot pair a rank abstains from (below every real value)
MAX_NDIM = 8          # dims of the first transfer's global shape carried by the vote
TEXT_BYTES = 512      # per rank, in the failure path's message exchange


class Vote(NamedTuple):
    """What one rank says in the agreement step."""

    problem: Optional[Problem]  # its first problem; None: ready
    count: int                  # transfers in the call
    staging: int                # staging_bytes of the call
    fingerprint: Optional[int]  # of the batch description; None: abstains (knows none)
    cached: int                 # hash of the signatures its cached schedule is for; 0: none
    strided: int                # signature of its non-standard tensors; 0: none
    shape: Optional[tuple]      # global shape of the first transfer; None: unknown here


class Tally(NamedTuple):
    """Every rank's votes, combined (the same on every rank)."""

    failed: tuple      # ((rank, transfer index or None), ...)
    same_count: bool
    same_staging: bool
    same_description: bool
    keep_schedule: bool  # every rank's cached schedule was built for the signatures now
    signatures: tuple  # per rank: its ``Vote.strided``
    shape: Optional[tuple]


class Description(NamedTuple):
    """How this rank describes its batch, for the failure path: per transfer, its name,
    a stable hash and a readable form (None: the rank abstains, knowing no description)."""

    names: Sequence[str]
    hashes: Optional[Callable[[], list]]  # per transfer: a 60-bit hash, never 0
    text: Optional[Callable[[int], str]]  # transfer index -> readable description


def hash_ints(values: tuple) -> int:
    """A stable 60-bit hash of a tuple of ints (or of any value's repr), never 0."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).hexdigest()
    return 1 + int(digest[:15], 16)


def _pair(v: Optional[int]) -> tuple:
    return (NO_VOTE, NO_VOTE) if v is None else (v, -v)


def _pack(vote: Vote, me: int, world: int) -> list:
    """The int64 slots: per-rank problem flags, (count, staging, fingerprint, cached)
    as (v, -v) pairs, the shape (ndim, dims; -1: unknown), per-rank signatures."""
    values = [0] * world
    if vote.problem is not None:
        values[me] = 1 if vote.problem.index is None else vote.problem.index + 2
    values += [*_pair(vote.count), *_pair(vote.staging), *_pair(vote.fingerprint),
               *_pair(vote.cached)]
    shape = vote.shape if vote.shape is not None and len(vote.shape) <= MAX_NDIM else None
    values += [-1] * (1 + MAX_NDIM) if shape is None else (
        [len(shape), *shape] + [-1] * (MAX_NDIM - len(shape)))
    sigs = [0] * world
    sigs[me] = vote.strided
    return values + sigs


def _unpack(got: list, world: int) -> Tally:
    failed = tuple((r, None if got[r] == 1 else got[r] - 2) for r in range(world) if got[r])
    # each pair holds (max, -min) over the ranks
    (count_max, count_neg_min, staging_max, staging_neg_min, fp_max, fp_neg_min,
     cached_max, cached_neg_min) = got[world: world + 8]
    ndim, dims = got[world + 8], got[world + 9: world + 9 + MAX_NDIM]
    shape = None if ndim < 0 else tuple(dims[:ndim])
    sigs = tuple(got[world + 9 + MAX_NDIM:])
    return Tally(failed, count_max == -count_neg_min, staging_max == -staging_neg_min,
                 fp_max == NO_VOTE or fp_max == -fp_neg_min,  # NO_VOTE: all abstained
                 cached_max == -cached_neg_min and cached_max == hash_ints(sigs), sigs, shape)


class PendingVote(NamedTuple):
    """An agreement all-reduce on its way (``start``); ``conclude`` waits for it."""

    vote: Vote
    result: torch.Tensor            # the reduced slots (on the channel's device)
    work: Any                       # CPU: the all-reduce's Work; CUDA: None
    done: Optional["torch.cuda.Event"]  # CUDA, a refit group: the all-reduce is done


def start(vote: Vote, channel: P2PChannel) -> PendingVote:
    """Launch the MAX all-reduce of this rank's vote without waiting for it, so that the
    caller's host work (the first round's pack) overlaps the vote's latency. On CUDA the
    slots go up in one copy and come back in ``conclude``'s: plain copies cost less than
    pinned buffers with an event (one H200: 70-87 µs against 91-109 for the round trip,
    ``scripts/probe_vote.py``); a refit group's board needs an event to poll."""
    values = _pack(vote, channel.rank(), channel.size())
    if channel.device.type != "cuda":
        flags = torch.tensor(values, dtype=torch.int64)
        return PendingVote(vote, flags, channel.start_allreduce_max(flags), None)
    flags = torch.tensor(values, dtype=torch.int64, device=channel.device)
    channel.start_allreduce_max(flags).wait()  # NCCL: the current stream waits, not the host
    done = None
    if boards_of([channel.group]):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(channel.device))
    return PendingVote(vote, flags, None, done)


def conclude(pending: PendingVote, description: Callable[[], Description],
             channel: P2PChannel, where: str) -> Tally:
    """Wait for the vote; raise ``ValueError`` on every rank when any rank has a problem
    or the descriptions differ (``description()`` is called only then)."""
    what = "the agreement all-reduce"
    if pending.work is not None:
        wait_collective(pending.work, channel.group, what)
    elif pending.done is not None:  # polled, so that a peer's failure is seen
        wait_event(pending.done, [channel.group], what)
    tally = _unpack(pending.result.tolist(), channel.size())  # CUDA: waits for the stream
    vote = pending.vote
    if tally.failed:
        _raise_problems(vote, tally, description(), channel, where)
    if not tally.same_staging:
        _raise_staging(vote, channel, where)
    if not (tally.same_count and tally.same_description):
        _raise_disagreement(vote, description(), channel, where)
    return tally


# ---- the failure path (every rank takes it alike: it follows from the tally) ----------


def _exchange_texts(text: str, channel: P2PChannel) -> list:
    """Every rank's ``text`` (utf-8, cut to TEXT_BYTES) on every rank: one MAX all-reduce
    of a [ranks, TEXT_BYTES] byte map, each rank filling its row."""
    rows = torch.zeros(channel.size(), TEXT_BYTES, dtype=torch.uint8)
    raw = text.encode()[:TEXT_BYTES]
    if raw:
        rows[channel.rank(), :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = rows.to(channel.device)
    channel.allreduce_max(rows)
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows.cpu().tolist()]


def _listed(parts: list, most: int = 3) -> str:
    return "; ".join(parts[:most]) + (f"; and {len(parts) - most} more" if len(parts) > most
                                     else "")


def _raise_problems(vote: Vote, tally: Tally, description: Description,
                    channel: P2PChannel, where: str) -> None:
    me = channel.rank()
    mine = vote.problem.text(tally.shape) if vote.problem is not None else ""
    texts = _exchange_texts(mine, channel)
    if vote.problem is not None:
        # ranks with this rank's problem (the same text but for the rank), then the others
        same = [r for r, _ in tally.failed
                if r != me and texts[r].replace(f"rank {r}", f"rank {me}") == mine]
        others = [f"rank {r}: {texts[r]}" for r, _ in tally.failed
                  if r != me and r not in same]
        raise BadInputError(f"{where}: {mine}" + (f" (the same on ranks {same})" if same else "")
                         + (f" (also failed on {_listed(others)})" if others else "")
                         + "; no data was moved")
    names = description.names
    who = [f"rank {r} rejected " + (f"param {names[i]!r}" if i is not None and i < len(names)
                                    else "the call") + f": {texts[r]}"
           for r, i in tally.failed]
    raise BadInputError(f"{where} on rank {me}: {_listed(who)}; no data was moved")


def _raise_staging(vote: Vote, channel: P2PChannel, where: str) -> None:
    me, world = channel.rank(), channel.size()
    row = [NO_VOTE] * world
    row[me] = vote.staging
    row = _allreduce_plain(row, channel)
    seen = "; ".join(f"{v} on {_ranks_text(rs)}" for v, rs in _ranks_by_value(row))
    raise BadInputError(f"{where} on rank {me}: ranks disagree on staging_bytes (every rank "
                     f"must pass the same, the rounds are cut by it): found {seen}; no data "
                     f"was moved")


def _ranks_by_value(row: list, skip: Optional[int] = None) -> list:
    """``[(value, [ranks])]`` of a per-rank row, the most common value first (ties: the
    lowest rank first); ranks whose value is ``skip`` left out."""
    groups: dict = {}
    for r, v in enumerate(row):
        if v != skip:
            groups.setdefault(v, []).append(r)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def _ranks_text(ranks: list) -> str:
    return f"ranks {ranks}" if len(ranks) > 1 else f"rank {ranks[0]}"


def _raise_disagreement(vote: Vote, description: Description,
                        channel: P2PChannel, where: str) -> None:
    """Find the first transfer the ranks describe differently, who differs, and how."""
    me, world = channel.rank(), channel.size()
    n, _ = _allreduce_plain([*_pair(vote.count)], channel)  # the longest batch
    hashes = description.hashes() if description.hashes is not None else None
    slots: list = []
    for i in range(n):  # 0: no transfer at this index
        slots += _pair(None if hashes is None else hashes[i] if i < len(hashes) else 0)
    got = _allreduce_plain(slots, channel)
    first = next((i for i in range(n) if got[2 * i] != NO_VOTE
                  and got[2 * i] != -got[2 * i + 1]), n - 1)
    row = [NO_VOTE] * world  # each rank's hash of that transfer; -1: abstains
    row[me] = -1 if hashes is None else hashes[first] if first < len(hashes) else 0
    row = _allreduce_plain(row, channel)
    if hashes is None:
        mine = ""
    elif first < len(description.names):
        mine = description.text(first)
    else:
        mine = f"no param at index {first} (a batch of {len(description.names)})"
    texts = _exchange_texts(mine, channel)
    name = description.names[first] if first < len(description.names) else f"#{first}"
    expected, *found = [rs for _, rs in _ranks_by_value(row, skip=-1)]
    parts = [f"expected (as on ranks {expected}) {texts[min(expected)]}"]
    parts += [f"found on {_ranks_text(rs)} {texts[min(rs)]}" for rs in found]
    raise BadInputError(f"{where} on rank {me}: ranks disagree on the batch description at "
                     f"param {name!r} (index {first} of the batch): " + "; ".join(parts)
                     + "; no data was moved")


def _allreduce_plain(values: list, channel: P2PChannel) -> list:
    """MAX all-reduce of int64 ``values`` on the channel's device (failure path)."""
    t = torch.tensor(values, dtype=torch.int64).to(channel.device)
    channel.allreduce_max(t)
    return t.cpu().tolist()


def exchange_strided(mine: tuple, ntensors: int, channel: P2PChannel) -> set:
    """Every rank's non-standard tensors as ``{(rank, k)}``: one MAX all-reduce of a
    [ranks, tensors] byte map, each rank filling its row (once per batch and layout)."""
    rows = torch.zeros(channel.size(), ntensors, dtype=torch.uint8)
    if mine:
        rows[channel.rank(), list(mine)] = 1
    rows = rows.to(channel.device)
    channel.allreduce_max(rows)
    return {(r, k) for r, k in rows.nonzero().tolist()}
