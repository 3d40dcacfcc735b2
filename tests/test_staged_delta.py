"""Staged delta refits and the host staging tier (issue 53), with real processes: the
harness of tests/test_staged_refit.py (a real megatron-core dense model, PP2 on 2 training
ranks, 2 generation ranks TP2 behind the worker extension prepared ``{"staged": True}``,
gloo, checksums on).

- A delta refit's payloads are kept and applied into the live params at the flip: the
  flip copies only what went full and applies the deltas of the rest, and every param is
  bit-exact against the reference after it (and untouched before it).
- A fault in the middle of a staged delta refit leaves version N live and consistent.
- With a host tier (``host_staging_budget_bytes``) the params are split device / host /
  in place in model order within both budgets, reported per tier, received through the
  device bounce, and bit-exact after the flip (on CPU the "pinned" host memory is plain
  host memory: the tier choice, its accounting and the result are what is checked).
"""

import pytest

from test_staged_refit import GEN, TRAIN, _check_row_exact, _run, _survivors_hold_n
from megatron_reshard.tools.worlds import RankFailure

pytestmark = pytest.mark.slow


def test_a_staged_delta_refit_applies_its_payloads_at_the_flip(pool):
    results = _run(pool, refits=3, delta=True, tag="sdelta", seed=11)
    for r in range(TRAIN):
        assert results[r]["error"] is None, results[r]
        assert [row["mode"] for row in results[r]["rows"]] == ["full", "delta", "delta"]
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["error"] is None, gen
        full, *deltas = gen["rows"]
        _check_row_exact(gen, full)
        assert full["flip"]["flip_copy_bytes"] == full["staging_bytes"]  # a full refit: all
        assert full["flip"]["flip_delta_regions"] == 0
        for row in deltas:
            assert row["mode"] == "delta", row
            _check_row_exact(gen, row)  # N before the flip, N+1 bit-exact after it
            flip = row["flip"]
            # the payloads travelled to the flip and were applied there ...
            assert flip["flip_delta_regions"] > 0 and flip["staged_delta_payload_bytes"] > 0
            assert flip["flip_delta_targets"] > 0
            # ... instead of a copy of every staged byte (what goes full is copied whole)
            assert flip["flip_copy_bytes"] < row["staging_bytes"], flip
            assert flip["flip_bytes"] < row["staging_bytes"] // 4, flip
        assert gen["state"]["state"] == "consistent" and gen["state"]["version"] == 3


def test_a_delta_refit_can_flip_as_a_copy_of_the_staged_params(pool):
    results = _run(pool, refits=2, delta=True, tag="sdeltacopy", seed=14, delta_flip="copy")
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["error"] is None, gen
        row = gen["rows"][1]
        assert row["mode"] == "delta" and row["flip"]["delta_flip"] == "copy"
        _check_row_exact(gen, row)
        assert row["flip"]["flip_copy_bytes"] == row["staging_bytes"]
        assert row["flip"]["flip_delta_regions"] == 0


def test_a_fault_inside_a_staged_delta_refit_leaves_n_live_and_consistent(pool):
    results = _run(pool, refits=2, delta=True, tag="sdeltakill", seed=12, victim=1,
                   fault="kill_mid")
    assert isinstance(results[1], RankFailure), results[1]
    _survivors_hold_n(results, 1, 1)
    for r in range(TRAIN, TRAIN + GEN):  # the payloads received are dropped, never applied
        assert results[r]["state"]["staged"]["staged_delta_regions"] == 0


def test_the_host_tier_takes_what_the_device_budget_leaves_within_its_own(pool):
    device, host = 48 * 1024, 96 * 1024
    results = _run(pool, refits=2, delta=True, tag="hosttier", seed=13, budget=device,
                   host_budget=host)
    for r in range(TRAIN, TRAIN + GEN):
        gen = results[r]
        assert gen["error"] is None, gen
        for row in gen["rows"]:
            tiers = row["flip"]["tiers"]
            assert tiers["device"]["params"] > 0 and tiers["host"]["params"] > 0, tiers
            assert tiers["in_place"]["params"] > 0, tiers
            assert tiers["device"]["bytes"] <= device and tiers["host"]["bytes"] <= host
            assert tiers["device"]["budget_bytes"] == device
            assert tiers["host"]["budget_bytes"] == host
            assert tiers["host"]["bounced_params"] > 0
            assert row["staging_bytes"] == tiers["device"]["bytes"] + tiers["host"]["bytes"]
            assert row["flip"]["in_place_bytes"] == tiers["in_place"]["bytes"]
            assert row["waited_phase"] == "waiting_for_pause"
            _check_row_exact(gen, row)
        # a bounced param is held through a hook: the delta vote goes full (documented)
        assert [row["mode"] for row in gen["rows"]] == ["full", "full"]
        assert gen["state"]["state"] == "consistent" and gen["state"]["version"] == 2
