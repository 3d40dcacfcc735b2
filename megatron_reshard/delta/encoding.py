"""A delta region's bytes: the sender's cut (``encode``, ``encode_many``) and the
receiver's apply in place (``apply``, ``apply_many``); the kernels on CUDA
(``delta.kernels``, ``delta.kernel_apply``), torch elsewhere, the same bytes.

Torch + stdlib only (the receiver imports it).

Encodings (the low 3 bits; the sender picks the smallest, exact sizes, no round trip):

- ``POSITIONS``: int32 (int64 past 2**31 elements) flat positions in the box, row-major;
- ``GAPS``: one byte per changed element, its distance from the previous one (the first
  from -1); a 0 byte advances 255 without a value (long gaps). ~1 byte a position at the
  measured 1-2% change rates, where positions take 4;
- ``BITMASK``: one bit per element of the box (little-endian within a byte);
- ``DENSE``: the whole box;
- ``NONE``: nothing changed (header only).

then the values. Flag ``DIFF8`` (bit 3; never for 1-byte elements such as FP8 bytes,
where a difference costs as much as the value): the values are int8 differences of the
elements' bits taken as integers (new - old); a difference outside -127..127 is sent as
-128 and its element's whole value follows after all the differences, in order. An
optimizer step at RL learning rates moves a BF16 weight by one unit in the last place
(88% of the changed elements in ``scripts/measure_change_rate.py``, 99.8% within 127), so
a value costs about 1 byte instead of 2. The receiver adds them to the bits it holds,
which are the base (the version vote proved it; a wrong base gives wrong bits that the
checksums catch, as with any delta).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_reshard.delta import kernel_apply, kernels
from megatron_reshard.delta.wire_format import (BITMASK, DENSE, DIFF8, GAP_SKIP, GAPS, KINDS, NONE,
                                                POSITIONS, DeltaTransportError, encoding_name)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _ones(mask: torch.Tensor) -> int:
    """True elements of a bool tensor (``count_nonzero``: a bool ``sum`` widens to int64)."""
    return int(torch.count_nonzero(mask))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (contiguous copy when needed)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def index_bytes(numel: int) -> int:
    return 4 if numel < (1 << 31) else 8


def _idx_dtype(numel: int) -> torch.dtype:
    return torch.int32 if index_bytes(numel) == 4 else torch.int64


def _candidates(numel: int, count: int, itemsize: int, skips: int,
                escapes: Optional[int]):
    """``(encoding, payload bytes)`` of each encoding of a change, simplest to apply first
    (dense, bitmask, positions, gaps; whole values before DIFF8): the order that breaks a
    tie between equal sizes."""
    yield DENSE, numel * itemsize
    for kind, index in ((BITMASK, (numel + 7) // 8), (POSITIONS, count * index_bytes(numel)),
                        (GAPS, count + skips)):
        yield kind, index + count * itemsize
        if escapes is not None:
            yield kind | DIFF8, index + count + escapes * itemsize


def encoding_sizes(numel: int, count: int, itemsize: int, skips: int = 0,
                   escapes: Optional[int] = None) -> dict[int, int]:
    """Payload bytes of each encoding of ``count`` changed elements of ``numel`` (``skips``:
    the GAPS skip bytes; ``escapes``: how many differences do not fit DIFF8's byte, None:
    no DIFF8 variants)."""
    if count == 0:
        return {NONE: 0}
    return dict(_candidates(numel, count, itemsize, skips, escapes))


def pick_encoding(numel: int, count: int, itemsize: int, skips: int = 0,
                  escapes: Optional[int] = None) -> int:
    """The cheapest encoding (ties: the simplest to apply, as ``_candidates`` lists them),
    as the kernels' ``_choose`` picks it: a first minimum, no search of a dict with a key
    function (it runs once a region on the host's path)."""
    if count == 0:
        return NONE
    best, enc = None, NONE
    for kind, nbytes in _candidates(numel, count, itemsize, skips, escapes):
        if best is None or nbytes < best:
            best, enc = nbytes, kind
    return enc


def _gaps(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distances of sorted positions (the first from -1), and the skip bytes each needs."""
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1))
    return gaps, (gaps - 1) // GAP_SKIP


def _gap_bytes(gaps: torch.Tensor, skips: torch.Tensor, nskip: int) -> torch.Tensor:
    """GAPS bytes: per position, its skip bytes (0) then its remaining distance."""
    out = torch.zeros(gaps.numel() + nskip, dtype=torch.uint8, device=gaps.device)
    at = torch.cumsum(skips + 1, 0) - 1  # where each value's own gap byte lands
    out[at] = (gaps - GAP_SKIP * skips).to(torch.uint8)
    return out


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as bits, little-endian within a byte: each 8 bools (one byte each, 0 or
    1) read as one int64 and multiplied so that byte k's bit lands on bit 56 + k."""
    pad = (-mask.numel()) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    words = mask.view(torch.uint8).view(torch.int64)
    return ((words * 0x0102040810204080) >> 56).to(torch.uint8)


def _steps(picked: torch.Tensor, was: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DIFF8's differences of the changed elements' bits, and which do not fit its byte."""
    step = picked.to(torch.int64) - was.to(torch.int64)
    return step, (step < -127) | (step > 127)


def encode(new: torch.Tensor, old: torch.Tensor) -> tuple[int, int, Optional[torch.Tensor]]:
    """``(count, encoding, payload)`` of the elements of ``new`` whose bits differ from
    ``old`` (same shape and dtype); payload None when nothing changed."""
    nb, ob = _bits(new).reshape(-1), _bits(old).reshape(-1)
    numel, itemsize = nb.numel(), new.element_size()
    if kernels.usable(new):  # CUDA: the Triton kernels cut it (the same bytes)
        return _encode_on_gpu(nb, ob)
    changed = nb != ob
    count = _ones(changed)
    if count == 0:
        return 0, NONE, None
    if count * (itemsize + 1) >= numel * itemsize:  # nothing sparse beats dense here
        return count, DENSE, nb.view(torch.uint8)
    pos = changed.nonzero().reshape(-1)
    picked = nb[pos]
    gaps, skips = _gaps(pos)
    nskip = int(skips.sum())
    step = escaped = None
    if itemsize > 1:  # FP8 bytes: a difference costs the byte it replaces (no DIFF8)
        step, escaped = _steps(picked, ob[pos])
    enc = pick_encoding(numel, count, itemsize, nskip, None if escaped is None else _ones(escaped))
    kind = enc & 7
    if kind == DENSE:
        return count, DENSE, nb.view(torch.uint8)
    if enc & DIFF8:
        if escaped is None:  # chosen for FP8 bytes only where a test forces it
            step, escaped = _steps(picked, ob[pos])
        small = torch.where(escaped, -128, step).to(torch.int8).view(torch.uint8)
        values = torch.cat([small, picked[escaped].view(torch.uint8)])
    else:
        values = picked.view(torch.uint8)
    if kind == POSITIONS:
        index = pos.to(_idx_dtype(numel)).view(torch.uint8)
    elif kind == GAPS:
        index = _gap_bytes(gaps, skips, nskip)
    else:
        index = _pack_bits(changed)
    return count, enc, torch.cat([index, values])


def _encode_on_gpu(nb: torch.Tensor, ob: torch.Tensor) -> tuple[int, int, Optional[torch.Tensor]]:
    """``encode`` by the kernels: the totals read once, the same choice, the same bytes."""
    return _encoded(kernels.cut(nb, ob, index_bytes(nb.numel())), nb)


# regions cut between two host reads (``encode_many``): their scratch (~0.6 byte an
# element with the speculated payload's room) lives until the read
GROUP_BYTES = 1 << 30


def encode_many(pairs: list) -> list[tuple[int, int, Optional[torch.Tensor]]]:
    """``encode`` of each ``(new, old)`` pair. On CUDA the kernels cut up to
    ``GROUP_BYTES`` of regions between two host reads (``kernels.cut_many``): the
    host's launches for one region overlap the device's work on the ones before."""
    out: list = [None] * len(pairs)
    group: list = []  # (k, new bits, old bits)

    def flush() -> None:
        cuts = kernels.cut_many([(nb, ob) for _, nb, ob in group],
                                      [index_bytes(nb.numel()) for _, nb, _ in group])
        for (k, nb, _), cut in zip(group, cuts):
            out[k] = _encoded(cut, nb)
        group.clear()

    held = 0
    for k, (new, old) in enumerate(pairs):
        if not kernels.usable(new):
            out[k] = encode(new, old)
            continue
        group.append((k, _bits(new).reshape(-1), _bits(old).reshape(-1)))
        held += new.numel() * new.element_size()
        if held >= GROUP_BYTES:
            flush()
            held = 0
    if group:
        flush()
    return out


def _encoded(cut: "kernels.Cut", nb: torch.Tensor) -> tuple[int, int, Optional[torch.Tensor]]:
    """``(count, encoding, payload)`` of a cut whose totals the host has read."""
    numel, itemsize = nb.numel(), nb.element_size()
    count = cut.count
    if count == 0:
        return 0, NONE, None
    if count * (itemsize + 1) >= numel * itemsize:
        return count, DENSE, nb.view(torch.uint8)
    # FP8 bytes: a difference costs the byte it replaces (no DIFF8), as on the CPU path
    enc = pick_encoding(numel, count, itemsize, cut.skips, None if itemsize == 1 else cut.escapes)
    kind = enc & 7
    if kind == DENSE:
        return count, DENSE, nb.view(torch.uint8)
    if cut.speculated is not None and cut.speculated[0] == enc:
        return count, enc, cut.speculated[1]  # written before the totals were read
    index = {POSITIONS: "positions", GAPS: "gaps", BITMASK: "bitmask"}[kind]
    return count, enc, cut.payload(index, bool(enc & DIFF8), index_bytes(numel))


def payload_bytes(numel: int, count: int, enc: int, itemsize: int) -> int:
    """The least payload a header of this encoding can announce (GAPS skips and DIFF8
    escapes come on top)."""
    if enc == NONE:
        return 0
    sizes = encoding_sizes(numel, count, itemsize, 0, 0)
    if enc not in sizes:
        raise DeltaTransportError(f"unknown delta encoding {enc}")
    return sizes[enc]


def header_problem(numel: int, itemsize: int, count: int, enc: int, nbytes: int) -> str:
    """Why a region's header cannot be right for a box of ``numel`` elements ('' if it can)."""
    if enc & 7 not in KINDS or (enc & DIFF8 and enc & 7 in (NONE, DENSE)) or enc >= 16:
        return f"unknown encoding {enc}"
    if not (0 <= count <= numel) or (count == 0) != (enc == NONE):
        return f"count {count} for {numel} elements with encoding {encoding_name(enc)}"
    want = payload_bytes(numel, count, enc, itemsize)
    most = want + (numel if enc & 7 == GAPS else 0) + (count * itemsize if enc & DIFF8 else 0)
    if want <= nbytes <= most:
        return ""
    return f"{nbytes} payload bytes, expected {want}" + (f" .. {most}" if most > want else "")


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a payload as ``dtype``; copied when they do not start on an element
    boundary (values after an odd-sized bitmask)."""
    if raw.storage_offset() % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()
    return raw.view(dtype)


def _positions(kind: int, index: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """The changed positions (int64, or a bool mask for BITMASK) an index part names."""
    if kind == POSITIONS:
        pos = _typed(index, _idx_dtype(numel)).to(torch.int64)
        if count and (bool(pos.min() < 0) or bool(pos.max() >= numel)):
            raise DeltaTransportError(f"a positions delta names elements outside its "
                                      f"{numel}-element box")
        return pos
    if kind == GAPS:
        steps = torch.where(index == 0, GAP_SKIP, index.to(torch.int64))
        pos = (torch.cumsum(steps, 0) - 1)[index != 0]
        if pos.numel() != count or (count and int(pos[-1]) >= numel):
            raise DeltaTransportError(f"a gaps delta names {pos.numel()} elements (header: "
                                      f"{count}) reaching past its {numel}-element box")
        return pos
    bits = (index.unsqueeze(1) & _BIT_WEIGHTS.to(index.device)).ne(0).reshape(-1)
    if bool(bits[numel:].any()) or _ones(bits) != count:
        raise DeltaTransportError(f"a bitmask delta sets {_ones(bits[:numel])} bits "
                                  f"(past the box: {_ones(bits[numel:])}) but its header "
                                  f"says {count}")
    return bits[:numel]


def _index_bytes(kind: int, diff8: bool, payload: torch.Tensor, numel: int, count: int,
                 itemsize: int) -> int:
    """Where a payload's index part ends."""
    if kind == POSITIONS:
        return count * index_bytes(numel)
    if kind == BITMASK:
        return (numel + 7) // 8
    if not diff8:  # GAPS, whole values: they fill the rest
        return payload.numel() - count * itemsize
    # GAPS + DIFF8: the gaps end at their count-th non-zero byte (a value's own gap is >= 1)
    seen = torch.cumsum(payload.ne(0).to(torch.int64), 0)
    end = _ones(seen < count) + 1
    if end > payload.numel():
        raise DeltaTransportError(f"a gaps delta of {count} elements holds fewer gap bytes")
    return end


def apply_many(items: list, labels: Optional[list[str]] = None) -> None:
    """``apply`` of each ``(view, count, encoding, payload)``. On CUDA the sparse ones
    (GAPS, POSITIONS) are launched back to back, the GAPS deltas in three launches
    (``kernel_apply.launch_gaps_many``), the POSITIONS deltas in two
    (``kernel_apply.launch_positions_many``), and checked with one host read after the
    last: a bad delta is refused unwritten, as by ``apply``, the others of the list
    written (one wrong on its face is refused before the groups launch). ``labels``: each
    item's name for its error (param, ranks, box)."""
    gaps = []       # GAPS deltas: three launches for all (a program a chunk)
    positions = []  # POSITIONS deltas: two launches for all (a program a chunk)
    k = 0
    try:  # (not a context manager an item: its cost counts a region at a time)
        for k, (view, count, enc, payload) in enumerate(items):
            kind, diff8 = enc & 7, bool(enc & DIFF8)
            if kind in (GAPS, POSITIONS) and kernels.usable(view) and (
                    kernels.rows_form(view) is not None):
                if kind == POSITIONS:
                    size = index_bytes(view.numel())
                    # on its face (too few bytes, ...): refused here, under its label
                    kernel_apply.positions_whole(view, count, diff8,
                                                  payload.numel() - count * size)
                    positions.append((k, (view, count, diff8, payload, size)))
                else:
                    gaps.append((k, (view, count, diff8, payload)))
                continue
            apply(view, count, enc, payload)
    except DeltaTransportError as e:
        raise _labelled(labels, k, e) from None
    pending = []  # (item, launched apply)
    for group, launch in ((gaps, kernel_apply.launch_gaps_many),
                          (positions, kernel_apply.launch_positions_many)):
        if group:
            pending += list(zip([k for k, _ in group], launch([item for _, item in group])))
    if not pending:
        return
    figures = torch.cat([p.figures for _, p in pending]).tolist()  # the one host read
    checks, at = [], 0
    for k, p in pending:
        n = p.figures.numel()
        checks.append((k, p.check, figures[at:at + n]))
        at += n
    for k, check, got in sorted(checks, key=lambda c: c[0]):  # the list's first bad raises
        try:
            check(got)
        except DeltaTransportError as e:
            raise _labelled(labels, k, e) from None


def _labelled(labels: Optional[list[str]], k: int, e: DeltaTransportError) -> DeltaTransportError:
    """``e`` under item ``k``'s label (param, ranks, box), if there are labels."""
    return e if labels is None else DeltaTransportError(f"{labels[k]}: {e}")


def apply(view: torch.Tensor, count: int, enc: int, payload: Optional[torch.Tensor]) -> None:
    """Write a received delta into ``view`` in place (any strides). ``view`` must hold the
    base the delta was cut from (DIFF8 values add to its bits)."""
    if enc == NONE:
        return
    numel, itemsize = view.numel(), view.element_size()
    if enc == DENSE:
        view.copy_(_typed(payload, view.dtype).reshape(view.shape))
        return
    kind, diff8 = enc & 7, bool(enc & DIFF8)
    if kind in (GAPS, POSITIONS) and kernels.usable(view) and kernel_apply.apply_sparse(
            view, count, kind == GAPS, diff8, payload, index_bytes(numel)):
        return  # checked, decoded and written in place by the kernels
    nindex = _index_bytes(kind, diff8, payload, numel, count, itemsize)
    if kind == BITMASK and kernels.usable(view):
        pos = _bitmask_on_gpu(view, count, diff8, payload, nindex)
        if pos is None:  # whole values, written by the kernel
            return
    else:
        pos = _positions(kind, payload[:nindex], numel, count)
    rows = _rows_in_place(view)
    if rows is not None:  # CUDA, a strided view of rows: written where it lies, no copy
        fb, pos = rows(pos)
        flat = None
    else:
        flat = view.contiguous().reshape(-1)  # a copy for a strided view, written back below
        fb = flat.view(_INT_OF_SIZE[itemsize])
    raw = payload[nindex:]
    if diff8:
        if raw.numel() < count:
            raise DeltaTransportError(f"a delta of {count} differences carries {raw.numel()} "
                                      f"bytes after its index")
        small = raw[:count].view(torch.int8)
        escaped = small == -128
        whole = raw[count:]
        if whole.numel() != _ones(escaped) * itemsize:
            raise DeltaTransportError(f"a delta of {count} differences with "
                                      f"{_ones(escaped)} escapes carries {whole.numel()} "
                                      f"bytes of whole values")
        if pos.dtype == torch.bool:
            pos = pos.nonzero().reshape(-1)
        got = fb[pos]
        stepped = (got.to(torch.int64) + small.to(torch.int64)).to(fb.dtype)
        fb[pos] = torch.where(escaped, got, stepped)
        if whole.numel():
            fb[pos[escaped]] = _typed(whole, fb.dtype)
    else:
        if raw.numel() != count * itemsize:
            raise DeltaTransportError(f"a delta of {count} values carries {raw.numel()} bytes")
        fb[pos] = _typed(raw, fb.dtype)
    if flat is not None and not view.is_contiguous():  # ``flat`` was a copy
        view.copy_(flat.reshape(view.shape))


def _rows_in_place(view: torch.Tensor):
    """On CUDA, for a strided view that folds into rows of unit stride (a TP column
    shard): a function turning positions in the view into ``(bits of the memory the rows
    span, positions there)``, so that the changed elements are written in place instead
    of through a copy of the whole view and back. None: no such view, or not on CUDA."""
    if view.is_contiguous() or not kernels.usable(view):
        return None
    form = kernels.rows_form(view)
    if form is None:
        return None
    span = view.as_strided(((form.rows - 1) * form.stride + form.cols,), (1,))
    bits = span.view(_INT_OF_SIZE[view.element_size()])

    def place(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pos.dtype == torch.bool:
            pos = pos.nonzero().reshape(-1)
        return bits, pos // form.cols * form.stride + pos % form.cols
    return place


def _bitmask_on_gpu(view: torch.Tensor, count: int, diff8: bool, payload: torch.Tensor,
                    nindex: int) -> Optional[torch.Tensor]:
    """A BITMASK delta on CUDA: the bits counted and checked by a kernel; whole values
    written by a kernel (None returned), else the int64 positions for ``apply``'s DIFF8
    steps (the kernel that would scatter them cannot fold this view: positions too)."""
    numel, itemsize = view.numel(), view.element_size()
    index = payload[:nindex]
    counts = kernel_apply.bitmask_counts(index, numel)
    got = int(counts.sum())
    past = _ones((index[-1:] >> (numel % 8)).ne(0)) if numel % 8 else 0
    if got != count or past:
        raise DeltaTransportError(f"a bitmask delta sets {got + past} bits (past the box: "
                                  f"{past}) but its header says {count}")
    if not diff8:
        values = payload[nindex:]
        if values.numel() != count * itemsize:
            raise DeltaTransportError(f"a delta of {count} values carries {values.numel()} "
                                      f"bytes")
        if kernel_apply.apply_bitmask(view, index, values, counts):
            return None
    pos = kernel_apply.bitmask_positions(index, numel, counts, count)
    if diff8 and kernel_apply.apply_sparse(view, count, False, True, payload[nindex:], 8, pos):
        return None
    return pos


__all__ = ["apply", "apply_many", "encode", "encode_many", "encoding_sizes", "header_problem",
           "index_bytes", "payload_bytes", "pick_encoding"]
