"""The delta transport of the process-group path: changed elements only, batched per peer.

Torch + stdlib only (the receiver imports it). For each eligible bulk param of a batch
(``refit.delta.eligible``: every op of its engine plan one hop), each plan op
``(src, dst, box)`` becomes one *region*: the sender compares the box of its new local
view with its base bit for bit and cuts ``(count, encoding, payload)``. Regions are not
messages: per batch and per peer, the headers of all its regions travel as one int64
message (two words a region: ``count * 16 + encoding``, payload bytes) and their payloads
as one uint8 message (none when nothing changed). So a delta refit costs two messages per
peer per batch, however many small params (norms, biases) the batch holds, and 16 bytes a
region: per-message latency, not bytes, dominates a sparse delta (issue 35).

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

The receiver learns each region's encoding from the header and writes the values in place
into its destination view. Every rank walks the same plan in the same order: per batch,
phase 0 (sources -> destinations) then phase 1 (a destination member forwards the stripe
it received to its replicas, as a delta of its own against the stripe's old bits). Each
exchange is two ``engine.p2p`` rounds (headers, then payloads), all posted before any is
waited on (NCCL: coalesced), so nothing can deadlock. Bits are compared as integers: NaN
payloads and -0.0 move exactly. A header that does not fit the receiver's box is refused
before its payload is received (``DeltaTransportError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_reshard.engine.p2p import P2PChannel
from megatron_reshard.engine.param_plan import ParamPlan
from megatron_reshard.groups.collectives import control_device
from megatron_reshard.groups.faults import RefitError
from megatron_reshard.layout.geometry import box_numel
from megatron_reshard.refit import delta_kernels
from megatron_reshard.refit.delta import TrainBase, as_tensor

NONE, POSITIONS, BITMASK, DENSE, GAPS = 0, 1, 2, 3, 4
DIFF8 = 8  # flag: values are int8 differences of the bits (new - old)
KINDS = {NONE: "none", POSITIONS: "positions", BITMASK: "bitmask", DENSE: "dense", GAPS: "gaps"}
HEADER_WORDS = 2
HEADER_BYTES = HEADER_WORDS * 8  # per region
GAP_SKIP = 255  # a 0 byte in GAPS: advance this far, no value
_TAG = 0
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class DeltaTransportError(RefitError):
    """A delta message that does not fit the receiver's view (bad or mismatched delta)."""


def encoding_name(enc: int) -> str:
    name = KINDS.get(enc & 7, f"unknown {enc}")
    return name + "+diff8" if enc & DIFF8 and enc & 7 not in (NONE, DENSE) else name


@dataclass
class DeltaTally:
    """What the delta transport moved on this rank in one refit."""

    params: int = 0          # params of this rank moved as deltas
    ops: int = 0             # regions this rank sent (src) or received (dst)
    messages: int = 0        # messages this rank sent (src) or received (dst), headers included
    wire_bytes: int = 0      # header + payload bytes this rank sent (src) or received (dst)
    full_bytes: int = 0      # what a full refit would have moved for the same regions
    forwarded_bytes: int = 0  # dst: header + payload bytes sent on to replicas (phase 1)
    held_bytes: int = 0      # this rank's owned boxes of those params (RefitStats.local_bytes)
    changed: int = 0         # elements that changed
    # params of this rank that went full inside the delta refit (not eligible: a local
    # copy, or a weight the generation side quantizes, ``refit.delta.record_eligible``)
    full_params: int = 0
    encodings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"params": self.params, "ops": self.ops, "messages": self.messages,
                "wire_bytes": self.wire_bytes, "full_bytes": self.full_bytes,
                "held_bytes": self.held_bytes, "forwarded_bytes": self.forwarded_bytes,
                "changed": self.changed, "full_params": self.full_params,
                "encodings": dict(self.encodings)}


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
    if delta_kernels.usable(new):  # CUDA: the Triton kernels cut it (the same bytes)
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
    return _encoded(delta_kernels.cut(nb, ob, index_bytes(nb.numel())), nb)


