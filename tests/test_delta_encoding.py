"""The delta encodings (refit.delta_transport) and the mode vote (refit.delta), one process.

Each encoding is cut from a real (new, old) pair and applied to a copy of ``old`` held in a
strided view of a larger tensor: the result must equal ``new`` bit for bit, including NaN
payloads and -0.0 (bits are compared as integers), and the bytes outside the view must
stay untouched.
"""

import pytest
import torch

from megatron_reshard.refit.commit import NO_VERSION
from megatron_reshard.refit.delta import (DeltaConfig, decide_mode, dst_vote, src_vote)
from megatron_reshard.refit.delta_transport import (BITMASK, DENSE, NONE, POSITIONS, apply,
                                                    encode, payload_bytes, pick_encoding)


def _bits(t):
    return t.contiguous().view(torch.int16)


def _pair(shape, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g).to(torch.bfloat16)
    new = old.clone()
    pick = torch.rand(shape, generator=g) < fraction
    new[pick] = new[pick] * 3 + 1
    return new, old


@pytest.mark.parametrize("fraction,expected", [(0.0, NONE), (0.01, POSITIONS), (0.3, BITMASK),
                                               (1.0, DENSE)])
@pytest.mark.parametrize("rows", [24, 3])  # 3 x 40 / 8: an odd-sized bitmask before the values
def test_each_encoding_lands_bit_exact_in_a_strided_view(fraction, expected, rows):
    new, old = _pair((rows, 40), fraction, 7)
    if fraction:  # bits a float compare would miss: NaN payloads and signed zeros
        new.view(-1)[3] = float("nan")
        new.view(-1)[5] = -0.0
        old.view(-1)[5] = 0.0
    count, enc, payload = encode(new, old)
    assert enc == expected
    assert count == int((_bits(new) != _bits(old)).sum())
    assert (0 if payload is None else payload.numel()) == payload_bytes(new.numel(), count, enc, 2)
    # the destination: old's bits in the odd columns of a wider tensor
    host = torch.full((rows, 80), 7.0, dtype=torch.bfloat16)
    view = host[:, 1::2]
    view.copy_(old)
    apply(view, count, enc, payload)
    assert torch.equal(_bits(view), _bits(new))
    assert torch.equal(_bits(host[:, 0::2]), _bits(torch.full((rows, 40), 7.0,
                                                               dtype=torch.bfloat16)))


def test_the_cheapest_encoding_is_picked():
    assert pick_encoding(1000, 0, 2) == NONE
    assert pick_encoding(1000, 10, 2) == POSITIONS      # 60 bytes vs 145 vs 2000
    assert pick_encoding(1000, 100, 2) == BITMASK       # 325 vs 600 vs 2000
    assert pick_encoding(1000, 950, 2) == DENSE         # 2000 vs 2025
    assert pick_encoding(7, 1, 4) == BITMASK            # 5 bytes vs 8 vs 28


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
