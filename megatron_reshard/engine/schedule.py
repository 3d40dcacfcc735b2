"""The schedule: a batch's plans cut into messages and placed into bounded rounds.

Plain data only (no tensors, no communication), computed alike on every rank from the
plans, the dtypes' item sizes, the staging budget and the agreed set of non-standard
tensors, so that every rank derives the same global schedule and keeps its own part.

- An op of at least ``min(DIRECT_MIN_BYTES, budget / 8)`` whose box is one contiguous run
  of a standard-strided tensor on both ends is *direct*: one message, no staging, first
  round.
- The rest is staged: per phase, R rounds with R the fewest that keep every rank within
  the budget, each peer pair's traffic cut into R messages (boxes cut in row-major order,
  segments at 16-byte aligned offsets), message k of every pair in round k, so each
  round's NCCL group carries all pairs at once; R >= 2 where a pair stages
  ``SPLIT_MIN_BYTES`` or more, so that one round's copies overlap another's transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

from megatron_reshard.layout.geometry import Box, box_numel, box_shape
from .param_plan import ParamPlan

ALIGN = 16  # staged segments start at multiples of this many bytes in their message

# Smaller ops are staged even when they could go straight: each NCCL message costs
# ~20 µs of posting and launch (1000 small direct messages: 32 ms, staged: 14 ms, on
# H200), more than packing them into one message.
DIRECT_MIN_BYTES = 16 << 20

# A pair's traffic is not cut into messages smaller than this (or than an eighth of the
# budget): tiny messages only add launches.
MIN_MESSAGE_BYTES = 1 << 20

# Staged traffic with a pair of at least this much goes in two rounds or more, even when
# one fits the budget: one round's pack or unpack then overlaps the other's transfer
# (1 -> 1, 128 MiB into a strided destination on H200: 668-765 µs in one round, 590 in
# two, 576 in four; from a strided source 637-656 -> 596).
SPLIT_MIN_BYTES = 32 << 20


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Move(NamedTuple):
    """A box of one transfer going from a piece of the sender's tensor to a piece of the
    receiver's (a local copy when both are this rank)."""

    ti: int          # transfer index in the batch
    src_piece: int
    dst_piece: int
    box: Box


class Segment(NamedTuple):
    """A box of one transfer inside a message, at ``offset`` bytes from its start."""

    ti: int
    src_piece: int   # the sender's source piece (phase 0) or destination piece (phase 1)
    dst_piece: int
    box: Box
    offset: int
    nbytes: int


class Message(NamedTuple):
    """One send or receive of this rank: its peer, tag, segments and size."""

    is_send: bool
    peer: int
    tag: int         # the message's index among the pair's messages of its phase
    segments: tuple  # tuple[Segment, ...]
    nbytes: int
    direct: bool     # one segment, straight from tensor to tensor (never staged)


class Round(NamedTuple):
    """This rank's messages of one round of the global schedule."""

    phase: int
    index: int       # round id in the global schedule (this rank may skip some)
    messages: tuple  # tuple[Message, ...]


@dataclass
class Schedule:
    """This rank's share of the global schedule (plain data, cached per batch)."""

    local: list = field(default_factory=list)   # list[Move], this rank's local copies
    nrounds: int = 0                            # rounds in the global schedule
    rounds: list = field(default_factory=list)  # list[Round], this rank's non-empty ones


class _Pending(NamedTuple):
    """A message of the global schedule before it is placed into a round."""

    seq: int
    src: int
    dst: int
    segments: tuple
    nbytes: int
    direct: bool


def cut_box(box, itemsize: int, room: int) -> tuple:
    """``(head, rest)``: the longest row-major prefix of ``box`` that is one box of at most
    ``room`` bytes (None when not even one element fits) and the boxes that cover the
    rest of ``box``, in row-major order."""
    if box_numel(box) * itemsize <= room:
        return box, []
    if not box:  # a 0-d box is one element
        return None, [box]
    (s, e), tail = box[0], box[1:]
    row = box_numel(tail) * itemsize  # bytes of one index of the first dim
    k = room // row
    if k:
        return ((s, s + k),) + tail, [((s + k, e),) + tail]
    head, rest = cut_box(tail, itemsize, room)  # one index is too big: cut inside it
    if head is None:
        return None, [box]
    first = (s, s + 1)
    return (first,) + head, [(first,) + b for b in rest] + (
        [((s + 1, e),) + tail] if s + 1 < e else [])


