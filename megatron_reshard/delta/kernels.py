"""The region-wide scans of delta refits on CUDA tensors, as Triton kernels (issue 35): which
tensors take them, the kernels built once, and the cut (``kernel_apply``: the apply; the
kernels' code: ``triton_cut``, ``triton_apply``).

Torch + stdlib only: Triton, which the CUDA builds of torch ship, loads lazily, and
``delta.encoding`` keeps its torch path where it is absent (CPU tensors, CPU builds)
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
choose the encoding from the totals as ``delta.encoding.pick_encoding`` does.
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
"""


from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from megatron_reshard.delta import triton_apply, triton_cut
from megatron_reshard.delta.wire_format import DeltaTransportError
from megatron_reshard.engine.triton_build import built_once


BLOCK = 4096  # elements per program of the cut: a power of two, 32 to 32768 (16-bit slots)
WARPS = 4
_TILE = 1024  # blocks per program of the passes over per-block figures (cut_tiles)
SLOT_ENTRIES = 1024  # slot entries per step of a slot_write program
SLOT_SUB = 32  # of each block's slot a step
SLOT_WARPS = 8  # (2048 entries on 4 warps spilled registers: twice the time on an H200)
_ROOM = 16  # a speculative payload takes up to 1/_ROOM of the region's bytes (Cut.room)
_ZB = 4096  # bytes a step of slot_write's zeroing of a speculative gap section
# the encodings a cut writes before the host reads its totals (Cut.speculated): those the
# slots give, with DIFF8 but for 1-byte elements (``delta.wire_format``'s codes: GAPS 4,
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
    as ``encoding.pick_encoding`` does) and ``speculated``: ``(encoding, payload)``
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
    lives until the read: callers bound the regions' bytes (``encoding.encode_many``)."""
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


# -- the kernels (their code: triton_cut, triton_apply) -----------------------------------

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
    return _Kernels(**triton_cut.build(triton, tl), **triton_apply.build(triton, tl))


_kernels = built_once(_build)


__all__ = ["BLOCK", "Cut", "Rows", "cut", "cut_many", "enabled", "rows_form", "usable"]