# regions cut between two host reads (``encode_many``): their scratch (~0.6 byte an
# element with the speculated payload's room) lives until the read
GROUP_BYTES = 1 << 30


def encode_many(pairs: list) -> list[tuple[int, int, Optional[torch.Tensor]]]:
    """``encode`` of each ``(new, old)`` pair. On CUDA the kernels cut up to
    ``GROUP_BYTES`` of regions between two host reads (``delta_kernels.cut_many``): the
    host's launches for one region overlap the device's work on the ones before."""
    out: list = [None] * len(pairs)
    group: list = []  # (k, new bits, old bits)

    def flush() -> None:
        cuts = delta_kernels.cut_many([(nb, ob) for _, nb, ob in group],
                                      [index_bytes(nb.numel()) for _, nb, _ in group])
        for (k, nb, _), cut in zip(group, cuts):
            out[k] = _encoded(cut, nb)
        group.clear()

    held = 0
    for k, (new, old) in enumerate(pairs):
        if not delta_kernels.usable(new):
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


def _encoded(cut: "delta_kernels.Cut", nb: torch.Tensor) -> tuple[int, int, Optional[torch.Tensor]]:
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
    (``delta_kernels.launch_gaps_many``), the POSITIONS deltas in two
    (``delta_kernels.launch_positions_many``), and checked with one host read after the
    last: a bad delta is refused unwritten, as by ``apply``, the others of the list
    written (one wrong on its face is refused before the groups launch). ``labels``: each
    item's name for its error (param, ranks, box)."""
    gaps = []       # GAPS deltas: three launches for all (a program a chunk)
    positions = []  # POSITIONS deltas: two launches for all (a program a chunk)
    k = 0
    try:  # (not a context manager an item: its cost counts a region at a time)
        for k, (view, count, enc, payload) in enumerate(items):
            kind, diff8 = enc & 7, bool(enc & DIFF8)
            if kind in (GAPS, POSITIONS) and delta_kernels.usable(view) and (
                    delta_kernels.rows_form(view) is not None):
                if kind == POSITIONS:
                    size = index_bytes(view.numel())
                    # on its face (too few bytes, ...): refused here, under its label
                    delta_kernels.positions_whole(view, count, diff8,
                                                  payload.numel() - count * size)
                    positions.append((k, (view, count, diff8, payload, size)))
                else:
                    gaps.append((k, (view, count, diff8, payload)))
                continue
            apply(view, count, enc, payload)
    except DeltaTransportError as e:
        raise _labelled(labels, k, e) from None
    pending = []  # (item, launched apply)
    for group, launch in ((gaps, delta_kernels.launch_gaps_many),
                          (positions, delta_kernels.launch_positions_many)):
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
    if kind in (GAPS, POSITIONS) and delta_kernels.usable(view) and delta_kernels.apply_sparse(
            view, count, kind == GAPS, diff8, payload, index_bytes(numel)):
        return  # checked, decoded and written in place by the kernels
    nindex = _index_bytes(kind, diff8, payload, numel, count, itemsize)
    if kind == BITMASK and delta_kernels.usable(view):
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
    if view.is_contiguous() or not delta_kernels.usable(view):
        return None
    form = delta_kernels.rows_form(view)
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
    counts = delta_kernels.bitmask_counts(index, numel)
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
        if delta_kernels.apply_bitmask(view, index, values, counts):
            return None
    pos = delta_kernels.bitmask_positions(index, numel, counts, count)
    if diff8 and delta_kernels.apply_sparse(view, count, False, True, payload[nindex:], 8, pos):
        return None
    return pos


@dataclass
class _Region:
    """One plan op of one param, as this rank sees it."""

    name: str
    peer: int             # the other end (group rank)
    box: tuple
    view: Optional[torch.Tensor] = None   # dst: where it lands
    count: int = 0        # src: what was cut
    enc: int = NONE
    payload: Optional[torch.Tensor] = None
    full: int = 0         # bytes of the box