def message_sizes(pair_bytes: dict, cap: int) -> dict:
    """Per peer pair, the size of its messages: ``ceil(bytes / R)`` (aligned, at least
    MIN_MESSAGE_BYTES or ``cap / 8``, at most ``cap``) for the fewest rounds R such that one
    message of each pair per round keeps every rank within ``cap`` (and R >= 2 when a
    pair moves SPLIT_MIN_BYTES or more).

    Every round then carries all peer pairs at once: one NCCL group per round uses every
    link, where rounds of whole messages would serialise the pairs of a rank (measured:
    ~285 vs ~227 GB/s per destination for a 2×2 exchange, measured on 4×H200)."""
    load: dict = {}
    for (s, d), nb in pair_bytes.items():
        load[s] = load.get(s, 0) + nb
        load[d] = load.get(d, 0) + nb
    least = 2 if max(pair_bytes.values(), default=0) >= SPLIT_MIN_BYTES else 1
    first = rounds = max(least, -(-max(load.values(), default=0) // cap))
    previous, floor = None, min(MIN_MESSAGE_BYTES, cap // 8)
    while True:
        size = {p: min(cap, max(align(-(-nb // rounds)), floor))
                for p, nb in pair_bytes.items()}
        per_rank: dict = {}
        for (s, d), m in size.items():
            per_rank[s] = per_rank.get(s, 0) + m
            per_rank[d] = per_rank.get(d, 0) + m
        # stop when it fits, or when more rounds no longer shrink messages (minimum size):
        # the placement then spills the excess into extra rounds
        if all(v <= cap for v in per_rank.values()) or size == previous or rounds >= 4 * first:
            return size
        previous, rounds = size, rounds + 1


def cut_messages(copies: Sequence[Move], itemsizes: Sequence[int],
                 size: int) -> list[tuple[tuple, int]]:
    """A pair's boxes packed in order into messages of at most ``size`` bytes, boxes cut
    where a message fills up: ``[(segments, nbytes)]``, segments at aligned offsets."""
    messages, cur, end = [], [], 0
    todo = list(reversed(copies))  # a stack: pop() takes the next box
    while todo:
        ti, spi, dpi, box = todo.pop()
        isz = itemsizes[ti]
        start = align(end) if cur else 0
        head, rest = cut_box(box, isz, size - start) if start < size else (None, [box])
        if head is None and not cur:  # not one element fits a message of `size`
            head, rest = cut_box(box, isz, max(size, isz))
        if head is not None:
            nb = box_numel(head) * isz
            cur.append(Segment(ti, spi, dpi, head, start, nb))
            end = start + nb
        todo.extend(Move(ti, spi, dpi, b) for b in reversed(rest))
        if rest and cur:  # this message is full
            messages.append((tuple(cur), end))
            cur, end = [], 0
    if cur:
        messages.append((tuple(cur), end))
    return messages


def is_contiguous(shape, stride) -> bool:
    """``Tensor.is_contiguous()`` of a tensor with this shape and stride (torch's rule:
    size-1 dims are skipped, an empty tensor is contiguous)."""
    if 0 in shape:
        return True
    expected = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1:
            if st != expected:
                return False
            expected *= n
    return True


def direct_test(plans: Sequence[ParamPlan], strided: Optional[set]) -> Callable:
    """``direct(ti, op)``: whether op can go straight from tensor to tensor on both ends
    (its box is one contiguous run of a standard-strided local tensor on each side, and
    neither end's tensor is in ``strided``, the agreed set of ``(rank, k)`` of non-standard
    tensors, ``k = 2 * ti + side``). ``strided`` None: no op is direct."""
    if strided is None:
        return lambda ti, op: False
    flat: dict = {}

    def flat_in(own, piece, box) -> bool:
        key = (id(own), piece, box)
        got = flat.get(key)
        if got is None:
            std, n = [], 1
            for size in reversed(own.local_shape):
                std.append(n)
                n *= size
            index = own.pieces[piece].index(box)
            stride = tuple(st * sl.step for st, sl in zip(reversed(std), index))
            got = flat[key] = is_contiguous(box_shape(box), stride)
        return got

    def direct(ti, op) -> bool:
        plan = plans[ti]
        src_side = 0 if op.phase == 0 else 1  # phase 1 forwards from a destination tensor
        src_own = (plan.src if op.phase == 0 else plan.dst)[op.src]
        return ((op.src, 2 * ti + src_side) not in strided
                and (op.dst, 2 * ti + 1) not in strided
                and flat_in(src_own, op.src_piece, op.box)
                and flat_in(plan.dst[op.dst], op.dst_piece, op.box))

    return direct


def _place(messages: Sequence[_Pending], me: int, cap: int) -> list[list[Message]]:
    """Rounds of the global schedule (this rank's messages in each): direct messages in
    the first round; a pair's staged messages each in a later round than the one before,
    even where two would fit one round (the unpack of one then overlaps the transfer of
    the next), and no rank staging more than ``cap`` bytes in a round."""
    loads: list[dict] = []
    mine: list[list] = []
    after: dict = {}  # per pair: the first round its next staged message may go in
    for m in messages:
        s, d = m.src, m.dst
        cost = 0 if m.direct else m.nbytes
        r = 0 if m.direct else after.get((s, d), 0)
        while r < len(loads) and (loads[r].get(s, 0) + cost > cap
                                  or loads[r].get(d, 0) + cost > cap):
            r += 1
        if r == len(loads):
            loads.append({})
            mine.append([])
        loads[r][s] = loads[r].get(s, 0) + cost
        loads[r][d] = loads[r].get(d, 0) + cost
        if not m.direct:
            after[(s, d)] = r + 1
        if s == me or d == me:
            mine[r].append(Message(s == me, d if s == me else s, m.seq, m.segments,
                                   m.nbytes, m.direct))
    return mine


def build_schedule(plans: Sequence[ParamPlan], itemsizes: Sequence[int], me: int,
                   cap: int, strided: Optional[set] = None) -> Schedule:
    """The global schedule, computed alike on every rank from plain data: per phase, each
    peer pair's traffic cut into messages and the messages placed into rounds in which no
    rank stages more than ``cap`` bytes (sends + receives); this rank keeps its part.

    An op of at least ``min(DIRECT_MIN_BYTES, cap / 8)`` whose box is contiguous on both
    ends (see ``direct_test``; needs ``strided``, the agreed set of ranks' non-standard
    tensors) is a *direct* message: uncut, no staging, in the first round. Every other
    message counts fully on both ends.
    """
    sched = Schedule()
    direct = direct_test(plans, strided)
    direct_min = min(DIRECT_MIN_BYTES, cap // 8)
    for phase in (0, 1):
        pairs: dict = {}
        pair_bytes: dict = {}
        straight: list = []  # direct messages: (s, d, segment)
        for ti, plan in enumerate(plans):
            isz = itemsizes[ti]
            for op in plan.ops:
                if op.phase != phase:
                    continue
                if op.src == op.dst:
                    if op.src == me:
                        sched.local.append(Move(ti, op.src_piece, op.dst_piece, op.box))
                    continue
                nb = box_numel(op.box) * isz
                if nb >= direct_min and direct(ti, op):
                    straight.append((op.src, op.dst,
                                     Segment(ti, op.src_piece, op.dst_piece, op.box, 0, nb)))
                    continue
                pairs.setdefault((op.src, op.dst), []).append(
                    Move(ti, op.src_piece, op.dst_piece, op.box))
                pair_bytes[(op.src, op.dst)] = pair_bytes.get((op.src, op.dst), 0) + nb
        if not pairs and not straight:
            continue
        size = message_sizes(pair_bytes, cap)
        # message k of every pair before message k+1 of any: round k carries all pairs
        staged = [_Pending(seq, s, d, segs, nbytes, False)
                  for (s, d), boxes in pairs.items()
                  for seq, (segs, nbytes) in enumerate(cut_messages(boxes, itemsizes,
                                                                    size[(s, d)]))]
        staged.sort(key=lambda m: m.seq)  # stable: pairs keep their first-appearance order
        count: dict = {}  # messages per pair: the next tag
        for m in staged:
            count[(m.src, m.dst)] = count.get((m.src, m.dst), 0) + 1
        messages = []
        for s, d, seg in straight:
            tag = count.get((s, d), 0)
            count[(s, d)] = tag + 1
            messages.append(_Pending(tag, s, d, (seg,), seg.nbytes, True))
        mine = _place(messages + staged, me, cap)
        base = sched.nrounds
        sched.rounds.extend(Round(phase, base + i, tuple(msgs))
                            for i, msgs in enumerate(mine) if msgs)
        sched.nrounds += len(mine)
    return sched
