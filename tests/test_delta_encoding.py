"""The delta encodings (delta.encoding) and the mode vote (refit.delta_vote), one process.

Each encoding is cut from a real (new, old) pair and applied to a copy of ``old`` held in a
strided view of a larger tensor: the result must equal ``new`` bit for bit, including NaN
payloads and -0.0 (bits are compared as integers), and the bytes outside the view must
stay untouched.
"""

import pytest
import torch

from megatron_reshard.refit.commit import NO_VERSION
from megatron_reshard.delta import DeltaConfig
from megatron_reshard.refit.delta_vote import decide_mode, dst_vote, src_vote
from megatron_reshard.delta.encoding import (apply, encode, encoding_sizes, header_problem,
                                             payload_bytes, pick_encoding)
from megatron_reshard.delta.wire_format import (BITMASK, DENSE, DIFF8, GAPS, NONE, POSITIONS,
                                                DeltaTransportError, encoding_name)


def _bits(t):
    return t.contiguous().view(torch.int16)


def _pair(shape, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g).to(torch.bfloat16)
    new = old.clone()
    pick = torch.rand(shape, generator=g) < fraction
    new[pick] = new[pick] * 3 + 1
    return new, old


def _ulp_pair(shape, fraction, seed):
    """What an optimizer step at RL learning rates does to BF16: ±1 unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g).to(torch.bfloat16)
    pick = torch.rand(shape, generator=g) < fraction
    step = torch.where(torch.rand(shape, generator=g) < 0.5, 1, -1).to(torch.int16)
    new = (_bits(old) + step * pick.to(torch.int16)).view(torch.bfloat16)
    return new, old


def _mixed_pair(shape, fraction, seed):
    """±1 ulp steps, and a few weights crossing zero (a difference no byte holds)."""
    new, old = _ulp_pair(shape, fraction, seed)
    flat = new.view(-1)
    flat[::997] = -flat[::997]
    return new, old


CASES = [  # (pair maker, fraction, expected encoding)
    (_pair, 0.0, NONE), (_pair, 0.0005, POSITIONS), (_pair, 0.02, GAPS), (_pair, 0.3, BITMASK),
    (_pair, 1.0, DENSE), (_ulp_pair, 0.02, GAPS | DIFF8), (_ulp_pair, 0.4, BITMASK | DIFF8),
    (_ulp_pair, 0.0005, POSITIONS | DIFF8), (_mixed_pair, 0.02, GAPS | DIFF8),
    (_mixed_pair, 0.4, BITMASK | DIFF8)]


@pytest.mark.parametrize("make,fraction,expected", CASES)
@pytest.mark.parametrize("rows", [240, 3])  # 3 x 40 / 8: an odd-sized bitmask before the values
def test_each_encoding_lands_bit_exact_in_a_strided_view(make, fraction, expected, rows):
    new, old = make((rows, 40), fraction, 7)
    if fraction and make is _pair:  # bits a float compare would miss: NaN payloads, signed 0
        new.view(-1)[3] = float("nan")
        new.view(-1)[5] = -0.0
        old.view(-1)[5] = 0.0
    count, enc, payload = encode(new, old)
    if rows == 240:  # the small box picks by its own sizes
        assert enc == expected, (encoding_name(enc), encoding_name(expected))
    assert count == int((_bits(new) != _bits(old)).sum())
    nbytes = 0 if payload is None else payload.numel()
    assert header_problem(new.numel(), 2, count, enc, nbytes) == ""
    if count:  # the smallest encoding, its sizes worked out here
        pos = (_bits(new) != _bits(old)).reshape(-1).nonzero().reshape(-1)
        skips = int(((torch.diff(pos, prepend=torch.tensor([-1])) - 1) // 255).sum())
        step = _bits(new).reshape(-1)[pos].int() - _bits(old).reshape(-1)[pos].int()
        escapes = int(((step < -127) | (step > 127)).sum())
        assert nbytes == min(encoding_sizes(new.numel(), count, 2, skips, escapes).values())
    # the destination: old's bits in the odd columns of a wider tensor
    host = torch.full((rows, 80), 7.0, dtype=torch.bfloat16)
    view = host[:, 1::2]
    view.copy_(old)
    apply(view, count, enc, payload)
    assert torch.equal(_bits(view), _bits(new))
    assert torch.equal(_bits(host[:, 0::2]), _bits(torch.full((rows, 40), 7.0,
                                                               dtype=torch.bfloat16)))


def test_gaps_skip_long_distances_and_land_at_both_ends():
    old = torch.zeros(5000, dtype=torch.float32)
    new = old.clone()
    new[[0, 1, 255, 256, 600, 1300]] = torch.tensor([1.0, -2.0, 3.0, float("inf"), 5.0, 6.0])
    count, enc, payload = encode(new, old)
    assert (count, enc & 7) == (6, GAPS)
    assert payload.numel() == 6 + 1 + 2 + 6 * 4  # gaps, 1 + 2 skip bytes, fp32 values
    view = old.clone()
    apply(view, count, enc, payload)
    assert torch.equal(view.view(torch.int32), new.view(torch.int32))


def test_the_cheapest_encoding_is_picked():
    assert pick_encoding(1000, 0, 2) == NONE
    assert pick_encoding(1000, 10, 2) == GAPS                  # 30 bytes vs 60 vs 145 vs 2000
    assert pick_encoding(1000, 10, 2, skips=40) == POSITIONS   # 70 vs 60
    assert pick_encoding(1000, 10, 2, escapes=0) == GAPS | DIFF8  # 20 bytes
    assert pick_encoding(1000, 100, 2, skips=0) == GAPS        # 300 vs 325
    assert pick_encoding(1000, 400, 2) == BITMASK              # 925 vs 1200
    assert pick_encoding(1000, 950, 2) == DENSE                # 2000 vs 2025
    assert pick_encoding(7, 1, 4) == BITMASK  # 5 bytes, as GAPS: a tie goes to the simpler


def test_the_picked_encoding_is_the_least_of_the_sizes_with_its_ties():
    """``pick_encoding`` against a search of ``encoding_sizes``: the least bytes, ties to
    the simpler kind (dense, bitmask, positions, gaps), whole values before DIFF8; small
    boxes so that ties are common."""
    order = (NONE, DENSE, BITMASK, POSITIONS, GAPS)
    seen = set()
    for numel in (1, 7, 8, 9, 40, 1000):
        for count in range(0, min(numel, 40) + 1):
            for itemsize in (1, 2, 4):
                for skips in (0, 1, 3):
                    for escapes in (None, 0, 1, count):
                        sizes = encoding_sizes(numel, count, itemsize, skips, escapes)
                        want = min(sizes, key=lambda k: (sizes[k], order.index(k & 7),
                                                         k & DIFF8))
                        got = pick_encoding(numel, count, itemsize, skips, escapes)
                        assert got == want, (numel, count, itemsize, skips, escapes, sizes)
                        seen.add(got)
    assert seen == {NONE, DENSE, BITMASK, POSITIONS, GAPS, BITMASK | DIFF8,
                    POSITIONS | DIFF8, GAPS | DIFF8}, seen


@pytest.mark.parametrize("count,enc,nbytes,why", [
    (3, 7, 100, "unknown encoding"), (3, 20, 100, "unknown encoding"),
    (0, GAPS, 0, "count 0"), (2000, POSITIONS, 12000, "count 2000"),
    (3, POSITIONS, 17, "17 payload bytes, expected 18"), (3, GAPS, 8, "expected 9"),
    (3, DENSE | DIFF8, 2000, "unknown encoding"), (5, DENSE, 1999, "expected 2000")])
def test_a_header_that_cannot_fit_its_box_is_named(count, enc, nbytes, why):
    assert why in header_problem(1000, 2, count, enc, nbytes)


def test_a_payload_that_reaches_outside_its_box_is_refused():
    old = torch.zeros(100, dtype=torch.bfloat16)
    count, enc, payload = encode(old + 1, old)  # dense
    bad = torch.tensor([5, 200], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(DeltaTransportError, match="outside its 100-element box"):
        apply(old.clone(), 2, POSITIONS, torch.cat([bad, payload[:4]]))
    with pytest.raises(DeltaTransportError, match="reaching past"):
        apply(old.clone(), 1, GAPS, torch.tensor([0, 0, 1, 7, 7], dtype=torch.uint8))
    mask = torch.zeros(13, dtype=torch.uint8)
    mask[12] = 0xF0  # bits 100..103: past the box
    with pytest.raises(DeltaTransportError, match="past the box: 4"):
        apply(old.clone(), 4, BITMASK, torch.cat([mask, torch.zeros(8, dtype=torch.uint8)]))


def test_a_diff8_delta_short_of_its_differences_is_refused_unwritten():
    old = torch.zeros(100, dtype=torch.bfloat16)
    view = old.clone()
    gaps = torch.tensor([1, 2, 3], dtype=torch.uint8)  # positions 0, 2, 5
    with pytest.raises(DeltaTransportError, match="3 differences carries 2 bytes"):
        apply(view, 3, GAPS | DIFF8, torch.cat([gaps, torch.tensor([1, 1], dtype=torch.uint8)]))
    assert torch.equal(view, old)


def _reduce(*rows):
    return [max(col) for col in zip(*rows)]


def test_the_vote_gives_delta_only_with_every_base_at_one_version():
    ready_src, ready_dst = src_vote(True, 0, 5), dst_vote(0, 5)
    got = decide_mode(_reduce(ready_src, ready_src, ready_dst, ready_dst), "g")
    assert (got.mode, got.full_reason, got.base) == ("delta", None, 5)
    cases = {
        "delta refits are off": [src_vote(False, 0, None), ready_dst],
        "disagree on delta": [ready_src, src_vote(False, 0, None), ready_dst],
        "holds no base yet": [src_vote(True, 1, None), ready_dst],
        "over its budget": [src_vote(True, 2, 5), ready_dst],
        "different versions: 4 .. 5": [ready_src, src_vote(True, 0, 4), ready_dst],
        "inconsistent": [ready_src, ready_dst, dst_vote(2, 5)],
        "base versions differ": [ready_src, ready_dst, dst_vote(0, 4)],
    }
    for text, rows in cases.items():
        got = decide_mode(_reduce(*rows), "g")
        assert got.mode == "full" and text in got.full_reason, (text, got)


def test_delta_config_checks_its_fields():
    assert DeltaConfig.of(False) is None and DeltaConfig.of(True) == DeltaConfig()
    with pytest.raises(ValueError, match="keep"):
        DeltaConfig(keep="disk")
    with pytest.raises(ValueError, match="budget_bytes"):
        DeltaConfig(budget_bytes=-1)
    with pytest.raises(ValueError, match="delta must be"):
        DeltaConfig.of("yes")
    assert src_vote(False, 0, None)[3] == NO_VERSION