class DeltaMover:
    """Moves the eligible params of each batch as deltas, for one side of one stage."""

    def __init__(self, side: str, group: Any, rank: int, plans: list[Optional[ParamPlan]],
                 base: Optional[TrainBase] = None):
        self.side = side
        self.group = group
        self.rank = rank
        self.plans = plans
        self.base = base
        self.tally = DeltaTally()
        self._ctl = control_device(group)
        self._p2p = P2PChannel(group, self._ctl)

    def move(self, index: int, name: str, buf: Any) -> None:
        """One param alone (a batch of one)."""
        self.move_batch([(index, name, buf)])

    def move_batch(self, items: list) -> None:
        """The eligible params of one batch: ``(index, name, buf)`` each, ``buf`` this
        rank's side of param ``index`` (or None), in stage order."""
        cuts: list[tuple] = []  # (name, peer, box, new, old) of each phase 0 send
        recvs: list[_Region] = []
        forwards: list[tuple[_Region, torch.Tensor]] = []  # phase 1: (region, old stripe)
        late: list[_Region] = []                           # phase 1 receives
        bases = []
        for index, name, buf in items:
            plan = self.plans[index]
            local = None if buf is None else as_tensor(buf)
            if local is not None:
                self.tally.params += 1
                own = (plan.src if self.side == "src" else plan.dst).get(self.rank)
                if own is not None:
                    self.tally.held_bytes += sum(box_numel(p.box) for p in own.pieces) * \
                        local.element_size()
            if self.side == "src":
                if local is None:
                    continue
                base = self.base.tensors.get(index)
                if base is None or base.shape != local.shape or base.dtype != local.dtype:
                    raise DeltaTransportError(
                        f"{name}: src group rank {self.rank} holds no base of its local view "
                        f"{list(local.shape)} for a delta refit")
                for op in plan.ops:
                    if op.phase == 0 and op.src == self.rank:
                        idx = plan.src[self.rank].pieces[op.src_piece].index(op.box)
                        cuts.append((name, op.dst, op.box, local[idx], base[idx]))
                bases.append((base, local))
                continue
            if local is None:
                continue
            for op in plan.ops:
                if op.phase == 1 and op.src == self.rank:
                    view = local[plan.dst[self.rank].pieces[op.src_piece].index(op.box)]
                    # the stripe's old bits, kept until phase 0 rewrote it
                    forwards.append((_Region(name, op.dst, op.box, view), view.clone()))
                elif op.dst == self.rank:
                    view = local[plan.dst[self.rank].pieces[op.dst_piece].index(op.box)]
                    (recvs if op.phase == 0 else late).append(_Region(name, op.src, op.box, view))
        self._exchange(self._cut(cuts), recvs)
        for base, local in bases:  # the bits just sent become the base (valid at the commit)
            base.copy_(local)
        if forwards or late:
            cut = self._cut([(r.name, r.peer, r.box, r.view, old) for r, old in forwards],
                            forwarded=True)
            self._exchange(cut, late, forwarded=True)

    def _cut(self, wanted: list[tuple], forwarded: bool = False) -> list[_Region]:
        """The regions ``(name, peer, box, new, old)`` cut (``encode_many``: on CUDA one
        host read per group of regions)."""
        pairs = [(new, old.to(new.device) if old.device != new.device else old)
                 for _, _, _, new, old in wanted]
        out = []
        for (name, peer, box, new, _), (count, enc, payload) in zip(wanted, encode_many(pairs)):
            region = _Region(name, peer, box, None, count, enc, payload,
                             new.numel() * new.element_size())
            if not forwarded:
                self._count(region, 0 if payload is None else payload.numel())
            out.append(region)
        return out

    def _exchange(self, sends: list[_Region], recvs: list[_Region],
                  forwarded: bool = False) -> None:
        """Two rounds: every peer's headers, then every peer's payloads (one message each)."""
        out = _by_peer(sends)
        into = _by_peer(recvs)
        headers_out, payloads_out = {}, {}
        for peer, regions in out.items():
            words = [w for r in regions for w in
                     (r.count * 16 + r.enc, 0 if r.payload is None else r.payload.numel())]
            headers_out[peer] = torch.tensor(words, dtype=torch.int64, device=self._ctl)
            parts = [r.payload.reshape(-1) for r in regions if r.payload is not None]
            if parts:
                payloads_out[peer] = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        headers_in = {peer: torch.empty(HEADER_WORDS * len(regions), dtype=torch.int64,
                                        device=self._ctl) for peer, regions in into.items()}
        with self._p2p.round():
            for peer, header in headers_out.items():
                self._p2p.send(header, peer, _TAG)
            for peer, header in headers_in.items():
                self._p2p.recv(header, peer, _TAG)
        announced = {peer: self._check(into[peer], header.tolist())
                     for peer, header in headers_in.items()}
        payloads_in = {peer: torch.empty(sum(n for _, _, n in got), dtype=torch.uint8,
                                         device=into[peer][0].view.device)
                       for peer, got in announced.items() if any(n for _, _, n in got)}
        with self._p2p.round():
            for peer, payload in payloads_out.items():
                self._p2p.send(payload, peer, _TAG)
            for peer, payload in payloads_in.items():
                self._p2p.recv(payload, peer, _TAG)
        writes, labels = [], []
        for peer, got in announced.items():
            at = 0
            for region, (count, enc, nbytes) in zip(into[peer], got):
                part = payloads_in[peer][at:at + nbytes] if nbytes else None
                at += nbytes
                writes.append((region.view, count, enc, part))
                labels.append(f"{region.name}: dst group rank {self.rank}, delta from group "
                              f"rank {region.peer} for box {list(region.box)}")
                region.count, region.enc = count, enc
                self._count(region, nbytes)
        apply_many(writes, labels)  # on CUDA: one host read for the batch's checks
        # src: the messages it sent; dst: those it received (forwards count as forwarded)
        self.tally.messages += len(headers_in) + len(payloads_in) + \
            (0 if forwarded else len(headers_out) + len(payloads_out))
        if forwarded:
            self.tally.forwarded_bytes += sum(HEADER_BYTES + (0 if r.payload is None else
                                                              r.payload.numel()) for r in sends)

    def _check(self, regions: list[_Region], words: list[int]) -> list[tuple[int, int, int]]:
        """Each region's ``(count, encoding, payload bytes)``; a header that cannot fit its
        box is refused before any payload is received."""
        out = []
        for k, region in enumerate(regions):
            word, nbytes = words[2 * k], words[2 * k + 1]
            count, enc = word >> 4, word & 15
            numel = box_numel(region.box)
            why = header_problem(numel, region.view.element_size(), count, enc, nbytes)
            if why:
                # the peer is still consistent (it sent what it announced): raise here, the
                # fault board tells the others
                raise DeltaTransportError(
                    f"{region.name}: dst group rank {self.rank} got a delta header from group "
                    f"rank {region.peer} for box {list(region.box)} ({numel} elements) that "
                    f"does not fit: {why}")
            out.append((count, enc, nbytes))
        return out

    def _count(self, region: _Region, nbytes: int) -> None:
        self.tally.ops += 1
        self.tally.wire_bytes += HEADER_BYTES + nbytes
        self.tally.full_bytes += region.full or (region.view.numel() * region.view.element_size())
        self.tally.changed += region.count
        key = encoding_name(region.enc)
        self.tally.encodings[key] = self.tally.encodings.get(key, 0) + 1


def _by_peer(regions: list[_Region]) -> dict[int, list[_Region]]:
    out: dict[int, list[_Region]] = {}
    for r in regions:
        out.setdefault(r.peer, []).append(r)
    return dict(sorted(out.items()))


__all__ = ["BITMASK", "DENSE", "DIFF8", "DeltaMover", "DeltaTally", "DeltaTransportError", "GAPS",
           "NONE", "POSITIONS", "apply", "apply_many", "encode", "encode_many", "encoding_name",
           "encoding_sizes", "header_problem", "payload_bytes", "pick_encoding"]
