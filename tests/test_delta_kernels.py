"""The GPU cut and apply of delta refits (``refit/delta_kernels.py``) against the torch path
of ``refit.delta_transport`` (the oracle): payloads byte for byte, every encoding, element
sizes 1-8 (values after an odd-sized bitmask or positions move as bytes), NaN payloads and
-0.0, strided destination views (bytes outside untouched), bad deltas refused. The kernel
tests run on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` with Triton installed;
else they skip. ``rows_form`` is index math: CPU."""

import os

import pytest
import torch

from megatron_reshard.refit import delta_kernels
from megatron_reshard.refit.delta_kernels import Rows, rows_form
from megatron_reshard.refit.delta_transport import (BITMASK, DENSE, NONE, POSITIONS,
                                                    DeltaTransportError, apply, encode,
                                                    payload_bytes)

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
    dev = _device()
    if dev.type == "cpu":  # the interpreter runs the kernels on CPU tensors
        monkeypatch.setattr(delta_kernels, "usable", lambda t: True)
    return dev


def _pair(n, fraction, itemsize, seed, device):
    """(new, old) as integer bits: random old (NaN payloads and -0.0 among bf16), new with
    ``fraction`` of the elements flipped in their lowest bit."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g).view(INTS[itemsize])
    if itemsize == 2:
        old[:4] = torch.tensor([0x7F81, -0x8000, 0x7FC1, 0], dtype=torch.int16)
    new = old.clone()
    pick = torch.rand(n, generator=g) < fraction
    new[pick] ^= 1
    return new.to(device), old.to(device)


def _as(x, itemsize):
    return x.view({2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(itemsize, x.dtype))


def _reference(new, old, monkeypatch):
    monkeypatch.setenv("MEGATRON_RESHARD_DELTA_KERNELS", "0")
    try:
        return encode(new, old)
    finally:
        monkeypatch.delenv("MEGATRON_RESHARD_DELTA_KERNELS")


@pytest.mark.parametrize("n, fraction, itemsize", [
    (10_000, 0.001, 2), (9_001, 0.05, 2), (5_003, 0.3, 4), (777, 0.02, 8), (333, 0.5, 1),
    (4096 * 3, 0.0, 2), (1000, 1.0, 2)])
def test_cut_and_apply_match_the_torch_path_bit_for_bit(device, monkeypatch, n, fraction, itemsize):
    new, old = _pair(n, fraction, itemsize, n, device)
    new, old = _as(new, itemsize), _as(old, itemsize)
    want = _reference(new.cpu(), old.cpu(), monkeypatch)
    got = encode(new, old)
    assert got[:2] == want[:2]
    assert (got[2] is None) == (want[2] is None)
    if want[2] is not None:
        assert torch.equal(got[2].cpu(), want[2])
    count, enc, payload = got
    # applied into a column block of a wider tensor: only the view changes
    wide = torch.zeros(3, n + 5, dtype=new.dtype, device=device)
    view = wide[:, 2:n + 2][1]
    view.copy_(old)
    before = wide.clone()
    apply(view, count, enc, payload)
    assert torch.equal(view.view(INTS[itemsize]).cpu(), new.view(INTS[itemsize]).cpu())
    rest = torch.ones_like(wide, dtype=torch.bool)
    rest[1, 2:n + 2] = False
    assert torch.equal(wide.view(INTS[itemsize])[rest].cpu(), before.view(INTS[itemsize])[rest].cpu())


@pytest.mark.parametrize("cols", [90, 96])  # rows of the view cut tile rows of 8, or not
@pytest.mark.parametrize("forced", [POSITIONS, BITMASK, DENSE])
def test_every_encoding_applies_into_a_strided_view(device, monkeypatch, forced, cols):
    """Each encoding forced (the cheapest is not always the one under test), cut by the
    kernels, applied into a [rows, cols] block of a wider tensor."""
    import megatron_reshard.refit.delta_transport as dt

    new, old = _pair(64 * cols, 0.03, 2, 7, device)
    new, old = _as(new, 2).view(64, cols), _as(old, 2).view(64, cols)
    monkeypatch.setattr(dt, "pick_encoding", lambda numel, count, item: forced)
    count, enc, payload = encode(new, old)
    assert enc == forced and payload.numel() == payload_bytes(new.numel(), count, enc, 2)
    wide = torch.zeros(64, 128, dtype=new.dtype, device=device)
    view = wide[:, 16:16 + cols]
    view.copy_(old)
    apply(view, count, enc, payload)
    assert torch.equal(view.view(torch.int16).cpu(), new.view(torch.int16).cpu())
    assert not bool(wide[:, :16].view(torch.int16).any())
    assert not bool(wide[:, 16 + cols:].view(torch.int16).any())


def test_bad_deltas_are_refused(device):
    view = torch.zeros(100, dtype=torch.bfloat16, device=device)
    positions = torch.tensor([3, 100], dtype=torch.int32).view(torch.uint8)
    values = torch.tensor([1.0, 2.0], dtype=torch.bfloat16).view(torch.uint8)
    with pytest.raises(DeltaTransportError, match="1 of 2 positions fall outside"):
        apply(view, 2, POSITIONS, torch.cat([positions, values]).to(device))
    mask = torch.zeros(13, dtype=torch.uint8)
    mask[0] = 0b101  # two bits set, the header says three
    with pytest.raises(DeltaTransportError, match="sets 2 bits but its header says 3"):
        apply(view, 3, BITMASK, torch.cat([mask, torch.zeros(6, dtype=torch.uint8)]).to(device))
    assert not bool(view.view(torch.int16)[:3].any())  # nothing of the bitmask was written
    assert enc_none_is_a_no_op(view)


def enc_none_is_a_no_op(view) -> bool:
    before = view.clone()
    apply(view, 0, NONE, None)
    return torch.equal(before.view(torch.int16), view.view(torch.int16))
