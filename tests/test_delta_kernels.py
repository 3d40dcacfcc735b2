"""The GPU cut and apply of delta refits (``delta/kernels.py``, ``delta/kernel_apply.py``,
reached through ``delta.encoding.encode``/``apply`` for CUDA tensors) against the torch path of the
same functions (``MEGATRON_RESHARD_DELTA_KERNELS=0``, the oracle): payloads byte for byte in
every encoding of the wire format (POSITIONS, GAPS, BITMASK, DENSE, with and without DIFF8,
escapes included), element sizes 1-8 (fp8, bf16, fp32), NaN payloads and -0.0, skip bytes
across the cut's blocks and tiles and the apply's chunks, every element changed, every
step escaping, payloads at odd offsets, strided destination views (bytes outside
untouched), bad bitmask / gaps / positions deltas refused unwritten by both paths. Small
blocks, tiles and chunks (module constants) stand in for big regions. The kernel tests run
on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` with Triton installed; else they
skip. ``rows_form`` is index math: CPU."""

import os

import pytest
import torch

import megatron_reshard.delta.encoding as dt
from megatron_reshard.delta import kernel_apply
from megatron_reshard.delta import kernels as delta_kernels
from megatron_reshard.delta.encoding import apply, encode
from megatron_reshard.delta.kernels import Rows, rows_form
from megatron_reshard.delta.wire_format import (BITMASK, DENSE, DIFF8, GAPS, NONE, POSITIONS,
                                                DeltaTransportError)

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("shape, stride, want", [
    ((6, 5), (5, 1), Rows(1, 30, 0)),            # contiguous: one row
    ((6, 5), (9, 1), Rows(6, 5, 9)),             # a column block of a wider tensor
    ((2, 3, 4), (24, 4, 1), Rows(2, 12, 24)),    # two dims merge into the rows' length
    ((1, 7), (99, 1), Rows(1, 7, 0)),            # a dim of one is ignored
    ((6, 5), (1, 6), None),                      # transposed: no unit stride last
    ((2, 3, 4), (40, 8, 1), None),               # three dims that do not merge
])
def test_views_fold_into_rows_where_their_strides_allow(shape, stride, want):
    view = torch.empty(256, dtype=torch.bfloat16).as_strided(shape, stride)
    assert rows_form(view) == want


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1" and delta_kernels._kernels():
        return torch.device("cpu")
    pytest.skip("needs CUDA with Triton (or TRITON_INTERPRET=1 with Triton installed)")


@pytest.fixture
def device(monkeypatch):
    """The device the kernels run on; every kernel entry point is watched, so a test can
    tell that the kernels (not the torch path) did the work."""
    dev = _device()
    if dev.type == "cpu":  # the interpreter runs the kernels on CPU tensors
        monkeypatch.setattr(delta_kernels, "usable", lambda t: delta_kernels.enabled())
    calls = []
    for name in ("cut_many", "apply_sparse", "bitmask_counts", "bitmask_positions",
                 "apply_bitmask", "rows_form", "launch_gaps_many",
                 "launch_positions_many"):
        module = kernel_apply if hasattr(kernel_apply, name) else delta_kernels  # its home
        real = getattr(module, name)

        def watched(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)
        monkeypatch.setattr(module, name, watched)
    return dev, calls


