"""The region-wide scans of delta refits on CUDA tensors, as Triton kernels (issue 35).

Torch + stdlib only: Triton, which the CUDA builds of torch ship, loads lazily, and
``refit.delta_transport`` keeps its torch path where it is absent (CPU tensors, CPU builds)
or switched off (``MEGATRON_RESHARD_DELTA_KERNELS=0``). Every payload the kernels write is
the torch path's, byte for byte; every apply is bit-exact.

Cut (``cut_many``, ``Cut``): the regions of one element size go as a batch (``_Batch``),
each kernel launched once for all of them: their blocks, tiles and slot_write programs
numbered one region after another, each program finding its region in a table (addresses
as offsets from an argument, so the compiler still knows their alignment). ``cut_mark``
reads new and old once (bits as integers, so NaN payloads and
-0.0 compare exactly; 1-, 2- and 4-byte elements a 32-bit word at a time) and writes the
bitmask (the wire's BITMASK index as it is); per element nothing else, the scan being
bound by its instructions as much as by its bytes. A block of ``BLOCK`` elements with at
most ``_cap()`` changes (a 32nd of its elements) then lists its non-zero 16-element words
and, one lane a listed word, puts each change in the block's slot (in-block position, DIFF8
byte) from the copies of new and old its loads just brought into the caches, and counts
its escapes and skip bytes from the list; a block over the cap (dense changes) counts them
per element. Two small kernels over the per-block figures (``cut_tiles`` per tile of
blocks, ``cut_offsets`` over the few tiles) give each block the change before it (so the
skip bytes of the gap across its boundary) and its offsets in the payload's sections, and
choose the encoding from the totals as ``delta_transport.pick_encoding`` does.
``slot_write`` writes that encoding (GAPS or POSITIONS index, DIFF8 differences and
escapes or whole values) from the slots, each block at its offsets, reading new only for
whole values, in the same queue, before the host reads the totals (the one host read):
launched for each encoding the slots give, a launch writes only if the device chose it,
no block went over its slot and the payload fits its room (``_room``); otherwise ``payload``
writes it after the read (``slot_write`` from the slots, ``cut_write`` the blocks over the
cap from the bitmask and new and old: a 16-element word a lane, the changes of a word in
turn). Scratch per element of the region: 1/8 byte of bitmask, 11/32 of listed words and
slots, and up to 1/16 of its bytes for the speculated payload, freed with the batch's last
``Cut`` (and payload).

Apply (``apply_sparse``, GAPS or POSITIONS, with DIFF8 or whole values): GAPS, a batch of
deltas at once (``launch_gaps_many``; one delta is a batch of one): their payloads' chunks
numbered across the batch, a program a chunk finding its delta (a binary search of their
first chunks) and its row of a table (addresses, sizes, first chunk); ``gap_sums`` (per
chunk: values, the distance advanced, 0x80 bytes), one flat cumsum for the batch (a
delta's sums by subtracting the sum before its first chunk), ``gap_locate`` (per delta:
where the gaps end, the last position, the escapes announced), then ``apply_gaps`` checks
its delta's figures itself, as the host checks them after, and writes nothing of a delta
unless all of them hold: three launches for the batch, no host round trip, and the one
host read after them raises for a delta that did not fit (nothing of it written). POSITIONS
the same way (``launch_positions_many``, a batch of deltas through the same kind of table):
``pos_sums`` (per chunk of positions: bad positions, escapes), a cumsum, then
``apply_index``, which checks its delta's sums itself and writes nothing unless they hold;
the host read after. Both decode each chunk's positions and add the differences (or write
the values) in place.
BITMASK: ``bitmask_counts`` (checked against the header), then ``apply_bitmask`` writes
whole values, or ``bitmask_positions`` feeds the DIFF8 steps to ``apply_sparse``. A
strided view is handled when it folds into rows of unit stride (``rows_form``: a TP shard's
column block); any other view takes the torch path.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from megatron_reshard.engine.triton_build import built_once


BLOCK = 4096  # elements per program of the cut: a power of two, 32 to 32768 (16-bit slots)
WARPS = 4
CHUNK = 2048  # index entries (GAPS: payload bytes) per program of the apply
APPLY_WARPS = 4
_TILE = 1024  # blocks per program of the passes over per-block figures (cut_tiles)
SLOT_ENTRIES = 1024  # slot entries per step of a slot_write program
SLOT_SUB = 32  # of each block's slot a step
SLOT_WARPS = 8  # (2048 entries on 4 warps spilled registers: twice the time on an H200)
_ROOM = 16  # a speculative payload takes up to 1/_ROOM of the region's bytes (Cut.room)
_ZB = 4096  # bytes a step of slot_write's zeroing of a speculative gap section
# the encodings a cut writes before the host reads its totals (Cut.speculated): those the
# slots give, with DIFF8 but for 1-byte elements (delta_transport's codes: GAPS 4,
# POSITIONS 1, DIFF8 8), each with its INDEX (2 gaps, 1 positions) for slot_write
_SPECULATED = {True: ((12, 2), (9, 1)), False: ((4, 2), (1, 1))}
_SPECULATED_CODES = {k: {enc for enc, _ in v} for k, v in _SPECULATED.items()}
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def enabled() -> bool:
    """Whether the kernels may be used (``MEGATRON_RESHARD_DELTA_KERNELS=0``: no)."""
    return os.environ.get("MEGATRON_RESHARD_DELTA_KERNELS", "1") != "0"


def usable(t: torch.Tensor) -> bool:
    """Whether ``t``'s deltas go through the kernels: a CUDA tensor of 1, 2, 4 or 8 bytes
    an element, with Triton present and the kernels switched on."""
    return (t.is_cuda and t.element_size() in _INTS and enabled()
            and _kernels() is not None)


class Rows(NamedTuple):
    """A view as ``rows`` x ``cols`` elements, unit stride along cols, ``stride`` between
    rows (a contiguous view: one row)."""

    rows: int
    cols: int
    stride: int


def rows_form(view: torch.Tensor) -> Optional[Rows]:
    """The view as rows of unit stride, or None when its dims do not fold so."""
    dims = []
    for n, s in zip(view.shape, view.stride()):
        if n == 1:
            continue
        if dims and dims[-1][1] == s * n:
            dims[-1] = (dims[-1][0] * n, s)
        else:
            dims.append((n, s))
    if not dims:
        return Rows(1, max(1, view.numel()), 0)
    if dims[-1][1] != 1 or len(dims) > 2:
        return None
    if len(dims) == 1:
        return Rows(1, dims[0][0], 0)
    return Rows(dims[0][0], dims[1][0], dims[0][1])


def _bad_delta(message: str) -> Exception:
    # imported here: delta_transport imports this module
    from megatron_reshard.refit.delta_transport import DeltaTransportError
    return DeltaTransportError(message)


def _cap() -> int:
    """Changes a block's slot holds: a 32nd of its elements (room for 3% changed); scratch
    per element of the region: 1/8 byte of bitmask, 11/32 of listed words and slot."""
    return max(1, BLOCK // 32)


def _pack(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements the scan compares a 32-bit word at a time (0: one at a time): 1-, 2- and
    4-byte elements whose count and both addresses allow it."""
    pack = 4 // a.element_size() if a.element_size() <= 4 else 0
    if not pack or a.numel() % pack or a.data_ptr() % 4 or b.data_ptr() % 4:
        return 0
    return pack


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a flat tensor of integers (``t`` itself when it is one already)."""
    ints = _INTS[t.element_size()]
    if t.dtype is ints and t.dim() == 1 and t.is_contiguous():
        return t
    return t.contiguous().view(ints).reshape(-1)


def _upload(values: list, dev: torch.device) -> torch.Tensor:
    """``values`` as int64 on ``dev``. To a GPU through pinned memory: a copy from pageable
    memory may wait for the kernels already queued (the one-region cut uploads its table
    behind its scan), a pinned one is queued behind them and returns (torch's host
    allocator keeps the pinned block until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=dev.type == "cuda")
    return host.to(dev, non_blocking=True)


def _step_type(item: int):
    import triton.language as tl
    return tl.int32 if item <= 2 else tl.int64  # new - old of the bits, without overflow


