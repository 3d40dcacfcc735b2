"""The apply of a GAPS, POSITIONS or BITMASK delta in place on CUDA tensors, the host
side (``delta.kernels``: which tensors take the kernels, and the cut; the kernels' code:
``triton_apply``).

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

from typing import NamedTuple, Optional

import torch

from megatron_reshard.delta import kernels
from megatron_reshard.delta.kernels import _upload, _step_type, _tl_type, _bad_delta, _INTS

CHUNK = 2048  # index entries (GAPS: payload bytes) per program of the apply
APPLY_WARPS = 4


class Pending(NamedTuple):
    """A sparse apply launched and not yet checked: ``check`` takes the host's read of
    ``figures`` (a small int64 tensor on the device) and raises for a delta that did not
    fit (the kernels wrote nothing of it). ``delta.encoding.apply_many`` reads the figures
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
    if kernels.rows_form(view) is None:
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
        form = kernels.rows_form(view)

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
        k, n = kernels._kernels(), figures.shape[0]
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
        k, deltas = kernels._kernels(), figures.shape[0]
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
        form, nbytes, item = kernels.rows_form(view), payload.numel(), view.element_size()
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
    blocks = max(1, -(-numel // kernels.BLOCK))
    counts = torch.empty(blocks, dtype=torch.int64, device=index.device)
    kernels._kernels().count_bits[(blocks,)](index, numel, counts, BLOCK=kernels.BLOCK,
                                             num_warps=kernels.WARPS)
    return counts


def bitmask_positions(index: torch.Tensor, numel: int, counts: torch.Tensor,
                      count: int) -> torch.Tensor:
    """The int64 positions of a bitmask's set bits (``count``: their checked total)."""
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty(count, dtype=torch.int64, device=index.device)
    kernels._kernels().compact[(counts.numel(),)](index, numel, index.numel(), starts, pos,
                                          BLOCK=kernels.BLOCK, num_warps=kernels.WARPS)
    return pos


def apply_bitmask(view: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                  counts: torch.Tensor) -> bool:
    """Write whole values (bytes) at a bitmask's set bits into ``view`` in place; False
    when the view does not fold into rows (the caller takes the torch path)."""
    form = kernels.rows_form(view)
    if form is None:
        return False
    item = view.element_size()
    target = view.view(_INTS[item])
    aligned = values.storage_offset() % item == 0
    vals = values.view(target.dtype) if aligned else values
    kernels._kernels().apply_bitmask[(counts.numel(),)](
        target, index, torch.cumsum(counts, 0) - counts, vals, view.numel(), form.cols,
        form.stride, CONTIG=form.rows == 1, ROW8=form.cols % 8 == 0, ALIGNED=aligned,
        ITEM=item, BLOCK=kernels.BLOCK, num_warps=kernels.WARPS)
    return True


__all__ = ["CHUNK", "Pending", "apply_bitmask", "apply_sparse", "bitmask_counts",
           "bitmask_positions", "launch_gaps_many", "launch_positions_many", "launch_sparse",
           "positions_whole"]