def _pair(n, fraction, itemsize, seed, device, escapes=0.0):
    """(new, old) as integer bits: random old (NaN payloads and -0.0 among bf16), new with
    ``fraction`` of the elements changed, most in their lowest bit (a DIFF8 step of one),
    ``escapes`` of those by a step too large for DIFF8's byte."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g).view(INTS[itemsize])
    if itemsize == 2:
        old[:4] = torch.tensor([0x7F81, -0x8000, 0x7FC1, 0], dtype=torch.int16)[:n]
    new = old.clone()
    pick = torch.rand(n, generator=g) < fraction
    big = pick & (torch.rand(n, generator=g) < escapes)
    new[pick & ~big] ^= 1
    new[big] ^= 0x80 if itemsize == 1 else 1 << (8 * itemsize - 2)
    return new.to(device), old.to(device)


def _as(x, itemsize):
    return x.view({2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(itemsize, x.dtype))


def _torch_path(monkeypatch, fn, *args):
    monkeypatch.setenv("MEGATRON_RESHARD_DELTA_KERNELS", "0")
    try:
        return fn(*args)
    finally:
        monkeypatch.delenv("MEGATRON_RESHARD_DELTA_KERNELS")


def _same_cut(got, want):
    assert got[:2] == want[:2], (dt.encoding_name(got[1]), dt.encoding_name(want[1]))
    assert (got[2] is None) == (want[2] is None)
    if want[2] is not None:
        assert torch.equal(got[2].cpu(), want[2].cpu())


def _apply_into_column_block(new, old, count, enc, payload, device):
    """Apply into a row of a column block of a wider tensor: only the view changes."""
    n = new.numel()
    wide = torch.zeros(3, n + 5, dtype=new.dtype, device=device)
    view = wide[:, 2:n + 2][1]
    view.copy_(old.reshape(-1))
    before = wide.clone()
    apply(view, count, enc, payload)
    bits = INTS[new.element_size()]
    assert torch.equal(view.view(bits).cpu(), new.reshape(-1).view(bits).cpu())
    rest = torch.ones_like(wide, dtype=torch.bool)
    rest[1, 2:n + 2] = False
    assert torch.equal(wide.view(bits)[rest].cpu(), before.view(bits)[rest].cpu())


@pytest.mark.parametrize("n, fraction, itemsize, escapes, want", [
    (20_000, 0.001, 2, 0.0, GAPS | DIFF8),
    (20_000, 0.001, 2, 0.5, GAPS | DIFF8),   # long gaps: skip bytes
    (9_001, 0.05, 2, 0.05, GAPS | DIFF8),
    (40_000, 0.018, 2, 0.01, GAPS | DIFF8),  # the measured Adam rate: every block slotted
    (9_001, 0.3, 2, 0.0, BITMASK | DIFF8),
    (5_003, 0.3, 4, 0.9, BITMASK),           # most steps escape: whole values
    (777, 0.02, 8, 0.0, GAPS | DIFF8),
    (333, 0.2, 1, 0.3, None),
    (4096 * 3, 0.0, 2, 0.0, NONE),
    (1000, 1.0, 2, 0.0, DENSE)])
def test_cut_is_the_torch_paths_bytes_and_applies(device, monkeypatch, n, fraction, itemsize,
                                                  escapes, want):
    dev, calls = device
    new, old = _pair(n, fraction, itemsize, n, dev, escapes)
    new, old = _as(new, itemsize), _as(old, itemsize)
    got = encode(new, old)
    _same_cut(got, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    assert want is None or got[1] == want, dt.encoding_name(got[1])
    assert "cut_many" in calls
    _apply_into_column_block(new, old, *got, dev)
    if got[1] & 7 == BITMASK:
        assert "bitmask_counts" in calls
    if got[1] & 7 in (GAPS, POSITIONS):
        assert "apply_sparse" in calls


@pytest.mark.parametrize("cols", [90, 96])  # rows of the view cut tile rows of 8, or not
@pytest.mark.parametrize("forced", [POSITIONS, POSITIONS | DIFF8, GAPS, GAPS | DIFF8, BITMASK,
                                    BITMASK | DIFF8, DENSE])
def test_every_encoding_matches_and_applies_into_a_strided_view(device, monkeypatch, forced, cols):
    """Each encoding forced on both paths (the cheapest is not always the one under test),
    cut by the kernels, compared with the torch path's bytes, applied into a [rows, cols]
    block of a wider tensor."""
    dev, calls = device
    new, old = _pair(64 * cols, 0.03, 2, 7, dev, escapes=0.1)
    new, old = _as(new, 2).view(64, cols), _as(old, 2).view(64, cols)
    monkeypatch.setattr(dt, "pick_encoding", lambda *a, **k: forced)
    got = encode(new, old)
    assert got[1] == forced
    _same_cut(got, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    assert "cut_many" in calls
    count, enc, payload = got
    wide = torch.zeros(64, 128, dtype=new.dtype, device=dev)
    view = wide[:, 16:16 + cols]
    view.copy_(old)
    apply(view, count, enc, payload)
    assert torch.equal(view.view(torch.int16).cpu(), new.view(torch.int16).cpu())
    assert not bool(wide[:, :16].view(torch.int16).any())
    assert not bool(wide[:, 16 + cols:].view(torch.int16).any())
    if forced != DENSE:  # the rows written where they lie, not through a copy of the view
        assert "rows_form" in calls
    if forced == BITMASK:  # whole values: the kernel writes them into the view
        assert "apply_bitmask" in calls
    if forced == BITMASK | DIFF8:
        assert "bitmask_positions" in calls
    if forced & 7 in (GAPS, POSITIONS) or forced == BITMASK | DIFF8:
        assert "apply_sparse" in calls


@pytest.mark.parametrize("forced", [GAPS | DIFF8, BITMASK, BITMASK | DIFF8])
def test_a_view_that_does_not_fold_into_rows_is_written_through_a_copy(device, monkeypatch,
                                                                       forced):
    dev, _ = device
    new, old = _pair(64 * 40, 0.05, 2, 3, dev, escapes=0.1)
    new, old = new.view(64, 40), old.view(64, 40)
    monkeypatch.setattr(dt, "pick_encoding", lambda *a, **k: forced)
    count, enc, payload = encode(new, old)
    view = torch.zeros(40, 64, dtype=torch.int16, device=dev).t()  # unit stride down columns
    assert rows_form(view) is None
    view.copy_(old)
    apply(view, count, enc, payload)
    assert torch.equal(view.cpu(), new.cpu())


def test_bad_bitmask_deltas_are_refused_before_anything_is_written(device):
    dev, _ = device
    view = torch.zeros(100, dtype=torch.bfloat16, device=dev)
    values = torch.zeros(6, dtype=torch.uint8)
    mask = torch.zeros(13, dtype=torch.uint8)
    mask[0] = 0b101  # two bits set, the header says three
    with pytest.raises(DeltaTransportError, match=r"sets 2 bits \(past the box: 0\) but its "
                                                  r"header says 3"):
        apply(view, 3, BITMASK, torch.cat([mask, values]).to(dev))
    mask[0] = 0b1
    mask[12] = 0b10000  # element 100 of a 100-element box
    with pytest.raises(DeltaTransportError, match=r"past the box: 1"):
        apply(view, 2, BITMASK, torch.cat([mask, values[:4]]).to(dev))
    mask[12] = 0
    mask[0] = 0b11
    with pytest.raises(DeltaTransportError, match="2 values carries 6 bytes"):
        apply(view, 2, BITMASK, torch.cat([mask, values]).to(dev))
    assert not bool(view.view(torch.int16).any())  # nothing was written
    apply(view, 0, NONE, None)
    assert not bool(view.view(torch.int16).any())


def _forced(monkeypatch, enc):
    monkeypatch.setattr(dt, "pick_encoding", lambda *a, **k: enc)


@pytest.mark.parametrize("block, tile, chunk", [(4096, 1024, 2048), (64, 2, 16), (32, 1, 8)],
                         ids=["default", "many-tiles", "a-tile-a-block"])
@pytest.mark.parametrize("forced", [GAPS | DIFF8, GAPS, POSITIONS | DIFF8])
def test_gaps_longer_than_a_byte_across_blocks(device, monkeypatch, forced, block, tile,
                                               chunk):
    """Hand-placed changes: the first 600 elements in (skip bytes before the first value),
    gaps of exactly 255, 256 and 510 (one byte, one skip, one skip and 255), pairs across
    the kernels' block boundaries, a gap over whole empty blocks (and, with small blocks
    and tiles, across and over the tiles the offsets are summed in; the apply's chunks
    small too), the region's last element; some by steps that escape DIFF8's byte."""
    dev, calls = device
    monkeypatch.setattr(delta_kernels, "BLOCK", block)
    monkeypatch.setattr(delta_kernels, "_TILE", tile)
    monkeypatch.setattr(kernel_apply, "CHUNK", chunk)
    n = max(3 * block + 5, 2000)
    at = sorted({600, 855, 1111, 1621, 1622, 1629, block - 1, block, 2 * block - 3,
                 3 * block + 1, n - 1})
    old = torch.arange(n, dtype=torch.int16) * 7
    new = old.clone()
    new[at] += 1
    new[[1111, 1622, n - 1]] += 1000  # escapes, the last one in the region's last element
    new, old = new.view(torch.bfloat16).to(dev), old.view(torch.bfloat16).to(dev)
    _forced(monkeypatch, forced)
    got = encode(new, old)
    _same_cut(got, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    assert got[0] == len(at)
    _apply_into_column_block(new, old, *got, dev)
    assert "apply_sparse" in calls


@pytest.mark.parametrize("tail", [37, 40])  # odd: compared an element at a time; even: two
@pytest.mark.parametrize("forced", [GAPS | DIFF8, GAPS, POSITIONS, POSITIONS | DIFF8, BITMASK,
                                    BITMASK | DIFF8])
def test_blocks_in_their_slots_and_over_them(device, monkeypatch, forced, tail):
    """The cut puts a block's changes in its slot when they are at most ``_cap()`` (8 for
    blocks of 256) and reads new and old again for the others: blocks exactly at the cap
    and one over it, 8 and 16 changes in one 16-element word, a run of empty blocks then a
    change at a block's first element, changes at blocks' last elements, escapes inside
    slots and inside overflowed blocks, a partial last block."""
    dev, _ = device
    monkeypatch.setattr(delta_kernels, "BLOCK", 256)
    monkeypatch.setattr(delta_kernels, "_TILE", 4)
    monkeypatch.setattr(kernel_apply, "CHUNK", 64)
    assert delta_kernels._cap() == 8
    n = 9 * 256 + tail
    at = ([0, 3, 40, 41, 100, 200, 254, 255]                    # block 0: 8, at the cap
          + [256 + 16 * i for i in range(9)]                     # block 1: 9, over it
          + [5 * 256, 5 * 256 + 17, 5 * 256 + 18, 6 * 256 - 1]   # blocks 2-4 empty
          + [6 * 256 + 32 + i for i in range(8)]                 # block 6: 8 in one word
          + [7 * 256 + 64 + i for i in range(16)]                # block 7: 16 in one word
          + [8 * 256 + 255, n - 1])                              # a block's last, the end
    escaped = [3, 255, 256 + 32, 5 * 256, 6 * 256 + 35, 7 * 256 + 70, n - 1]
    old = (torch.arange(n, dtype=torch.int32) * 37 % 30011).to(torch.int16)
    new = old.clone()
    new[at] += 1
    new[escaped] += 700
    new, old = new.view(torch.bfloat16).to(dev), old.view(torch.bfloat16).to(dev)
    assert delta_kernels._pack(new, old) == (2 if tail % 2 == 0 else 0)
    cut = delta_kernels.cut(new, old)
    assert (cut.count, cut.escapes, cut.overflowed) == (len(at), len(escaped), 2)
    _forced(monkeypatch, forced)
    got = encode(new, old)
    _same_cut(got, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    _apply_into_column_block(new, old, *got, dev)


@pytest.mark.parametrize("forced", [GAPS | DIFF8, POSITIONS, BITMASK | DIFF8])
def test_every_element_changed_and_every_step_escaping(device, monkeypatch, forced):
    dev, _ = device
    for n, escapes in ((4099, 0.0), (17, 1.0), (1, 1.0), (7, 0.5)):
        new, old = _pair(n, 1.0, 2, n, dev, escapes)
        new, old = _as(new, 2), _as(old, 2)
        _forced(monkeypatch, forced)
        got = encode(new, old)
        _same_cut(got, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
        assert got[0] == n
        _apply_into_column_block(new, old, *got, dev)


@pytest.mark.parametrize("n, fraction, itemsize, escapes, want", [
    (20_000, 0.01, 2, 0.0, GAPS | DIFF8),
    (20_000, 0.0005, 2, 0.0, POSITIONS | DIFF8),
    (20_000, 0.01, 4, 0.3, GAPS | DIFF8),
    (20_000, 0.01, 1, 0.3, GAPS),             # 1-byte elements: no DIFF8
    (20_000, 0.0005, 1, 0.0, POSITIONS),
    (20_000, 0.02, 2, 0.9, GAPS),             # most steps escape: whole values, not guessed
    (2_000, 0.0, 2, 0.0, NONE)])
def test_the_cut_writes_the_chosen_payload_before_it_reads_its_totals(
        device, monkeypatch, n, fraction, itemsize, escapes, want):
    """The device chooses the encoding as ``pick_encoding`` does, and where the slots give
    it the payload is written in the cut's own queue (``speculated``), the torch path's
    bytes; encode() returns that payload with no second pass."""
    dev, _ = device
    new, old = _pair(n, fraction, itemsize, n + itemsize, dev, escapes)
    cut = delta_kernels.cut(new, old, dt.index_bytes(n))
    host = dt.pick_encoding(n, cut.count, itemsize, cut.skips,
                            None if itemsize == 1 else cut.escapes) if cut.count else NONE
    assert (cut.chosen, host) == (want, want)
    guessed = want in ((GAPS | DIFF8, POSITIONS | DIFF8) if itemsize > 1 else (GAPS, POSITIONS))
    assert (cut.speculated is not None) == guessed
    second = []
    cls = type(cut)
    monkeypatch.setattr(cls, "payload", lambda self, *a, _real=cls.payload: second.append(a)
                        or _real(self, *a))
    got = encode(_as(new, itemsize), _as(old, itemsize))
    want_cut = _torch_path(monkeypatch, encode, _as(new, itemsize).cpu(), _as(old, itemsize).cpu())
    _same_cut(got, want_cut)
    if guessed:
        assert torch.equal(cut.speculated[1].cpu(), want_cut[2].cpu())
    assert bool(second) == (want not in (NONE,) and not guessed)
    if got[2] is not None:
        _apply_into_column_block(_as(new, itemsize), _as(old, itemsize), *got, dev)


def test_a_guessed_gaps_payload_writes_its_skip_bytes_as_zeros(device, monkeypatch):
    """Skip bytes (gaps over 255, and the gap before a block's first change, blocks away)
    in a GAPS payload written before the totals were read: every new tensor the cut takes
    starts as garbage (0x5A bytes), so a skip byte left unwritten would show."""
    dev, _ = device
    n = 40_000
    at = list(range(0, 8000, 40)) + [8000 + 255, 8000 + 766, 9000, 15_000, 30_000, n - 1]
    old = (torch.arange(n, dtype=torch.int32) * 37 % 30011).to(torch.int16)
    new = old.clone()
    new[at] += 1
    new, old = new.to(dev), old.to(dev)
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real(*a, **k).fill_(0x5A))
    cut = delta_kernels.cut(new, old, 4)
    assert cut.chosen == GAPS | DIFF8 and cut.speculated is not None and cut.skips > 0
    monkeypatch.setattr(torch, "empty", real)
    want = _torch_path(monkeypatch, encode, _as(new, 2).cpu(), _as(old, 2).cpu())
    assert want[1] == GAPS | DIFF8
    assert torch.equal(cut.speculated[1].cpu(), want[2])


def test_a_payload_over_the_room_of_the_guess_takes_the_second_pass(device, monkeypatch):
    """A payload larger than its room (``_room``) is not written speculatively; the second pass
    writes it, the same bytes."""
    dev, _ = device
    new, old = _pair(20_000, 0.01, 2, 5, dev)
    monkeypatch.setattr(delta_kernels, "_room", lambda n, item: 64)
    cut = delta_kernels.cut(new, old)
    assert cut.chosen == GAPS | DIFF8 and cut.speculated is None
    got = encode(_as(new, 2), _as(old, 2))
    _same_cut(got, _torch_path(monkeypatch, encode, _as(new, 2).cpu(), _as(old, 2).cpu()))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32,
                                   torch.int64])
@pytest.mark.parametrize("n", [3000, 3001])  # a multiple of 4 elements: compared 4 bytes at a time
@pytest.mark.parametrize("forced", [GAPS | DIFF8, POSITIONS | DIFF8, GAPS])
def test_element_types(device, monkeypatch, dtype, forced, n):
    """fp8 (the wire's block-FP8 bytes), bf16, fp32, 8-byte elements; 5% changed, a fifth
    of them escaping (values sent whole, at offsets no element boundary need align)."""
    dev, _ = device
    item = torch.empty((), dtype=dtype).element_size()
    new, old = _pair(n, 0.05, item, item, dev, escapes=0.2)
    new, old = new.view(dtype), old.view(dtype)
    _forced(monkeypatch, forced)
    got = encode(new, old)
    _same_cut(got, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    view = old.clone()
    apply(view, *got)
    assert torch.equal(view.view(INTS[item]).cpu(), new.view(INTS[item]).cpu())


@pytest.mark.parametrize("forced", [GAPS, POSITIONS, POSITIONS | DIFF8, GAPS | DIFF8])
def test_a_payload_at_an_odd_offset_of_its_message(device, monkeypatch, forced):
    """Regions share one payload message: a region's bytes may start anywhere in it."""
    dev, _ = device
    new, old = _pair(2000, 0.04, 4, 11, dev, escapes=0.1)
    new, old = new.view(torch.float32), old.view(torch.float32)
    _forced(monkeypatch, forced)
    count, enc, payload = encode(new, old)
    message = torch.cat([torch.zeros(3, dtype=torch.uint8, device=dev), payload])
    view = old.clone()
    apply(view, count, enc, message[3:])
    assert torch.equal(view.view(torch.int32).cpu(), new.view(torch.int32).cpu())


def _gaps_payload(gap_bytes, diffs, whole=b""):
    return torch.tensor(list(gap_bytes) + [d & 0xFF for d in diffs] + list(whole),
                        dtype=torch.uint8)


@pytest.mark.parametrize("count, enc, payload, match", [
    (3, GAPS | DIFF8, _gaps_payload([0, 0, 0], [0, 0, 0]), "3 elements holds fewer gap bytes"),
    (2, GAPS | DIFF8, _gaps_payload([0, 0, 50, 1], [1, 1]), r"names 2 elements \(header: 2\) "
                                                        r"reaching past its 500-element box"),
    (2, GAPS | DIFF8, _gaps_payload([3, 4], [-128, 1]), "2 differences with 1 escapes carries "
                                                        "0 bytes of whole values"),
    (2, GAPS | DIFF8, _gaps_payload([3, 4], [1, 1], b"\x01\x02"),
     "2 differences with 0 escapes carries 2 bytes"),
    (2, GAPS, _gaps_payload([3, 4, 5], [], b"\x01\x02\x03\x04"),
     r"names 3 elements \(header: 2\)"),
    (2, POSITIONS | DIFF8, torch.tensor([3, 500], dtype=torch.int32).view(torch.uint8).tolist()
     + [1, 1], "names elements outside its 500-element box"),
    (2, POSITIONS | DIFF8, torch.tensor([3, -1], dtype=torch.int32).view(torch.uint8).tolist()
     + [1, 1], "outside"),
    (2, POSITIONS | DIFF8, torch.tensor([3, 4], dtype=torch.int32).view(torch.uint8).tolist()
     + [0x80, 1], "2 differences with 1 escapes carries 0 bytes of whole values"),
    (2, POSITIONS | DIFF8, torch.tensor([3, 4], dtype=torch.int32).view(torch.uint8).tolist()
     + [1], "2 differences carries 1 bytes after its index"),
])
def test_bad_sparse_deltas_are_refused_before_anything_is_written(device, count, enc, payload,
                                                                  match):
    """GAPS / POSITIONS deltas whose structure does not fit their box or their header:
    refused by the kernel path's checks, as by the torch path, nothing written."""
    dev, calls = device
    payload = torch.as_tensor(payload, dtype=torch.uint8)
    for path in ("kernels", "torch", "a group"):  # a group: apply_many
        view = torch.zeros(500, dtype=torch.bfloat16, device=dev if path != "torch" else "cpu")
        if path == "torch":
            os.environ["MEGATRON_RESHARD_DELTA_KERNELS"] = "0"
        try:
            with pytest.raises(DeltaTransportError, match=match):
                if path == "a group":
                    dt.apply_many([(view, count, enc, payload.to(view.device))])
                else:
                    apply(view, count, enc, payload.to(view.device))
        finally:
            os.environ.pop("MEGATRON_RESHARD_DELTA_KERNELS", None)
        assert not bool(view.view(torch.int16).any())
    assert "apply_sparse" in calls
    assert ("launch_gaps_many" in calls) == (enc & 7 == GAPS)


_REGIONS = [  # (n, fraction, itemsize, escapes): a batch's regions of several kinds
    (20_000, 0.01, 2, 0.01), (4096 * 3, 0.0, 2, 0.0), (40_000, 0.018, 2, 0.01),
    (9_001, 0.3, 2, 0.0), (777, 0.02, 8, 0.0), (333, 0.2, 1, 0.3), (1000, 1.0, 2, 0.0),
    (40_000, 0.001, 4, 0.5)]


def _regions(dev):
    return [_pair(n, f, item, seed, dev, esc) for seed, (n, f, item, esc) in enumerate(_REGIONS)]


@pytest.mark.parametrize("group_bytes", [1 << 30, 50_000])  # one host read, or several
def test_regions_cut_together_are_each_regions_own_bytes(device, monkeypatch, group_bytes):
    """``encode_many`` (the mover's cut: one host read per group of regions) gives each
    region the torch path's ``encode`` of it alone, byte for byte."""
    dev, calls = device
    monkeypatch.setattr(dt, "GROUP_BYTES", group_bytes)
    groups = []
    real = delta_kernels.cut_many
    monkeypatch.setattr(delta_kernels, "cut_many",
                        lambda pairs, sizes: groups.append(len(pairs)) or real(pairs, sizes))
    pairs = _regions(dev)
    got = dt.encode_many(pairs)
    for (new, old), cut in zip(pairs, got):
        _same_cut(cut, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    # a group ends once its regions reach GROUP_BYTES (bytes: 40,000, 24,576 | 80,000 | ...)
    assert groups == ([len(pairs)] if group_bytes >= 1 << 30 else [2, 1, 5]), groups


@pytest.mark.parametrize("forced", [None, GAPS | DIFF8, GAPS, POSITIONS, BITMASK | DIFF8])
def test_regions_of_one_batch_are_cut_by_the_same_launches(device, monkeypatch, forced):
    """One batch (``_Batch``: one launch of each cut kernel for its regions) of bf16
    regions of 1 to 17 blocks of 256 (tiles of 4 blocks, slot_write programs of 2): each
    region's blocks, tiles and programs numbered after the previous region's, its offsets,
    gaps and positions its own; regions are views at odd places of two buffers (one batch
    not 16-byte aligned), one with every block over its slot, one unchanged, gaps across
    blocks, tiles and region ends. Each payload is the torch path's for the region alone,
    written before the read (``forced`` None: the device's choice) or by the second pass
    (a region's programs and blocks from its first)."""
    dev, _ = device
    monkeypatch.setattr(delta_kernels, "BLOCK", 256)
    monkeypatch.setattr(delta_kernels, "_TILE", 4)
    monkeypatch.setattr(delta_kernels, "SLOT_ENTRIES", 16)
    batches = []
    real = delta_kernels._Batch
    monkeypatch.setattr(delta_kernels, "_Batch",
                        lambda members, *a: batches.append(len(members)) or real(members, *a))
    g = torch.Generator().manual_seed(3)
    olds = torch.randint(-2**15, 2**15, (2, 20_000), dtype=torch.int16, generator=g)
    news = olds.clone()
    flip = torch.rand(news.shape, generator=g)
    news[flip < 0.02] ^= 1
    news[flip < 0.002] ^= 0x4000  # escapes
    news[:, 15_000:15_500] ^= 3   # every block over its slot
    news[:, 4_000:6_000] = olds[:, 4_000:6_000]  # gaps over whole blocks and tiles
    news[:, 10_000:13_000] = olds[:, 10_000:13_000]  # a region unchanged
    spans = [(0, 256), (256, 2_560 + 37), (3_000, 7_168), (7_168, 10_000),
             (10_250, 12_750), (14_900, 15_600), (15_604, 19_990)]
    pairs = []
    for row, shift in ((0, 0), (1, 1)):  # row 1: every view an element later (unaligned)
        for lo, hi in spans:
            pairs.append((_as(news[row, lo + shift:hi + shift], 2).to(dev),
                          _as(olds[row, lo + shift:hi + shift], 2).to(dev)))
    if forced is not None:
        _forced(monkeypatch, forced)
    got = dt.encode_many(pairs)
    for (new, old), cut in zip(pairs, got):
        _same_cut(cut, _torch_path(monkeypatch, encode, new.cpu(), old.cpu()))
    packs = [delta_kernels._pack(delta_kernels._flat_bits(n), delta_kernels._flat_bits(o))
             for n, o in pairs]
    assert sorted(batches) == sorted([packs.count(p) for p in set(packs)]), (batches, packs)
    assert max(batches) >= 6


def test_regions_applied_together_are_checked_under_their_labels(device, monkeypatch):
    """``apply_many`` writes each region bit-exact (a row of a column block each); a bad
    delta among them is refused under its label, its view untouched, the regions before it
    written, on the kernels' path (one host read after all the launches) as on the torch
    path."""
    dev, calls = device
    bad = 2  # a GAPS + DIFF8 region, its header one change more than its payload carries
    for path in ("kernels", "torch"):
        where = dev if path == "kernels" else torch.device("cpu")
        pairs = _regions(where)
        cuts = _torch_path(monkeypatch, lambda: [encode(n.cpu(), o.cpu()) for n, o in pairs])
        assert cuts[bad][1] == GAPS | DIFF8
        walls = [torch.zeros(3, new.numel() + 5, dtype=new.dtype, device=where)
                 for new, _ in pairs]
        views = [wall[1, 2:new.numel() + 2] for wall, (new, _) in zip(walls, pairs)]
        labels = [f"region {k}" for k in range(len(pairs))]

        def items(wrong):
            out = [(view, count + (k == wrong), enc, None if p is None else p.to(where))
                   for k, (view, (count, enc, p)) in enumerate(zip(views, cuts))]
            for view, (_, old) in zip(views, pairs):
                view.copy_(old)
            return out
        if path == "torch":
            monkeypatch.setenv("MEGATRON_RESHARD_DELTA_KERNELS", "0")
        try:
            with pytest.raises(DeltaTransportError, match=f"^region {bad}: "):
                dt.apply_many(items(bad), labels)
            for k, ((new, old), view) in enumerate(zip(pairs, views)):
                if k <= bad:
                    assert torch.equal(view.cpu(), (old if k == bad else new).cpu()), (path, k)
            dt.apply_many(items(None), labels)
        finally:
            monkeypatch.delenv("MEGATRON_RESHARD_DELTA_KERNELS", raising=False)
        for (new, _), view, wall in zip(pairs, views, walls):
            assert torch.equal(view.cpu(), new.cpu()), path
            assert not bool(wall[0].any()) and not bool(wall[2].any())
    assert "rows_form" in calls  # the kernels wrote the rows where they lie
    assert "launch_gaps_many" in calls


def _placed(pairs, cuts, where):
    """Each region's old bits in a view of a wall of 3s (even regions: a stretch of a
    longer tensor, odd: a column block 96 wide of a wider one), its payload at an odd
    offset of one message: ``(walls, views, apply_many's items)``."""
    message = torch.cat([torch.tensor([7], dtype=torch.uint8)] + [c[2].cpu() for c in cuts])
    message = message.to(where)
    walls, views, items, at = [], [], [], 1
    for k, ((new, old), (count, enc, payload)) in enumerate(zip(pairs, cuts)):
        if k % 2:
            wall = torch.full((new.numel() // 96, 96 + 9), 3, dtype=new.dtype, device=where)
            view = wall[:, 5:101]
        else:
            wall = torch.full((new.numel() + 9,), 3, dtype=new.dtype, device=where)
            view = wall[5:5 + new.numel()]
        view.copy_(old.to(where).view(view.shape))
        walls.append(wall)
        views.append(view)
        items.append((view, count, enc, message[at:at + payload.numel()]))
        at += payload.numel()
    return walls, views, items


def _assert_written(pairs, views, walls, before):
    """Each view holds its region's new bits, its wall's other bytes as they were."""
    for (new, _), view, wall, was in zip(pairs, views, walls, before):
        bits = INTS[new.element_size()]
        assert torch.equal(view.reshape(-1).view(bits).cpu(), new.view(bits))
        outside = torch.ones_like(wall, dtype=torch.bool)
        if wall.dim() == 2:
            outside[:, 5:101] = False
        else:
            outside[5:5 + new.numel()] = False
        assert torch.equal(wall.view(bits)[outside].cpu(), was.view(bits)[outside].cpu())


def _launches(monkeypatch):
    """The sparse apply kernels' launches, by name, as they are made."""
    real, log = delta_kernels._kernels(), []

    class Counted:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            log.append(self.name)
            return getattr(real, self.name)[grid]
    names = ("gap_sums", "gap_locate", "apply_gaps", "pos_sums", "apply_index")
    counted = real._replace(**{name: Counted(name) for name in names})
    monkeypatch.setattr(delta_kernels, "_kernels", lambda: counted)
    return log


def _batch_cuts(monkeypatch, batch, kind, seed):
    """A pair for each ``(n, fraction (0: one change), itemsize, DIFF8, escapes)`` of
    ``batch`` and the torch path's cut of it in ``kind`` (+ DIFF8 where it says)."""
    pairs, cuts = [], []
    for k, (n, f, item, diff8, esc) in enumerate(batch):
        new, old = _pair(n, f, item, seed + k, torch.device("cpu"), esc)
        if not f:
            new[n // 2] ^= 1
        _forced(monkeypatch, kind | (DIFF8 if diff8 else 0))
        cuts.append(_torch_path(monkeypatch, encode, new, old))
        assert cuts[-1][1] == kind | (DIFF8 if diff8 else 0)
        pairs.append((new, old))
    return pairs, cuts


def _torch_writes_the_same(monkeypatch, pairs, cuts, walls):
    """The torch path's ``apply_many`` of the same cuts writes the same walls."""
    cpu_walls, _, cpu_items = _placed(pairs, cuts, torch.device("cpu"))
    _torch_path(monkeypatch, dt.apply_many, cpu_items)
    for wall, want in zip(walls, cpu_walls):
        assert torch.equal(wall.cpu(), want)


_GAPS_BATCH = [  # (n: a multiple of 96, fraction, itemsize, DIFF8, escapes)
    (96 * 2, 0.05, 2, True, 0.0),      # a payload under one chunk
    (96 * 300, 0.02, 2, True, 0.1),    # many chunks, escapes
    (96 * 300, 0.0005, 2, True, 0.0),  # long gaps: skip bytes
    (96 * 40, 0.1, 1, False, 0.0),
    (96 * 120, 0.004, 1, False, 0.0),
    (96 * 70, 0.05, 4, True, 0.5),
    (96 * 70, 0.03, 4, False, 0.0),
    (96 * 9, 0.3, 8, True, 0.2),
    (96 * 50, 0.01, 8, False, 0.0),
    (96 * 200, 0.002, 2, False, 0.0),
    (96 * 3, 0.5, 2, False, 0.0)]


def test_gaps_deltas_of_any_size_apply_as_one_batch(device, monkeypatch):
    """GAPS deltas of payloads from under one chunk to many (chunks of 64 bytes here),
    1-8 byte elements, with and without DIFF8, escapes and skip bytes, at odd offsets of
    one message, into contiguous stretches and column blocks of wider tensors, through
    ``apply_many``: three launches per element size and DIFF8 flag for the whole batch,
    each region bit-exact (the torch path's apply), bytes outside the views untouched."""
    dev, calls = device
    monkeypatch.setattr(kernel_apply, "CHUNK", 64)
    pairs, cuts = _batch_cuts(monkeypatch, _GAPS_BATCH, GAPS, 40)
    sizes = [c[2].numel() for c in cuts]
    assert min(sizes) < 64 and max(sizes) > 20 * 64, sizes
    walls, views, items = _placed(pairs, cuts, dev)
    before = [w.clone() for w in walls]
    log = _launches(monkeypatch)
    dt.apply_many(items, [f"region {k}" for k in range(len(pairs))])
    groups = {(item, diff8) for _, _, item, diff8, _ in _GAPS_BATCH}
    assert all(log.count(name) == len(groups) for name in ("gap_sums", "gap_locate",
                                                            "apply_gaps")), log
    _assert_written(pairs, views, walls, before)
    _torch_writes_the_same(monkeypatch, pairs, cuts, walls)


@pytest.mark.parametrize("count, enc, payload, match", [
    (3, GAPS | DIFF8, _gaps_payload([0, 0, 0], [0, 0, 0]), "3 elements holds fewer gap bytes"),
    (2, GAPS | DIFF8, _gaps_payload([0, 0, 50, 1], [1, 1]), "reaching past its 500-element"),
    (2, GAPS | DIFF8, _gaps_payload([3, 4], [-128, 1]), "1 escapes carries 0 bytes"),
    (2, GAPS | DIFF8, _gaps_payload([3, 4], [1, 1], b"\x01\x02"), "0 escapes carries 2 bytes"),
    (2, GAPS, _gaps_payload([3, 4, 5], [], b"\x01\x02\x03\x04"), r"names 3 elements"),
    (3, GAPS, _gaps_payload([1, 1, 1], [], b"\x01\x02"), r"names 0 elements \(header: 3\)")])
def test_a_bad_gaps_delta_in_a_batch_is_refused_and_the_others_written(device, monkeypatch,
                                                                       count, enc, payload,
                                                                       match):
    """A bad GAPS delta among good ones of its element size and DIFF8 flag (one batch of
    ``launch_gaps_many``, their chunks in one launch): refused under its label, nothing of
    it written, every other region of the batch written."""
    dev, calls = device
    monkeypatch.setattr(kernel_apply, "CHUNK", 64)
    _forced(monkeypatch, enc)
    pairs = [_pair(n, 0.05, 2, 60 + k, torch.device("cpu"), 0.1) for k, n in
             enumerate((3000, 100, 5000, 300, 700, 2000, 150))]
    cuts = _torch_path(monkeypatch, lambda: [encode(n, o) for n, o in pairs])
    bad = torch.zeros(500, dtype=torch.int16, device=dev)
    views = [old.clone().to(dev) for _, old in pairs]
    items = [(v, c, e, p.to(dev)) for v, (c, e, p) in zip(views, cuts)]
    items.insert(3, (bad, count, enc, torch.as_tensor(payload, dtype=torch.uint8).to(dev)))
    with pytest.raises(DeltaTransportError, match=f"^region 3: .*{match}"):
        dt.apply_many(items, [f"region {k}" for k in range(len(items))])
    assert "launch_gaps_many" in calls
    assert not bool(bad.any())
    for (new, _), view in zip(pairs, views):
        assert torch.equal(view.cpu(), new)


def _positions_message(cuts, size):
    """The cuts' POSITIONS payloads with their index as ``size``-byte positions, one
    after another from an odd offset of one message: ``(message, [(at, bytes)])``."""
    parts, spans, at = [torch.tensor([7], dtype=torch.uint8)], [], 1
    for count, _, payload in cuts:
        index = payload[:count * 4].view(torch.int32).to(INTS[size]).view(torch.uint8)
        parts += [index, payload[count * 4:]]
        spans.append((at, index.numel() + payload.numel() - count * 4))
        at += spans[-1][1]
    return torch.cat(parts), spans


_POS_BATCH = [  # (n: a multiple of 96, fraction (0: one change), itemsize, DIFF8, escapes)
    (96 * 2, 0.0, 2, True, 0.0),       # a single change
    (96 * 2, 0.05, 2, True, 0.0),      # under one chunk
    (96 * 300, 0.01, 2, True, 0.1),    # many chunks, escapes
    (96 * 200, 0.004, 2, False, 0.0),
    (96 * 40, 0.05, 1, False, 0.0),
    (96 * 120, 0.01, 1, False, 0.0),
    (96 * 70, 0.03, 4, True, 0.5),
    (96 * 3, 0.0, 4, True, 0.0),
    (96 * 70, 0.02, 4, False, 0.0),
    (96 * 9, 0.1, 8, True, 0.2),
    (96 * 50, 0.02, 8, False, 0.0)]


@pytest.mark.parametrize("index_size", [4, 8])
def test_positions_deltas_apply_as_one_batch(device, monkeypatch, index_size):
    """POSITIONS deltas of 1 to many chunks of positions (chunks of 64 here), 1-8 byte
    elements, with and without DIFF8, escapes, their payloads at odd offsets of one
    message (indexes and values on and off element boundaries), into contiguous
    stretches and column blocks of wider tensors: two launches per element size, DIFF8
    flag and index size for the whole batch, each region bit-exact, bytes outside the
    views untouched. Index size 4 through ``apply_many``, against the torch path's walls;
    8 (boxes past 2**31 elements) through ``launch_positions_many``."""
    dev, calls = device
    monkeypatch.setattr(kernel_apply, "CHUNK", 64)
    pairs, cuts = _batch_cuts(monkeypatch, _POS_BATCH, POSITIONS, 80)
    counts = [c[0] for c in cuts]
    assert min(counts) == 1 and max(counts) > 4 * 64, counts
    walls, views, items = _placed(pairs, cuts, dev)
    before = [w.clone() for w in walls]
    log = _launches(monkeypatch)
    if index_size == 4:
        dt.apply_many(items, [f"region {k}" for k in range(len(pairs))])
        assert "launch_positions_many" in calls
        at = [p.data_ptr() % 4 for _, _, _, p in items]
    else:
        message, spans = _positions_message(cuts, 8)
        message = message.to(dev)
        batch = [(view, count, bool(enc & DIFF8), message[a:a + size], 8)
                 for view, (count, enc, _), (a, size) in zip(views, cuts, spans)]
        pending = kernel_apply.launch_positions_many(batch)
        for p, got in zip(pending, torch.cat([p.figures for p in pending]).view(-1, 2).tolist()):
            p.check(got)
        at = [a % 8 for a, _ in spans]
    assert len(set(at)) > 1, at  # index sections on and off their element boundary
    groups = {(item, diff8) for _, _, item, diff8, _ in _POS_BATCH}
    assert all(log.count(name) == len(groups) for name in ("pos_sums", "apply_index")), log
    _assert_written(pairs, views, walls, before)
    _torch_writes_the_same(monkeypatch, pairs, cuts, walls)


def _positions_payload(positions, values):
    return (torch.tensor(positions, dtype=torch.int32).view(torch.uint8).tolist()
            + [v & 0xFF for v in values])


@pytest.mark.parametrize("count, enc, payload, match", [
    (2, POSITIONS | DIFF8, _positions_payload([3, 500], [1, 1]), "outside its 500-element"),
    (2, POSITIONS | DIFF8, _positions_payload([3, -1], [1, 1]), "outside its 500-element"),
    (2, POSITIONS, _positions_payload([499, 500], [1, 2, 3, 4]), "outside its 500-element"),
    (2, POSITIONS | DIFF8, _positions_payload([3, 4], [-128, 1]), "1 escapes carries 0 bytes"),
    (2, POSITIONS | DIFF8, _positions_payload([3, 4], [1, 1, 1, 2]),
     "0 escapes carries 2 bytes"),
    (2, POSITIONS | DIFF8, _positions_payload([3, 4], [-128, -128, 1, 2]),
     "2 escapes carries 2 bytes")])
def test_bad_positions_deltas_in_a_batch_are_refused_and_the_others_written(
        device, monkeypatch, count, enc, payload, match):
    """Bad POSITIONS deltas among good ones of their element size and DIFF8 flag (one
    batch of ``launch_positions_many``, their chunks in one launch of each kernel): the
    first refused under its label, nothing of either written, every other region of the
    batch written."""
    dev, calls = device
    monkeypatch.setattr(kernel_apply, "CHUNK", 64)
    _forced(monkeypatch, enc)
    pairs = [_pair(n, 0.05, 2, 60 + k, torch.device("cpu"), 0.1) for k, n in
             enumerate((3000, 100, 5000, 300, 700, 2000, 150))]
    cuts = _torch_path(monkeypatch, lambda: [encode(n, o) for n, o in pairs])
    assert all(c[1] == enc for c in cuts)
    bads = [torch.zeros(500, dtype=torch.int16, device=dev) for _ in range(2)]
    views = [old.clone().to(dev) for _, old in pairs]
    items = [(v, c, e, p.to(dev)) for v, (c, e, p) in zip(views, cuts)]
    for at, bad in zip((3, 6), bads):
        items.insert(at, (bad, count, enc, torch.as_tensor(payload, dtype=torch.uint8).to(dev)))
    log = _launches(monkeypatch)
    with pytest.raises(DeltaTransportError, match=f"^region 3: .*{match}"):
        dt.apply_many(items, [f"region {k}" for k in range(len(items))])
    assert "launch_positions_many" in calls and log == ["pos_sums", "apply_index"], log
    assert not any(bool(bad.any()) for bad in bads)
    for (new, _), view in zip(pairs, views):
        assert torch.equal(view.cpu(), new)


def test_a_positions_delta_wrong_on_its_face_is_refused_before_the_batch_launches(device):
    """A POSITIONS + DIFF8 delta shorter than its index and count (``_bad_delta`` on the
    host): refused under its label before any launch, nothing of the batch written."""
    dev, _ = device
    good = torch.zeros(500, dtype=torch.int16, device=dev)
    bad = torch.zeros(500, dtype=torch.int16, device=dev)
    items = [(good, 2, POSITIONS | DIFF8, torch.tensor(_positions_payload([3, 4], [1, 1]),
                                                       dtype=torch.uint8).to(dev)),
             (bad, 2, POSITIONS | DIFF8, torch.tensor(_positions_payload([3, 4], [1]),
                                                      dtype=torch.uint8).to(dev))]
    with pytest.raises(DeltaTransportError,
                       match="^region 1: a delta of 2 differences carries 1 bytes after its "
                             "index"):
        dt.apply_many(items, ["region 0", "region 1"])
    assert not bool(good.any()) and not bool(bad.any())
    with pytest.raises(DeltaTransportError, match="2 differences carries 1 bytes"):
        kernel_apply.launch_positions_many([(v, c, True, p, 4) for v, c, _, p in items])
    assert not bool(good.any())
    dt.apply_many(items[:1])
    assert good[3:5].tolist() == [1, 1] and not bool(good[:3].any())