def _tl_type(item: int):
    import triton.language as tl
    return {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[item]


def _as_values(raw: torch.Tensor, item: int) -> tuple[torch.Tensor, bool]:
    """Bytes of a payload section as elements when they start on an element boundary."""
    if raw.numel() % item == 0 and raw.storage_offset() % item == 0 and raw.data_ptr() % item == 0:
        return raw.view(_INTS[item]), True
    return raw, False


def _value_sections(values: torch.Tensor, count: int, item: int, diff8: bool) -> tuple:
    """``(values, aligned, escapes, escapes aligned)`` of a payload's value bytes: DIFF8's
    one byte per change then the escaped values whole, or the values whole (no escapes)."""
    if diff8:
        return (values[:count], True, *_as_values(values[count:], item))
    return (*_as_values(values, item), values, True)


# -- cut ------------------------------------------------------------------------------

# a region's row of a cut batch's table (int64), read by the kernels at these places:
# 0 new's offset from the batch's anchor (elements), 1 old's, 2 elements, 3 its first block
# in the batch, 4 blocks, 5 first tile, 6 tiles, 7 first slot_write program, 8 its
# speculated payload's offset in the batch's buffer (bytes), 9 that payload's room, 10 its
# row of the totals
_ROW = 11


# per device, int64 zeros kept for one-region batches' ids (grown, never written). Kept for
# the process: zeros stay zeros; one buffer per device, as large as the largest batch's ids
_ZEROS: dict = {}


def _zeros(n: int, dev: torch.device) -> torch.Tensor:
    """``n`` int64 zeros on ``dev``, a view of a buffer kept between calls and never written.
    Made (or grown) in the stream of the cut that first needs it, whose one host read waits
    for it: later cuts, in any stream of this thread, read it filled."""
    kept = _ZEROS.get(dev)
    if kept is None or kept.numel() < n:
        kept = _ZEROS[dev] = torch.zeros(max(n, 1 << 16), dtype=torch.int64, device=dev)
    return kept[:n]


def _room(n: int, item: int) -> int:
    """Bytes a speculative payload may take: a 16th of the region's (a multiple of 8),
    GAPS + DIFF8 of bf16 at up to ~6% changed; the rest take the second pass."""
    return max(4096, -(-n * item // _ROOM // 8) * 8)


class Cut:
    """One region's changes found (``cut_mark`` and the per-block offsets) and its totals,
    taken by ``finish`` from the host's one read of a batch's: ``count``, ``skips`` (GAPS
    skip bytes), ``escapes`` (DIFF8), ``chosen`` (the encoding the device chose from them,
    as ``delta_transport.pick_encoding`` does) and ``speculated``: ``(encoding, payload)``
    written in the same queue before that read, or None where the slots do not give the
    chosen encoding or its payload overran its room (``_room``). ``payload`` writes any
    encoding after the read. Made by ``cut_many`` (``cut``: one region alone)."""

    def __init__(self, batch: "_Batch", a: torch.Tensor, b: torch.Tensor, row: list):
        self.a, self.b, self.n = a, b, a.numel()
        self._batch = batch
        self._block0, self.blocks, self._program0 = row[3], row[4], row[7]
        self._out_at, self._room = row[8], row[9]

    def finish(self, totals: list) -> None:
        """Take the totals the host read: the 6 figures of this cut's row."""
        self.count, self.escapes, gap_bytes, self.overflowed, enc, size = totals
        self.skips = gap_bytes - self.count
        self.chosen, self.speculated = enc, None
        if (not self.overflowed and size <= self._room
                and enc in _SPECULATED_CODES[self.a.element_size() > 1]):
            self.speculated = (enc, self._batch.out[self._out_at:self._out_at + size])

    @property
    def mask(self) -> torch.Tensor:
        """The region's bitmask bytes (its blocks' words, the wire's BITMASK index)."""
        return self._batch.mask[self._block0 * BLOCK // 8:(self._block0 + self.blocks) * BLOCK // 8]

    def payload(self, index: str, diff8: bool, index_size: int = 4) -> torch.Tensor:
        """The payload with index ``"gaps"``, ``"positions"`` (``index_size`` bytes each)
        or ``"bitmask"``, then DIFF8 differences and escapes or whole values."""
        item, count, batch = self.a.element_size(), self.count, self._batch
        nindex = {"gaps": count + self.skips, "positions": count * index_size,
                  "bitmask": (self.n + 7) // 8}[index]
        nvalues = count + self.escapes * item if diff8 else count * item
        out = torch.empty(nindex + nvalues, dtype=torch.uint8, device=self.a.device)
        if index == "gaps" and self.skips:
            out[:nindex].zero_()  # the skip bytes
        if index == "bitmask":
            out[:nindex].copy_(self.mask[:nindex])
        where = out[:nindex].view(_INTS[index_size]) if index == "positions" else out
        values, aligned, escapes, esc_aligned = _value_sections(out[nindex:], count, item, diff8)
        code = {"gaps": 2, "positions": 1, "bitmask": 0}[index]
        if self.overflowed < self.blocks:  # the blocks whose changes fit their slot
            programs = -(-self.blocks // batch.group)
            batch.slots(programs, self._program0, where, values, escapes, code, diff8,
                        aligned, esc_aligned, 0, index_size)
        if self.overflowed:  # the others from new and old
            _kernels().cut_write[(self.blocks,)](
                self.a, self.b, batch.mask16, batch.stats, batch.starts, batch.before,
                batch.blocks, self._block0, where, values, escapes, INDEX=code, DIFF8=diff8,
                ALIGNED=aligned, ESC_ALIGNED=esc_aligned, STEP=_step_type(item), ITEM=item,
                BLOCK=BLOCK, CAP=batch.cap, num_warps=WARPS)
        return out


class _Batch:
    """The regions of one element size, packing and index size cut together: one table,
    one scratch and one buffer of speculated payloads for them all, each kernel launched
    once for the batch (a region's blocks, tiles and slot_write programs numbered after
    the previous region's; ``ids`` names each one's region). Lives while a ``Cut`` of it
    does: a speculated payload is a view of ``out``."""

    def __init__(self, members: list, pack: int, index_size: int, totals: torch.Tensor):
        a0 = members[0][1]
        item, dev = a0.element_size(), a0.device
        self.cap = cap = _cap()
        self.sub = min(SLOT_SUB, cap)
        self.group = SLOT_ENTRIES // self.sub
        self.item, self.totals = item, totals
        self.anchor = a0
        # a region's new and old as element offsets from ``anchor``; AL: whether every
        # one is 16-byte aligned (see ``_region``)
        at0 = a0.data_ptr()
        self.rows = rows = []  # a list of _ROW figures a region
        counts, aligned = [[], [], []], at0 % 16 == 0
        blocks = tiles = programs = out = 0
        for k, a, b in members:
            n = a.numel()
            nblocks = max(1, -(-n // BLOCK))
            ntiles = -(-nblocks // _TILE)
            nprograms = -(-nblocks // self.group)
            room = _room(n, item)
            da, db = a.data_ptr() - at0, b.data_ptr() - at0
            aligned = aligned and da % 16 == 0 and db % 16 == 0
            rows.append([da // item, db // item, n, blocks, nblocks, tiles, ntiles, programs,
                         out, room, k])
            for c, x in zip(counts, (nblocks, ntiles, nprograms)):
                c.append(x)
            blocks, tiles, programs, out = (blocks + nblocks, tiles + ntiles,
                                            programs + nprograms, out + room)
        self.blocks, self.tiles = blocks, tiles
        self.align = 16 // item if aligned else 1
        maxt = max(16, 1 << (max(counts[1]) - 1).bit_length())
        # two allocations for all the scratch (host time per call counts at these speeds):
        # per block its non-zero words listed (int64), its bitmask bytes, its slot (int16
        # positions, DIFF8 bytes); then the int64 figures
        raw = torch.empty(blocks * (11 * cap + BLOCK // 8), dtype=torch.uint8, device=dev)
        self.words, self.mask, pos, self.slot_byte = raw.split(
            [8 * blocks * cap, blocks * BLOCK // 8, 2 * blocks * cap, blocks * cap])
        self.mask16, self.slot_pos = self.mask.view(torch.int16), pos.view(torch.int16)
        # per block: changed, escapes, gap bytes (3 rows); then their offsets (exclusive);
        # the first and last change; the last change before it; per tile figures; per block
        # where cut_mark starts (several regions: cut_spots)
        nr = len(members)
        self.one = nr == 1
        spots = 0 if self.one else 4 * blocks
        (self.stats, self.starts, self.firsts, self.lasts, self.before, figures,
         self.spots) = torch.empty(9 * blocks + 6 * tiles + spots, dtype=torch.int64,
                                   device=dev).split([3 * blocks, 3 * blocks, blocks, blocks,
                                                      blocks, 6 * tiles, spots])
        self.pack = pack
        k = _kernels()
        if self.one:  # the scan needs no table: it starts before the table is even built
            self.mark()
        up = _upload([x for row in rows for x in row]
                     + ([] if self.one else list(range(nr)) * 3 + sum(counts, [])), dev)
        self.table = up[:nr * _ROW]
        # each block's, tile's and slot_write program's region, in that order (one region:
        # all 0, from a kept buffer: no op)
        self.ids = (_zeros(blocks + tiles + programs, dev) if self.one else
                    torch.repeat_interleave(up[nr * _ROW:nr * (_ROW + 3)], up[nr * (_ROW + 3):],
                                            output_size=blocks + tiles + programs))
        self.out = torch.empty(out, dtype=torch.uint8, device=dev)
        if not self.one:
            k.cut_spots[(-(-blocks // 1024),)](self.table, self.ids, self.spots, blocks,
                                               BLOCK=BLOCK, N=1024, num_warps=4)
            self.mark()
        k.cut_tiles[(tiles,)](self.table, self.ids, self.stats, self.firsts, self.lasts,
                              self.before, figures, blocks, tiles, TILE=_TILE, CAP=cap,
                              num_warps=4)
        k.cut_offsets[(tiles,)](self.table, self.ids, self.stats, self.before, figures,
                                self.starts, totals, blocks, tiles, TILE=_TILE, MAXT=maxt,
                                ITEM=item, IDX=index_size, num_warps=4)
        # each region's payload in the same queue, for each encoding the slots can give,
        # each launch writing only where the device chose it: no host round trip between
        # the scan and the payload (the host reads the totals once, after both)
        for enc, index in _SPECULATED[item > 1]:
            where = self.out if index == 2 else self.out.view(_INTS[index_size])
            self.slots(programs, 0, where, self.out, self.out, index, enc > 8, False, False,
                       enc, index_size)

    def mark(self) -> None:
        """``cut_mark`` over the batch's blocks (the scan of new and old)."""
        a0, (n1, old1) = self.anchor, (self.rows[0][2], self.rows[0][1])
        _kernels().cut_mark[(self.blocks,)](
            a0, a0.view(torch.int32) if self.pack else a0, self.spots, n1, old1, self.mask16,
            self.stats, self.firsts, self.lasts, self.words.view(torch.int64), self.slot_pos,
            self.slot_byte, self.blocks, STEP=_step_type(self.item), BLOCK=BLOCK, CAP=self.cap,
            PACK=self.pack, ITEM=self.item, AL=self.align, ONE=self.one, num_warps=WARPS)

    def slots(self, programs, program0, where, values, escapes, index, diff8, aligned,
              esc_aligned, enc, index_size):
        """``slot_write`` over ``programs`` of the batch's from ``program0``: ``enc`` > 0,
        every region's speculated payload (if chosen) in ``out``; else one region's payload
        into ``where``, ``values`` and ``escapes``."""
        _kernels().slot_write[(programs,)](
            self.anchor, self.table, self.ids, self.stats, self.starts, self.before, self.blocks,
            self.tiles, program0, self.slot_pos, self.slot_byte, where, values, escapes,
            self.totals, INDEX=index, DIFF8=diff8, ALIGNED=aligned, ESC_ALIGNED=esc_aligned,
            ITEM=self.item, BLOCK=BLOCK, CAP=self.cap, GROUP=self.group, SUB=self.sub,
            SPEC=enc > 0, ENC=enc, IDX=index_size, ZB=_ZB, AL=self.align,
            num_warps=SLOT_WARPS)


def cut_many(pairs: list, index_sizes: list[int]) -> list[Cut]:
    """A ``Cut`` of each ``(new, old)`` pair with one host read for them all: the regions
    of one element size, packing and index size go as one batch (``_Batch``: each kernel
    launched once for the batch), and the device drains once. The scratch of every cut
    lives until the read: callers bound the regions' bytes (``delta_transport.encode_many``)."""
    if not pairs:
        return []
    dev = pairs[0][0].device
    totals = torch.empty(len(pairs), 6, dtype=torch.int64, device=dev)
    batches: dict = {}
    for k, ((new, old), size) in enumerate(zip(pairs, index_sizes)):
        a = _flat_bits(new)
        b = _flat_bits(old if old.device == a.device else old.to(a.device))
        batches.setdefault((a.element_size(), _pack(a, b), size), []).append((k, a, b))
    cuts: list = [None] * len(pairs)
    for (_, pack, size), members in batches.items():
        batch = _Batch(members, pack, size, totals)
        for (k, a, b), row in zip(members, batch.rows):
            cuts[k] = Cut(batch, a, b, row)
    for cut, figures in zip(cuts, totals.tolist()):  # the one host read
        cut.finish(figures)
    return cuts


def cut(new: torch.Tensor, old: torch.Tensor, index_size: int = 4) -> Cut:
    """``cut_many`` of one region."""
    return cut_many([(new, old)], [index_size])[0]


# -- apply ----------------------------------------------------------------------------

class Pending(NamedTuple):
    """A sparse apply launched and not yet checked: ``check`` takes the host's read of
    ``figures`` (a small int64 tensor on the device) and raises for a delta that did not
    fit (the kernels wrote nothing of it). ``delta_transport.apply_many`` reads the figures
    of many at once."""

    figures: torch.Tensor
    check: object


def apply_sparse(view: torch.Tensor, count: int, gaps: bool, diff8: bool,
                 payload: torch.Tensor, index_size: int,
                 positions: Optional[torch.Tensor] = None) -> bool:
    """Write a GAPS or POSITIONS delta (``positions``: int64 positions given apart, the
    payload then holding only the values) into ``view`` in place; False when the view does
    not fold into rows (the caller takes the torch path). A delta whose structure does not
    fit is refused (``DeltaTransportError``) before anything is written."""
    pending = launch_sparse(view, count, gaps, diff8, payload, index_size, positions)
    if pending is None:
        return False
    pending.check(pending.figures.tolist())  # the one host read
    return True


def launch_sparse(view: torch.Tensor, count: int, gaps: bool, diff8: bool,
                  payload: torch.Tensor, index_size: int,
                  positions: Optional[torch.Tensor] = None) -> Optional[Pending]:
    """``apply_sparse``'s launches, its check left to the caller (``Pending``); None when
    the view does not fold into rows. A structure wrong on its face raises at once. A
    batch of one (``launch_gaps_many``, ``launch_positions_many``; ``positions``: the
    same table, its index address the int64 positions')."""
    if rows_form(view) is None:
        return None
    if gaps:
        return launch_gaps_many([(view, count, diff8, payload)])[0]
    if positions is None:
        return launch_positions_many([(view, count, diff8, payload, index_size)])[0]
    return _launch_positions([(view, count, diff8, positions.data_ptr(), payload.data_ptr(),
                               payload.numel(), 8)])[0]


def positions_whole(view: torch.Tensor, count: int, diff8: bool, nvalues: int) -> int:
    """The bytes of escaped values of a POSITIONS delta of ``count`` changes whose index
    is followed by ``nvalues`` bytes (DIFF8: its differences, then those); raises for a
    delta wrong on its face (too few bytes, or whole values of the wrong size)."""
    whole = nvalues - count * (1 if diff8 else view.element_size())
    if diff8 and whole < 0:
        raise _bad_delta(f"a delta of {count} differences carries {nvalues} bytes "
                         f"after its index")
    if not diff8 and whole != 0:
        raise _bad_delta(f"a delta of {count} values carries {nvalues} bytes")
    return whole


def launch_positions_many(items: list) -> list[Pending]:
    """POSITIONS deltas ``(view, count, diff8, payload, index_size)`` (each view folding
    into rows) applied with two launches (``pos_sums``, ``apply_index``) and one flat
    cumsum per element size, DIFF8 flag and index size, however many deltas: their chunks
    of positions numbered across the batch, each program finding its delta in the table
    (the binary search of ``launch_gaps_many``); their ``Pending`` checks in order. A
    delta wrong on its face raises before anything is launched; ``apply_index`` checks
    each delta's sums itself and writes nothing of one that does not fit."""
    return _launch_positions([(view, count, diff8, payload.data_ptr(),
                               payload.data_ptr() + count * size, payload.numel() - count * size,
                               size) for view, count, diff8, payload, size in items])


def _launch_positions(deltas: list) -> list[Pending]:
    """``launch_positions_many`` of ``(view, count, diff8, index address, values address,
    value bytes, index size)``: the index (``index size`` bytes a position) and the
    values (DIFF8: a byte each, then the escapes' whole values) apart, so that the
    positions of a bitmask (int64, a tensor of their own) take the same table. A table
    row: index address, values address, count, numel, target address, cols, stride,
    escaped values' bytes, first chunk; each address's alignment is read on the device
    (an aligned load where a section starts on an element boundary, bytes otherwise)."""
    wholes = [positions_whole(view, count, diff8, nvalues)  # all before any launch
              for view, count, diff8, _, _, nvalues, _ in deltas]

    def key(delta):
        return delta[0].element_size(), delta[2], delta[6]

    def row(delta, first):
        view, count, diff8, index_at, values_at, _, _, whole = delta
        numel, item = view.numel(), view.element_size()
        form = rows_form(view)

        def check_positions(figures: list) -> None:
            bad, escapes = figures
            if bad:
                raise _bad_delta(f"a positions delta names elements outside its "
                                 f"{numel}-element box")
            if diff8 and whole != escapes * item:
                raise _bad_delta(f"a delta of {count} differences with {escapes} escapes "
                                 f"carries {whole} bytes of whole values")
        return ([index_at, values_at, count, numel, view.data_ptr(), form.cols, form.stride,
                 whole, first], max(1, -(-count // CHUNK)), check_positions)

    def launch(table, figures, chunks, ty, item, diff8, size):
        k, n = _kernels(), figures.shape[0]
        sums = torch.empty(2 * chunks, dtype=torch.int64, device=figures.device)
        it = _tl_type(size)
        k.pos_sums[(chunks,)](table, n, sums, chunks, DIFF8=diff8, IT=it, IDX=size,
                              CHUNK=CHUNK, num_warps=APPLY_WARPS)
        ends = torch.cumsum(sums, 0)  # one flat scan (the kernels take each delta apart)
        # no host read before: apply_index checks the positions and the escapes itself and
        # writes nothing of a delta unless they hold, so the launches queue back to back
        k.apply_index[(chunks,)](table, n, ends, figures, chunks, TY=ty, IT=it, DIFF8=diff8,
                                 STEP=_step_type(item), ITEM=item, IDX=size, CHUNK=CHUNK,
                                 num_warps=APPLY_WARPS)
    return _table_groups([(*d, w) for d, w in zip(deltas, wholes)], key, row, 2, launch)


def _gaps_check(count: int, numel: int, nbytes: int, item: int, diff8: bool, vend: int):
    """The host's check of a GAPS apply's figures (``gap_locate``'s:
    found, the gaps' last byte, the last position, escapes, values named, ...)."""
    def check(figures: list) -> None:
        ok, last_byte, last, escapes, named, _ = figures
        if not diff8 and (vend < 0 or named != count):
            raise _bad_delta(f"a gaps delta names {named} elements (header: {count}) "
                             f"reaching past its {numel}-element box")
        if not ok or (diff8 and last_byte + 1 + count > nbytes):
            raise _bad_delta(f"a gaps delta of {count} elements holds fewer gap bytes")
        if last >= numel:
            raise _bad_delta(f"a gaps delta names {count} elements (header: {count}) "
                             f"reaching past its {numel}-element box")
        whole = nbytes - last_byte - 1 - count
        if diff8 and whole != escapes * item:
            raise _bad_delta(f"a delta of {count} differences with {escapes} escapes "
                             f"carries {whole} bytes of whole values")
    return check


def launch_gaps_many(items: list) -> list[Pending]:
    """GAPS deltas ``(view, count, diff8, payload)`` (each view folding into rows, any
    payload) applied with three launches (``gap_sums``, ``gap_locate``, ``apply_gaps``)
    and one flat cumsum per element size and DIFF8 flag, however many deltas: their chunks
    numbered across the batch, each program finding its delta in the table (a binary
    search of the deltas' first chunks); their ``Pending`` checks in order. ``apply_gaps``
    checks each delta's figures itself and writes nothing of one that does not fit."""
    def launch(table, figures, chunks, ty, item, diff8):
        k, deltas = _kernels(), figures.shape[0]
        sums = torch.empty(3 * chunks, dtype=torch.int64, device=figures.device)
        k.gap_sums[(chunks,)](table, deltas, sums, figures, chunks, CHUNK=CHUNK,
                              num_warps=APPLY_WARPS)
        ends = torch.cumsum(sums, 0)  # one flat scan (the kernels take each delta apart)
        k.gap_locate[(chunks,)](table, deltas, ends, figures, chunks, CHUNK=CHUNK,
                                num_warps=APPLY_WARPS)
        # no host read before: apply_gaps checks the figures itself and writes nothing of
        # a delta unless it fits, so the launches queue back to back
        k.apply_gaps[(chunks,)](table, deltas, ends, figures, chunks, TY=ty, DIFF8=diff8,
                                STEP=_step_type(item), ITEM=item, CHUNK=CHUNK,
                                num_warps=APPLY_WARPS)
    return _gaps_groups(items, launch)


def _gaps_groups(items: list, launch) -> list[Pending]:
    """GAPS deltas grouped by element size and DIFF8 flag (``_table_groups``), a row per
    delta: payload address, bytes, count, numel, target address, cols, stride, where
    whole values start without DIFF8 (< 0: short), its first chunk; ``launch(table,
    figures, chunks, TY, item, diff8)`` writes each delta's 6 figures."""
    def key(delta):
        return delta[0].element_size(), delta[2]

    def row(delta, first):
        view, count, diff8, payload = delta
        form, nbytes, item = rows_form(view), payload.numel(), view.element_size()
        vend = 0 if diff8 else nbytes - count * item
        return ([payload.data_ptr(), nbytes, count, view.numel(), view.data_ptr(), form.cols,
                 form.stride, vend, first], max(1, -(-nbytes // CHUNK)),
                _gaps_check(count, view.numel(), nbytes, item, diff8, vend))
    return _table_groups(items, key, row, 6, launch)


def _table_groups(items: list, key, row, nfigures: int, launch) -> list[Pending]:
    """Deltas grouped by ``key(item)`` (element size first), each group's table sent in
    one copy: ``row(item, first chunk)`` gives a delta's row (its first chunk last, where
    the kernels' binary search reads it), its chunks and its host check;
    ``launch(table, figures, chunks, TY, *key)`` writes each delta's ``nfigures``
    figures; their ``Pending`` in the items' order. (A delta id per chunk, built here,
    cost more host time than the whole table: the kernels search the first chunks.)"""
    groups: dict = {}
    for k, item in enumerate(items):
        groups.setdefault(key(item), []).append(k)
    out: list = [None] * len(items)
    for group, ks in groups.items():
        rows, checks, chunks = [], [], 0
        for k in ks:
            cells, n, check = row(items[k], chunks)
            rows += cells
            chunks += n
            checks.append(check)
        dev = items[ks[0]][0].device  # the first delta's view
        table = _upload(rows, dev)
        figures = torch.empty(len(ks), nfigures, dtype=torch.int64, device=dev)
        launch(table, figures, chunks, _tl_type(group[0]), *group)
        for r, (k, check) in enumerate(zip(ks, checks)):
            out[k] = Pending(figures[r], check)
    return out


def bitmask_counts(index: torch.Tensor, numel: int) -> torch.Tensor:
    """Set bits per block of a bitmask of ``numel`` elements (bits past them ignored)."""
    blocks = max(1, -(-numel // BLOCK))
    counts = torch.empty(blocks, dtype=torch.int64, device=index.device)
    _kernels().count_bits[(blocks,)](index, numel, counts, BLOCK=BLOCK, num_warps=WARPS)
    return counts


def bitmask_positions(index: torch.Tensor, numel: int, counts: torch.Tensor,
                      count: int) -> torch.Tensor:
    """The int64 positions of a bitmask's set bits (``count``: their checked total)."""
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty(count, dtype=torch.int64, device=index.device)
    _kernels().compact[(counts.numel(),)](index, numel, index.numel(), starts, pos,
                                          BLOCK=BLOCK, num_warps=WARPS)
    return pos


def apply_bitmask(view: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                  counts: torch.Tensor) -> bool:
    """Write whole values (bytes) at a bitmask's set bits into ``view`` in place; False
    when the view does not fold into rows (the caller takes the torch path)."""
    form = rows_form(view)
    if form is None:
        return False
    item = view.element_size()
    target = view.view(_INTS[item])
    aligned = values.storage_offset() % item == 0
    vals = values.view(target.dtype) if aligned else values
    _kernels().apply_bitmask[(counts.numel(),)](
        target, index, torch.cumsum(counts, 0) - counts, vals, view.numel(), form.cols,
        form.stride, CONTIG=form.rows == 1, ROW8=form.cols % 8 == 0, ALIGNED=aligned,
        ITEM=item, BLOCK=BLOCK, num_warps=WARPS)
    return True


# -- the kernels ----------------------------------------------------------------------

class _Kernels(NamedTuple):
    cut_spots: object
    cut_mark: object
    cut_tiles: object
    cut_offsets: object
    cut_write: object
    slot_write: object
    gap_sums: object
    gap_locate: object
    pos_sums: object
    apply_gaps: object
    apply_index: object
    compact: object
    count_bits: object
    apply_bitmask: object


def _build(triton, tl) -> _Kernels:

    # The cut's blocks are [BLOCK // 8, 8] tiles: row k holds elements 8k..8k+7, the bits
    # of bitmask byte k, so packing stays inside a thread and whatever depends on the
    # order of changes (ranks, gaps) is worked out per byte (a row), the changes inside a
    # byte by bit tricks. Offsets inside a block are int32 from pointers moved to the
    # block once (64-bit arithmetic per element costs more than the bytes).

    @triton.jit
    def _local(BLOCK: tl.constexpr):
        return tl.arange(0, BLOCK // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]

    @triton.jit
    def _lanes(BLOCK: tl.constexpr):
        return tl.arange(0, BLOCK // 16)[:, None] * 16 + tl.arange(0, 16)[None, :]

    @triton.jit
    def _popcount(x):  # set bits of a 16-bit word (int32)
        x = x - ((x >> 1) & 0x5555)
        x = (x & 0x3333) + ((x >> 2) & 0x3333)
        x = (x + (x >> 4)) & 0x0F0F
        return (x + (x >> 8)) & 0x1F

    @triton.jit
    def _bit_index(one):  # which bit a word's single set bit is (0 for none)
        return (((one & 0xFF00) != 0).to(tl.int32) * 8 + ((one & 0xF0F0) != 0).to(tl.int32) * 4
                + ((one & 0xCCCC) != 0).to(tl.int32) * 2 + ((one & 0xAAAA) != 0).to(tl.int32))

    @triton.jit
    def _top_bit(x):  # a word's highest set bit alone
        x = x | (x >> 1)
        x = x | (x >> 2)
        x = x | (x >> 4)
        x = x | (x >> 8)
        return x ^ (x >> 1)

    @triton.jit
    def _sum_max_min_max(a0, a1, a2, a3, b0, b1, b2, b3):
        return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2), tl.maximum(a3, b3)

    @triton.jit
    def _max_before(av, ap, bv, bp):
        # scan of (max, max before the last): the second half is an exclusive running max
        return tl.maximum(av, bv), tl.maximum(av, bp)

    @triton.jit
    def _words_before(word, BLOCK: tl.constexpr):
        # per 16-element word of a block: its first changed element (block-local), and
        # the last changed element of the words before it (-1: none in this block)
        w = tl.arange(0, BLOCK // 16)
        has = word != 0
        lo = w * 16 + _bit_index(word & -word)
        last = tl.where(has, w * 16 + _bit_index(_top_bit(word)), -1)
        _, prev = tl.associative_scan((last, tl.full((BLOCK // 16,), -1, tl.int32)), 0,
                                      _max_before)
        return has, lo, last, prev

    @triton.jit
    def _row_before(ends, K: tl.constexpr, chunks, first, j):
        # row K of per-chunk figures summed by one flat cumsum: its sum over chunks
        # [first, j) (a delta's, from its first chunk: the scan segmented by subtraction)
        hi = K * chunks + j
        lo = K * chunks + first
        return (tl.where(hi > 0, tl.load(ends + tl.maximum(hi - 1, 0)), 0)
                - tl.where(lo > 0, tl.load(ends + tl.maximum(lo - 1, 0)), 0))

    @triton.jit
    def _delta_of(table, deltas, j):
        # the delta whose chunks hold chunk j: the last row of a GAPS or POSITIONS table
        # (_table_groups) whose first chunk is not after j (a binary search; no load for a
        # batch of one)
        lo = j * 0
        hi = lo + deltas
        while hi - lo > 1:
            mid = (lo + hi) // 2
            after = tl.load(table + mid * 9 + 8) > j
            lo = tl.where(after, lo, mid)
            hi = tl.where(after, mid, hi)
        return lo

    @triton.jit
    def _delta_row(table, d):
        # delta d's row of a table: GAPS (_gaps_groups) payload address, bytes, count,
        # numel, target address, cols, stride, vend, first chunk; POSITIONS
        # (_launch_positions) index address, values address, count, numel, target
        # address, cols, stride, escaped values' bytes, first chunk
        row = table + d * 9
        return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
                tl.load(row + 4), tl.load(row + 5), tl.load(row + 6), tl.load(row + 7),
                tl.load(row + 8))

    @triton.jit
    def _bits(mask, block, left, limit, BLOCK: tl.constexpr):
        # the block's bits as one int32 per element (0 past the region: ``left`` elements
        # remain from the block's first), and their offsets in the block
        j = block * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(mask + j, mask=j < limit, other=0).to(tl.int32)
        loc = _local(BLOCK)
        bits = tl.where(loc < left, (byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, 0)
        return bits, loc

    @triton.jit
    def _ranks(bits):
        # each element's 0-based rank among the set bits of its block, row-major
        row = tl.sum(bits, axis=1)
        return (tl.cumsum(row, axis=0) - row)[:, None] + tl.cumsum(bits, axis=1) - 1

    @triton.jit
    def _put(out, start, o, v, keep, ALIGNED: tl.constexpr, ITEM: tl.constexpr):
        # store value v (integer bits) at element start + o of out; bytes when unaligned
        if ALIGNED:
            tl.store(out + start + o, v, mask=keep)
        else:
            for k in tl.static_range(ITEM):
                tl.store(out + start * ITEM + o * ITEM + k, ((v >> (8 * k)) & 0xFF).to(tl.uint8),
                         mask=keep)

    @triton.jit
    def _get(src, start, o, keep, like, ALIGNED: tl.constexpr, ITEM: tl.constexpr):
        # the value at element start + o of src (bits of like's type); bytes when unaligned
        if ALIGNED:
            v = tl.load(src + start + o, mask=keep, other=0).to(like.dtype)
        else:
            w = tl.zeros_like(like).to(tl.int64)
            for k in tl.static_range(ITEM):
                byte = tl.load(src + start * ITEM + o * ITEM + k, mask=keep, other=0)
                w = w | (byte.to(tl.int64) << (8 * k))
            v = w.to(like.dtype)
        return v

    @triton.jit
    def _get_at(addr, o, keep, like, TY: tl.constexpr, ITEM: tl.constexpr):
        # element o (TY, ITEM bytes) of the section at byte address ``addr`` (a table's:
        # its alignment known on the device only), as like's type: a load of TY each where
        # the section starts on an element boundary, bytes otherwise
        if addr % ITEM == 0:
            v = _get(addr.to(tl.pointer_type(TY)), 0, o, keep, like, True, ITEM)
        else:
            v = _get(addr.to(tl.pointer_type(tl.uint8)), 0, o, keep, like, False, ITEM)
        return v

    @triton.jit
    def _write_at(target, at, keep, v, small, esc, cols, stride, CONTIG: tl.constexpr,
                  DIFF8: tl.constexpr, STEP: tl.constexpr):
        # a chunk's changes in place at element positions ``at`` of a view folded into rows
        # (CONTIG: one row): the values ``v``, or (DIFF8) old + ``small`` where not
        # ``esc``, the escapes' whole values ``v`` where it is
        if CONTIG:
            addr = at
        else:
            addr = (at // cols) * stride + at % cols
        if DIFF8:
            old = tl.load(target + addr, mask=keep & ~esc, other=0)
            stepped = (old.to(STEP) + small.to(STEP)).to(target.dtype.element_ty)
            v = tl.where(esc, v, stepped)
        tl.store(target + addr, v, mask=keep)

    @triton.jit
    def _count_before(p, ends, chunks, first, x, CHUNK: tl.constexpr, ESCAPES: tl.constexpr):
        # bytes of p[0:x) that are not 0 (or, ESCAPES, that are 0x80: a DIFF8 escape),
        # from the per-chunk counts (``ends`` row 0, or row 2; p's from ``first``) and the
        # partial chunk
        c = x // CHUNK
        base = _row_before(ends, 2 if ESCAPES else 0, chunks, first, first + c)
        i = c * CHUNK + tl.arange(0, CHUNK)
        y = tl.load(p + i, mask=i < x, other=0).to(tl.int32)
        hit = (y == 128) if ESCAPES else (y != 0)
        return base + tl.sum((hit & (i < x)).to(tl.int64))

    @triton.jit
    def _cheaper(best, enc, index, count, escapes, CODE: tl.constexpr, ITEM: tl.constexpr):
        # (bytes, encoding) of the cheaper of best and an index of ``index`` bytes with
        # whole values, then with DIFF8 (none for 1-byte elements); ties keep the first
        whole = index + count * ITEM
        enc = tl.where(whole < best, CODE, enc)
        best = tl.minimum(whole, best)
        if ITEM > 1:
            small = index + count + escapes * ITEM
            enc = tl.where(small < best, CODE + 8, enc)
            best = tl.minimum(small, best)
        return best, enc

    @triton.jit
    def _choose(n, count, escapes, gap_bytes, ITEM: tl.constexpr, IDX: tl.constexpr):
        # ``delta_transport.pick_encoding`` on the device: (encoding, payload bytes) of the
        # cheapest, ties to the one it lists first (dense 3, bitmask 2, positions 1, gaps
        # 4; whole values before DIFF8, +8); dense also where the host's encode() takes it
        # before asking (count * (ITEM + 1) >= n * ITEM); none (0) for no change
        best = n * ITEM
        enc = best * 0 + 3
        best, enc = _cheaper(best, enc, (n + 7) // 8, count, escapes, 2, ITEM)
        best, enc = _cheaper(best, enc, count * IDX, count, escapes, 1, ITEM)
        best, enc = _cheaper(best, enc, gap_bytes, count, escapes, 4, ITEM)
        dense = count * (ITEM + 1) >= n * ITEM
        enc = tl.where(count == 0, 0, tl.where(dense, 3, enc))
        best = tl.where(count == 0, 0, tl.where(dense, n * ITEM, best))
        return enc, best

    @triton.jit
    def _region(anchor, row, col, AL: tl.constexpr):
        # a region of a cut batch: ``anchor`` (a kernel argument) moved by the offset at
        # ``col`` of its table row (``_ROW``). AL > 1: every offset is a multiple of AL (16
        # bytes): with the anchor's own alignment the compiler then keeps the addresses of
        # a block's loads in far fewer registers (cut_mark for sm_90: 96 against 140, as
        # few as with the region's own tensor as the argument)
        off = tl.load(row + col)
        if AL > 1:
            off = tl.multiple_of(off, AL)
        return anchor + off

    @triton.jit
    def _tile_blocks(table, ids, blocks, t, TILE: tl.constexpr):
        # the blocks of tile t of a cut batch (its region's, in the batch's numbering)
        row = table + tl.load(ids + blocks + t) * 11
        b0 = tl.load(row + 3)
        i = b0 + (t - tl.load(row + 5)) * TILE + tl.arange(0, TILE)
        return i, i < b0 + tl.load(row + 4)

    # the kernels find the helpers they call among the module's globals, not in closures
    globals().update(_local=_local, _lanes=_lanes, _popcount=_popcount, _bit_index=_bit_index,
                     _top_bit=_top_bit, _max_before=_max_before,
                     _sum_max_min_max=_sum_max_min_max,
                     _words_before=_words_before,
                     _row_before=_row_before, _delta_of=_delta_of, _delta_row=_delta_row,
                     _bits=_bits, _ranks=_ranks, _put=_put, _get=_get, _get_at=_get_at,
                     _count_before=_count_before, _write_at=_write_at, _cheaper=_cheaper,
                     _choose=_choose, _region=_region,
                     _tile_blocks=_tile_blocks)

    @triton.jit
    def cut_mark(anchor, anchor32, spots, n1, old1, mask, stats, firsts, lasts, words,
                 slot_pos, slot_byte, blocks, STEP: tl.constexpr, BLOCK: tl.constexpr,
                 CAP: tl.constexpr, PACK: tl.constexpr, ITEM: tl.constexpr, AL: tl.constexpr,
                 ONE: tl.constexpr):
        # mask: the bitmask as int16 words (16 elements each, little-endian: the wire's
        # bytes). Per element only the compare and the packing into words. A block of at
        # most CAP changes (so at most CAP non-zero words) then lists its non-zero words
        # (``words``: index << 16 | bits, in order), and one lane per listed word puts its
        # changes in the block's slot (in-block position, DIFF8 byte) from the copies of
        # new and old the loads just brought into the caches: the payload is written from
        # the slots alone. A block over CAP (dense changes) takes the per-element path.
        # A block of the batch (``_Batch``): where its new and old start (offsets from the
        # anchor), the elements left in its region from there, its first element in the
        # region. ONE (a batch of one region, the anchor its new): from the arguments, no
        # load before the scan's; else from ``spots`` (cut_spots): one round of loads
        # (the table through the block's region id took two: ~20% of the scan's time)
        block = tl.program_id(0).to(tl.int64)
        if ONE:
            first = block * BLOCK
            oa = first
            ob = old1 + first
            left = n1 - first
        else:
            spot = spots + block * 4
            oa = tl.load(spot)
            ob = tl.load(spot + 1)
            left = tl.load(spot + 2)
            first = tl.load(spot + 3)
        if AL > 1:  # see _region
            oa = tl.multiple_of(oa, AL)
            ob = tl.multiple_of(ob, AL)
        pa = anchor + oa
        pb = anchor + ob
        loc = _lanes(BLOCK)
        inside = loc < left
        if PACK > 0:
            # PACK elements a 32-bit word (n a multiple of PACK, both 4-byte aligned): one
            # xor for PACK elements, each element's bit from its bits of the xor (the
            # compare and the packing are the whole per-element cost of the scan)
            UNITS: tl.constexpr = 16 // PACK
            u = tl.arange(0, BLOCK // 16)[:, None] * UNITS + tl.arange(0, UNITS)[None, :]
            there = u < left // PACK
            oa32 = oa * ITEM // 4
            ob32 = ob * ITEM // 4
            if AL > 1:
                oa32 = tl.multiple_of(oa32, AL * ITEM // 4)
                ob32 = tl.multiple_of(ob32, AL * ITEM // 4)
            a32 = anchor32 + oa32
            b32 = anchor32 + ob32
            xor = (tl.load(a32 + u, mask=there, other=0)
                   ^ tl.load(b32 + u, mask=there, other=0))
            if PACK == 1:
                flags = (xor != 0).to(tl.int32)
            else:
                flags = ((xor & ((1 << (32 // PACK)) - 1)) != 0).to(tl.int32)
                for i in tl.static_range(1, PACK):
                    flags |= (((xor >> (i * (32 // PACK))) & ((1 << (32 // PACK)) - 1)) != 0
                              ).to(tl.int32) << i
            word = tl.sum(flags << (tl.arange(0, UNITS)[None, :] * PACK), axis=1)
        else:
            va = tl.load(pa + loc, mask=inside, other=0)
            vb = tl.load(pb + loc, mask=inside, other=0)
            word = tl.sum((va != vb).to(tl.int32) << tl.arange(0, 16)[None, :], axis=1)
        w = tl.arange(0, BLOCK // 16)
        tl.store(mask + block * (BLOCK // 16) + w, word.to(tl.int16))
        pop = _popcount(word)
        # few reductions across the warps (each a round through shared memory and two
        # barriers): changes and non-zero words packed in one sum, with the most changes
        # of a word (the loop below) in the same pass
        both = pop + ((word != 0).to(tl.int32) << 16)
        # the block's first and last change in the same pass (block-local; none: BLOCK, -1)
        low = tl.where(word != 0, w * 16 + _bit_index(word & -word), BLOCK)
        top = tl.where(word != 0, w * 16 + _bit_index(_top_bit(word)), -1)
        total, most, low, top = tl.reduce((both, pop, low, top), 0, _sum_max_min_max)
        count = total & 0xFFFF
        if count <= CAP:
            # list the non-zero words: rank of their first change << 32 | index << 16 | bits
            ahead = tl.cumsum(both, 0) - both
            listed = words + block * CAP
            tl.store(listed + (ahead >> 16), ((ahead & 0xFFFF).to(tl.int64) << 32)
                     | ((w << 16) | word).to(tl.int64), mask=word != 0)
            tl.debug_barrier()  # the list, written by all the block's threads, read back
            nnz = total >> 16
            lane = tl.arange(0, CAP)
            on = lane < nnz
            e = tl.load(listed + lane, mask=on, other=0, cache_modifier=".cg")
            pe = tl.load(listed + lane - 1, mask=on & (lane > 0), other=0,
                         cache_modifier=".cg").to(tl.int32)
            rank = (e >> 32).to(tl.int32)
            bits = e.to(tl.int32) & 0xFFFF
            base = (e.to(tl.int32) >> 16) * 16
            prior = (pe >> 16) * 16 + _bit_index(_top_bit(pe & 0xFFFF))
            skip = tl.where(on & (lane > 0), (base + _bit_index(bits & -bits) - prior - 1) // 255,
                            0)
            sp = slot_pos + block * CAP
            sb = slot_byte + block * CAP
            rem = bits
            escaped = tl.zeros((CAP,), tl.int32)
            for k in tl.static_range(16):
                if k < most:
                    live = rem != 0
                    one = base + _bit_index(rem & -rem)
                    got = tl.load(pa + one, mask=live, other=0)
                    was = tl.load(pb + one, mask=live, other=0)
                    step = got.to(STEP) - was.to(STEP)
                    esc = live & ((step < -127) | (step > 127))
                    small = tl.where(esc, -128, step).to(tl.int8)
                    tl.store(sp + rank + k, one.to(tl.int16), mask=live)
                    tl.store(sb + rank + k, small.to(tl.uint8, bitcast=True), mask=live)
                    escaped += esc.to(tl.int32)
                    rem = rem & (rem - 1)
            # skips (< 2**16 in a block) and escapes in one sum; the first and last change
            # from the list's ends
            packed = tl.sum(skip + (escaped << 16))
            skips = packed & 0xFFFF
            escapes = packed >> 16
        else:  # over CAP: cut_write reads new and old again; escapes and skips per element
            # (names apart from the other branch's: Triton types a name once per if)
            xa = tl.load(pa + loc, mask=inside, other=0)
            xb = tl.load(pb + loc, mask=inside, other=0)
            steps = xa.to(STEP) - xb.to(STEP)
            escapes = tl.sum(tl.sum(((xa != xb) & ((steps < -127) | (steps > 127))).to(tl.int32),
                                    axis=1))
            has, wlo, _, prev = _words_before(word, BLOCK)
            skips = tl.sum(tl.where(has & (prev >= 0), (wlo - prev - 1) // 255, 0))
        tl.store(stats + block, count.to(tl.int64))
        tl.store(stats + blocks + block, escapes.to(tl.int64))
        tl.store(stats + 2 * blocks + block, skips.to(tl.int64))
        tl.store(firsts + block, first + low)
        tl.store(lasts + block, tl.where(top >= 0, first + top, -1))

    @triton.jit
    def cut_spots(table, ids, spots, blocks, BLOCK: tl.constexpr, N: tl.constexpr):
        # for cut_mark, per block of a batch of several regions (N a program): where its
        # new and old start (offsets from the anchor), the elements left in its region
        # from its first, and that first (region-local)
        i = tl.program_id(0).to(tl.int64) * N + tl.arange(0, N)
        live = i < blocks
        row = table + tl.load(ids + i, mask=live, other=0) * 11
        first = (i - tl.load(row + 3, mask=live, other=0)) * BLOCK
        spot = spots + i * 4
        tl.store(spot, tl.load(row, mask=live, other=0) + first, mask=live)
        tl.store(spot + 1, tl.load(row + 1, mask=live, other=0) + first, mask=live)
        tl.store(spot + 2, tl.load(row + 2, mask=live, other=0) - first, mask=live)
        tl.store(spot + 3, first, mask=live)

    @triton.jit
    def cut_tiles(table, ids, stats, firsts, lasts, before, tiles, blocks, ntiles,
                  TILE: tl.constexpr, CAP: tl.constexpr):
        # per tile of TILE blocks of a region: each block's last change before it inside
        # the tile (-1: none), its gap bytes but for the skips from the tiles before, and
        # the tile's sums, first and last change
        t = tl.program_id(0).to(tl.int64)
        i, live = _tile_blocks(table, ids, blocks, t, TILE)
        count = tl.load(stats + i, mask=live, other=0)
        first = tl.load(firsts + i, mask=live, other=0)
        last = tl.load(lasts + i, mask=live, other=-1)
        _, prev = tl.associative_scan((last, tl.full((TILE,), -1, tl.int64)), 0, _max_before)
        gaps = count + tl.load(stats + 2 * blocks + i, mask=live, other=0) + tl.where(
            (count > 0) & (prev >= 0), (first - prev - 1) // 255, 0)
        tl.store(stats + 2 * blocks + i, gaps, mask=live)
        tl.store(before + i, prev, mask=live)
        tl.store(tiles + t, tl.sum(count))
        tl.store(tiles + ntiles + t, tl.sum(tl.load(stats + blocks + i, mask=live, other=0)))
        tl.store(tiles + 2 * ntiles + t, tl.sum(gaps))
        tl.store(tiles + 3 * ntiles + t, tl.min(tl.where(count > 0, first, 1 << 62)))
        tl.store(tiles + 4 * ntiles + t, tl.max(last))
        tl.store(tiles + 5 * ntiles + t, tl.sum((count > CAP).to(tl.int64)))

    @triton.jit
    def cut_offsets(table, ids, stats, before, tiles, starts, totals, blocks, ntiles,
                    TILE: tl.constexpr, MAXT: tl.constexpr, ITEM: tl.constexpr,
                    IDX: tl.constexpr):
        # each block's offsets in its region's payload (exclusive: values, escapes, gap
        # bytes) and the last change before it; a region's tiles' figures are few, each
        # of its programs scans them all. Its first writes its totals and the encoding
        # ``pick_encoding`` would choose from them
        t = tl.program_id(0).to(tl.int64)
        row = table + tl.load(ids + blocks + t) * 11
        t0 = tl.load(row + 5)
        j = tl.arange(0, MAXT)
        there = j < tl.load(row + 6)
        tc = tl.load(tiles + t0 + j, mask=there, other=0)
        te = tl.load(tiles + ntiles + t0 + j, mask=there, other=0)
        tlast = tl.load(tiles + 4 * ntiles + t0 + j, mask=there, other=-1)
        _, tprev = tl.associative_scan((tlast, tl.full((MAXT,), -1, tl.int64)), 0, _max_before)
        tskip = tl.where(tc > 0, (tl.load(tiles + 3 * ntiles + t0 + j, mask=there, other=0)
                                  - tprev - 1) // 255, 0)
        tg = tl.load(tiles + 2 * ntiles + t0 + j, mask=there, other=0) + tskip
        if t == t0:
            out = totals + tl.load(row + 10) * 6
            tl.store(out, tl.sum(tc))
            tl.store(out + 1, tl.sum(te))
            tl.store(out + 2, tl.sum(tg))
            tl.store(out + 3, tl.sum(tl.load(tiles + 5 * ntiles + t0 + j, mask=there, other=0)))
            enc, size = _choose(tl.load(row + 2), tl.sum(tc), tl.sum(te), tl.sum(tg), ITEM, IDX)
            tl.store(out + 4, enc)
            tl.store(out + 5, size)
        earlier = j < t - t0
        mine = j == t - t0
        i, live = _tile_blocks(table, ids, blocks, t, TILE)
        count = tl.load(stats + i, mask=live, other=0)
        esc = tl.load(stats + blocks + i, mask=live, other=0)
        gaps = tl.load(stats + 2 * blocks + i, mask=live, other=0)
        prev = tl.load(before + i, mask=live, other=0)
        gaps += tl.where((count > 0) & (prev < 0), tl.sum(tl.where(mine, tskip, 0)), 0)
        prev = tl.where(prev < 0, tl.sum(tl.where(mine, tprev, 0)), prev)
        tl.store(before + i, prev, mask=live)
        tl.store(starts + i, tl.sum(tl.where(earlier, tc, 0)) + tl.cumsum(count, 0) - count,
                 mask=live)
        tl.store(starts + blocks + i, tl.sum(tl.where(earlier, te, 0)) + tl.cumsum(esc, 0) - esc,
                 mask=live)
        tl.store(starts + 2 * blocks + i, tl.sum(tl.where(earlier, tg, 0)) + tl.cumsum(gaps, 0)
                 - gaps, mask=live)

    @triton.jit
    def cut_write(a, b, mask, stats, starts, before, blocks, block0, index, values, escapes,
                  INDEX: tl.constexpr, DIFF8: tl.constexpr, ALIGNED: tl.constexpr,
                  ESC_ALIGNED: tl.constexpr, STEP: tl.constexpr, ITEM: tl.constexpr,
                  BLOCK: tl.constexpr, CAP: tl.constexpr):
        # the blocks over CAP changes (slot_write writes the others). INDEX: 0 none (a
        # bitmask, copied apart), 1 positions, 2 gaps. A lane is a word of the bitmask (16
        # elements); step k handles the k-th change of every word. One region's blocks
        # (from ``block0`` of its batch's, ``_Batch``).
        block = tl.program_id(0).to(tl.int64) + block0
        count = tl.load(stats + block)
        if count > CAP:
            first = (block - block0) * BLOCK
            w = tl.arange(0, BLOCK // 16)
            word = tl.load(mask + block * (BLOCK // 16) + w).to(tl.int32) & 0xFFFF
            pop = _popcount(word)
            most = tl.max(pop)
            prevk = w
            skipped = w
            gstart = block
            byte0 = block
            if INDEX == 2:
                has, lo, last, prevk = _words_before(word, BLOCK)
                # one scan for the ranks and the skips (each < 2**16 in a block)
                skip = tl.where(has & (prevk >= 0), (lo - prevk - 1) // 255, 0)
                both = tl.cumsum(pop + (skip << 16), 0)
                rank = tl.load(starts + block) + ((both & 0xFFFF) - pop)
                skipped = both >> 16
                gap0 = first + tl.min(tl.where(has, lo, BLOCK)) - tl.load(before + block)
                skip0 = (gap0 - 1) // 255
                byte0 = gap0 - 255 * skip0
                gstart = tl.load(starts + 2 * blocks + block) + skip0 - tl.load(starts + block)
            else:
                rank = tl.load(starts + block) + (tl.cumsum(pop, 0) - pop)  # int64
            flags = tl.zeros((BLOCK // 16,), tl.int32)  # DIFF8: which changes of a word escaped
            rem = word
            for k in tl.static_range(16):
                if k < most:
                    live = rem != 0
                    loc = w * 16 + _bit_index(rem & -rem)
                    at = first + loc
                    va = tl.load(a + at, mask=live, other=0)
                    o = rank + k
                    if INDEX == 1:
                        tl.store(index + o, at.to(index.dtype.element_ty), mask=live)
                    if INDEX == 2:
                        gap = loc - prevk
                        if k == 0:
                            gap = tl.where(prevk >= 0, gap - 255 * ((gap - 1) // 255), byte0)
                        tl.store(index + gstart + o + skipped, gap.to(tl.uint8), mask=live)
                        prevk = tl.where(live, loc, prevk)
                    if DIFF8:
                        vb = tl.load(b + at, mask=live, other=0)
                        step = va.to(STEP) - vb.to(STEP)
                        esc = live & ((step < -127) | (step > 127))
                        small = tl.where(esc, -128, step).to(tl.int8)
                        tl.store(values + o, small.to(tl.uint8, bitcast=True), mask=live)
                        flags = flags | (esc.to(tl.int32) << k)
                    else:
                        _put(values, 0, o, va, live, ALIGNED, ITEM)
                    rem = rem & (rem - 1)
            if DIFF8:
                if tl.load(stats + blocks + block) > 0:  # whole values of the escapes, in order
                    epop = _popcount(flags)
                    erank = tl.load(starts + blocks + block) + (tl.cumsum(epop, 0) - epop)
                    rem = word
                    for k in tl.static_range(16):
                        if k < most:
                            loc = w * 16 + _bit_index(rem & -rem)
                            hit = (rem != 0) & (((flags >> k) & 1) != 0)
                            va = tl.load(a + first + loc, mask=hit, other=0)
                            er = erank + _popcount(flags & ((1 << k) - 1))
                            _put(escapes, 0, er, va, hit, ESC_ALIGNED, ITEM)
                            rem = rem & (rem - 1)

    @triton.jit
    def slot_write(anchor, table, ids, stats, starts, before, blocks, ntiles, program0, slot_pos,
                   slot_byte, index, values, escapes, totals, INDEX: tl.constexpr,
                   DIFF8: tl.constexpr, ALIGNED: tl.constexpr, ESC_ALIGNED: tl.constexpr,
                   ITEM: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                   GROUP: tl.constexpr, SUB: tl.constexpr, SPEC: tl.constexpr,
                   ENC: tl.constexpr, IDX: tl.constexpr, ZB: tl.constexpr, AL: tl.constexpr):
        # GROUP blocks of at most CAP changes a program: the payload from their slots
        # (gaps from consecutive positions, ranks by cumsums), SUB slot entries of each
        # block a step, as many steps as the most changes among them (not CAP: lanes
        # cost, masked or not); new is read only for whole values (escapes, or no DIFF8).
        # SPEC: every region of the batch, launched before the host knows the totals;
        # writes a region's payload only where the device's choice (its ``totals`` row,
        # cut_offsets) is this encoding, no block overflowed and the payload fits its
        # room, at its offset in the batch's buffer (``index``, ``values`` and
        # ``escapes``); the sections' offsets come from the totals (``values`` and
        # ``escapes`` are then the payload's first byte, written bytewise). Else one
        # region's programs from ``program0``, into its payload's sections.
        p = tl.program_id(0).to(tl.int64) + program0
        row = table + tl.load(ids + blocks + ntiles + p) * 11
        a = _region(anchor, row, 0, AL)
        b0 = tl.load(row + 3)
        end = b0 + tl.load(row + 4)
        g0 = b0 + (p - tl.load(row + 7)) * GROUP
        g = g0 + tl.arange(0, GROUP)
        there = g < end
        if SPEC:
            totals += tl.load(row + 10) * 6
            go = ((tl.load(totals + 4) == ENC) & (tl.load(totals + 3) == 0)
                  & (tl.load(totals + 5) <= tl.load(row + 9)))
            there = there & go
            put_at = tl.load(row + 8)
            values += put_at
            if INDEX == 1:
                index += put_at // IDX
            else:
                index += put_at
            total = tl.load(totals)
            nindex = total * IDX
            if INDEX == 2:
                nindex = tl.load(totals + 2)
            values += nindex
            escapes = values + total
            if INDEX == 2:
                # the group's share of the gap section, [its first block's offset, the next
                # group's), zeroed first: its skip bytes are 0s, its value bytes come below
                lo = tl.load(starts + 2 * blocks + g0)
                hi = tl.load(starts + 2 * blocks + tl.minimum(g0 + GROUP, end - 1))
                hi = tl.where(go, tl.where(g0 + GROUP < end, hi, tl.load(totals + 2)), lo)
                z = lo
                while z < hi:
                    zj = z + tl.arange(0, ZB)
                    tl.store(index + zj, tl.zeros((ZB,), tl.uint8), mask=zj < hi)
                    z += ZB
                tl.debug_barrier()  # the zeros before any value byte of the group
        count = tl.load(stats + g, mask=there, other=0).to(tl.int32)
        count = tl.where(there & (count <= CAP), count, 0)  # over CAP: cut_write's
        rank0 = tl.load(starts + g, mask=there, other=0)
        esc0 = tl.load(starts + blocks + g, mask=there, other=0)
        if INDEX == 2:
            # the first change's gap (from the change before the block, maybe blocks away)
            first = tl.load(slot_pos + g * CAP, mask=count > 0, other=0).to(tl.int32) & 0xFFFF
            gap0 = (g - b0) * BLOCK + first - tl.load(before + g, mask=there, other=0)
            skip0 = (gap0 - 1) // 255
            byte0 = (gap0 - 255 * skip0).to(tl.int32)
            spot0 = tl.load(starts + 2 * blocks + g, mask=there, other=0) + skip0
        most = tl.max(count, axis=0)
        c = most * 0
        while c < most:  # (a while: the interpreter takes no tensor as a range's bound)
            r = c + tl.arange(0, SUB)[None, :]
            live = r < count[:, None]
            o = g[:, None] * CAP + r
            pos = tl.load(slot_pos + o, mask=live, other=0).to(tl.int32) & 0xFFFF
            rank = rank0[:, None] + r
            if INDEX == 1:
                tl.store(index + rank, ((g[:, None] - b0) * BLOCK + pos).to(
                    index.dtype.element_ty), mask=live)
            if INDEX == 2:  # in-block gaps in int32
                prior = tl.load(slot_pos + o - 1, mask=live & (r > 0), other=0).to(
                    tl.int32) & 0xFFFF
                gap = pos - prior
                skip = tl.where(live & (r > 0), (gap - 1) // 255, 0)
                byte = tl.where(r > 0, gap - 255 * skip, byte0[:, None])
                tl.store(index + spot0[:, None] + r + tl.cumsum(skip, 1), byte.to(tl.uint8),
                         mask=live)
                spot0 += tl.sum(skip, 1)
            if DIFF8:
                small = tl.load(slot_byte + o, mask=live, other=0)
                tl.store(values + rank, small, mask=live)
                esc = live & (small == 128)
                e = esc.to(tl.int32)
                if tl.sum(tl.sum(e, axis=1), axis=0) > 0:  # escapes' whole values
                    er = esc0[:, None] + tl.cumsum(e, 1) - e
                    at = (g[:, None] - b0) * BLOCK + pos
                    _put(escapes, 0, er, tl.load(a + at, mask=esc, other=0), esc, ESC_ALIGNED,
                         ITEM)
                esc0 += tl.sum(e, 1)
            else:
                at = (g[:, None] - b0) * BLOCK + pos
                _put(values, 0, rank, tl.load(a + at, mask=live, other=0), live, ALIGNED, ITEM)
            c += SUB

    @triton.jit
    def gap_sums(table, deltas, sums, figures, chunks, CHUNK: tl.constexpr):
        # per chunk of a delta's payload bytes (chunks numbered across the batch): non-zero
        # bytes (values), the distance they advance (a 0 byte: 255), 0x80 bytes (escapes,
        # where they are differences); a delta's first chunk zeroes its ``figures`` row
        # for gap_locate
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pa, nbytes, _, _, _, _, _, _, first = _delta_row(table, d)
        if j == first:
            tl.store(figures + d * 6 + tl.arange(0, 8), tl.zeros((8,), tl.int64),
                     mask=tl.arange(0, 8) < 6)
        i = (j - first) * CHUNK + tl.arange(0, CHUNK)
        live = i < nbytes
        y = tl.load(pa.to(tl.pointer_type(tl.uint8)) + i, mask=live, other=0).to(tl.int32)
        tl.store(sums + j, tl.sum(((y != 0) & live).to(tl.int32)).to(tl.int64))
        tl.store(sums + chunks + j, tl.sum(tl.where(live, tl.where(y == 0, 255, y), 0)).to(tl.int64))
        tl.store(sums + 2 * chunks + j, tl.sum((y == 128).to(tl.int32)).to(tl.int64))

    @triton.jit
    def gap_locate(table, deltas, ends, figures, chunks, CHUNK: tl.constexpr):
        # a delta's figures (zeroed before): [found, the byte of the count-th value, its
        # position, the escapes among the count bytes after it, the values named before
        # ``vend``, 0x80 bytes before the differences]; the chunk holding the count-th
        # value writes them
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pa, nbytes, count, _, _, _, _, vend, first = _delta_row(table, d)
        p = pa.to(tl.pointer_type(tl.uint8))
        out = figures + d * 6
        if j == first:
            tl.store(out + 4, _count_before(p, ends, chunks, first, tl.maximum(vend, 0), CHUNK,
                                            False))
        seen0 = _row_before(ends, 0, chunks, first, j)
        if (seen0 < count) & (_row_before(ends, 0, chunks, first, j + 1) >= count):
            i = (j - first) * CHUNK + tl.arange(0, CHUNK)
            live = i < nbytes
            y = tl.load(p + i, mask=live, other=0).to(tl.int32)
            nz = (y != 0) & live
            hit = nz & (seen0 + tl.cumsum(nz.to(tl.int64), 0) == count)
            q = tl.sum(tl.where(hit, i, 0))
            walked = _row_before(ends, 1, chunks, first, j)
            last = walked + tl.sum(tl.where(live & (i <= q), tl.where(y == 0, 255, y), 0)) - 1
            g = q + 1
            e0 = _count_before(p, ends, chunks, first, g, CHUNK, True)
            e1 = _count_before(p, ends, chunks, first, tl.minimum(g + count, nbytes), CHUNK,
                               True)
            tl.store(out, (tl.sum(hit.to(tl.int32)) == 1).to(tl.int64))
            tl.store(out + 1, q)
            tl.store(out + 2, last)
            tl.store(out + 3, e1 - e0)
            tl.store(out + 5, e0)

    @triton.jit
    def pos_sums(table, deltas, sums, chunks, DIFF8: tl.constexpr, IT: tl.constexpr,
                 IDX: tl.constexpr, CHUNK: tl.constexpr):
        # per chunk of a delta's positions (chunks numbered across the batch): those
        # outside its box, and (DIFF8) the escapes
        j = tl.program_id(0).to(tl.int64)
        pi, pv, count, numel, _, _, _, _, first = _delta_row(table, _delta_of(table, deltas, j))
        i = (j - first) * CHUNK + tl.arange(0, CHUNK)
        live = i < count
        pos = _get_at(pi, i, live, tl.zeros((CHUNK,), tl.int64), IT, IDX)
        tl.store(sums + j, tl.sum((live & ((pos < 0) | (pos >= numel))).to(tl.int32)).to(tl.int64))
        esc = tl.zeros((CHUNK,), tl.int32)
        if DIFF8:
            y = tl.load(pv.to(tl.pointer_type(tl.uint8)) + i, mask=live, other=0)
            esc = (y.to(tl.int32) == 128).to(tl.int32)
        tl.store(sums + chunks + j, tl.sum(esc).to(tl.int64))

    @triton.jit
    def apply_gaps(table, deltas, ends, figures, chunks, TY: tl.constexpr, DIFF8: tl.constexpr,
                   STEP: tl.constexpr, ITEM: tl.constexpr, CHUNK: tl.constexpr):
        # one chunk of a delta's gap bytes: its positions, the values' ranks, the escapes'
        # ranks, then in place. Its delta's figures (gap_locate's) are checked here, by
        # every program, as the host checks them after: a delta that does not fit writes
        # nothing. DIFF8: the differences follow the gaps (at ``scan``), the escapes' whole
        # values them (bytes: no alignment known); else whole values from ``vend``
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pa, nbytes, count, numel, ta, cols, stride, vend, first = _delta_row(table, d)
        p = pa.to(tl.pointer_type(tl.uint8))
        found = figures + d * 6
        scan = tl.load(found + 1) + 1
        good = (tl.load(found) != 0) & (tl.load(found + 2) < numel)
        if DIFF8:
            good = good & (scan + count <= nbytes) & (
                nbytes - scan - count == tl.load(found + 3) * ITEM)
        else:
            good = good & (vend >= 0) & (tl.load(found + 4) == count)
        c = j - first
        if good & (c * CHUNK < scan):
            i = c * CHUNK + tl.arange(0, CHUNK)
            live = i < scan
            y = tl.load(p + i, mask=live, other=0).to(tl.int32)
            keep = (y != 0) & live
            r0 = _row_before(ends, 0, chunks, first, j)
            walked = _row_before(ends, 1, chunks, first, j)
            at = walked + tl.cumsum(tl.where(live, tl.where(y == 0, 255, y), 0), 0) - 1
            r = r0 + tl.cumsum(keep.to(tl.int32), 0) - 1
            like = tl.zeros((CHUNK,), TY)
            small = keep  # DIFF8 sets both, below
            esc = keep
            if DIFF8:
                small = tl.load(p + scan + r, mask=keep, other=0).to(tl.int8, bitcast=True)
                esc = keep & (small == -128)
                # escapes among the differences before this chunk's first
                e0 = (_count_before(p, ends, chunks, first, scan + r0, CHUNK, True)
                      - tl.load(found + 5))
                er = e0 + tl.cumsum(esc.to(tl.int32), 0) - 1
                v = _get(p + scan + count, 0, er, esc, like, False, ITEM)
            else:
                v = _get_at(pa + vend, r, keep, like, TY, ITEM)
            target = ta.to(tl.pointer_type(TY))
            if numel <= cols:  # one row (no division per element)
                _write_at(target, at, keep, v, small, esc, cols, stride, True, DIFF8, STEP)
            else:
                _write_at(target, at, keep, v, small, esc, cols, stride, False, DIFF8, STEP)

    @triton.jit
    def apply_index(table, deltas, ends, figures, chunks, TY: tl.constexpr, IT: tl.constexpr,
                    DIFF8: tl.constexpr, STEP: tl.constexpr, ITEM: tl.constexpr,
                    IDX: tl.constexpr, CHUNK: tl.constexpr):
        # one chunk of a delta's positions: the escapes' ranks, then in place. pos_sums'
        # sums over the delta's chunks (positions outside the box, escapes) are checked
        # here, by every program, as the host checks them after (its first chunk writes
        # them in the delta's ``figures`` row): a delta that does not fit its box or its
        # ``whole`` bytes of escaped values writes nothing
        j = tl.program_id(0).to(tl.int64)
        d = _delta_of(table, deltas, j)
        pi, pv, count, numel, ta, cols, stride, whole, first = _delta_row(table, d)
        last = first + tl.maximum((count + CHUNK - 1) // CHUNK, 1)
        bad = _row_before(ends, 0, chunks, first, last)
        escapes = _row_before(ends, 1, chunks, first, last)
        if j == first:
            tl.store(figures + d * 2, bad)
            tl.store(figures + d * 2 + 1, escapes)
        good = bad == 0
        if DIFF8:
            good = good & (whole == escapes * ITEM)
        i = (j - first) * CHUNK + tl.arange(0, CHUNK)
        keep = (i < count) & good
        at = _get_at(pi, i, keep, tl.zeros((CHUNK,), tl.int64), IT, IDX)
        like = tl.zeros((CHUNK,), TY)
        small = keep  # DIFF8 sets both, below
        esc = keep
        if DIFF8:
            small = tl.load(pv.to(tl.pointer_type(tl.int8)) + i, mask=keep, other=0)
            esc = keep & (small == -128)
            er = _row_before(ends, 1, chunks, first, j) + tl.cumsum(esc.to(tl.int32), 0) - 1
            v = _get_at(pv + count, er, esc, like, TY, ITEM)
        else:
            v = _get_at(pv, i, keep, like, TY, ITEM)
        target = ta.to(tl.pointer_type(TY))
        if numel <= cols:  # one row (no division per element)
            _write_at(target, at, keep, v, small, esc, cols, stride, True, DIFF8, STEP)
        else:
            _write_at(target, at, keep, v, small, esc, cols, stride, False, DIFF8, STEP)

    @triton.jit
    def compact(mask, n, limit, starts, pos, BLOCK: tl.constexpr):
        # the positions of a bitmask's set bits, each block's at its offset
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        bits, loc = _bits(mask, block, n - first, limit, BLOCK)
        o = _ranks(bits)
        tl.store(pos + tl.load(starts + block) + o, first + loc, mask=bits != 0)

    @triton.jit
    def count_bits(payload, n, counts, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        # the payload's bitmask is (n + 7) // 8 bytes: read no further
        bits, loc = _bits(payload, block, n - block * BLOCK, (n + 7) // 8, BLOCK)
        tl.store(counts + block, tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.int64))

    @triton.jit
    def apply_bitmask(target, payload, starts, values, n, cols, stride, CONTIG: tl.constexpr,
                      ROW8: tl.constexpr, ALIGNED: tl.constexpr, ITEM: tl.constexpr,
                      BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        first = block * BLOCK
        bits, loc = _bits(payload, block, n - first, (n + 7) // 8, BLOCK)
        keep = bits != 0
        o = _ranks(bits)
        like = tl.zeros((BLOCK // 8, 8), dtype=target.dtype.element_ty)
        v = _get(values, tl.load(starts + block), o, keep, like, ALIGNED, ITEM)
        if CONTIG:
            tl.store(target + first + loc, v, mask=keep)
        elif ROW8:  # cols % 8 == 0: the 8 elements of a tile row share a row of the view
            g = first + tl.arange(0, BLOCK // 8) * 8
            at = (g // cols) * stride + g % cols
            tl.store(target + at[:, None] + tl.arange(0, 8)[None, :], v, mask=keep)
        else:
            i = first + loc
            tl.store(target + (i // cols) * stride + i % cols, v, mask=keep)

    return _Kernels(cut_spots, cut_mark, cut_tiles, cut_offsets, cut_write, slot_write, gap_sums,
                    gap_locate, pos_sums, apply_gaps, apply_index, compact, count_bits,
                    apply_bitmask)


_kernels = built_once(_build)


__all__ = ["BLOCK", "CHUNK", "Cut", "Pending", "Rows", "apply_bitmask", "apply_sparse",
           "bitmask_counts", "bitmask_positions", "cut_many", "enabled", "launch_gaps_many",
           "launch_sparse", "rows_form", "usable"]
