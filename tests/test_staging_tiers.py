"""``receiver.staging_tiers`` and ``receiver.staged_deltas`` in one process: the tier plan
under two budgets, a delta region's view mapped from staging onto the live param (odd
strides, offsets, a dtype view), the host tier's device bounce around a receive recipe,
and a staged refit with three tiers whose flip writes each tier's bytes. Over real groups
and a real megatron-core model: tests/test_staged_delta.py."""

import pytest
import torch

from megatron_reshard.delta.encoding import apply, encode
from megatron_reshard.errors import BadInputError
from megatron_reshard.receiver.staged_deltas import StagedDeltas, live_view
from megatron_reshard.receiver.staging import StagedRefits
from megatron_reshard.receiver.staging_tiers import allocate, bounce_host_specs, plan_tiers
from megatron_reshard.receiver.state import WeightState
from megatron_reshard.receiver.worker_state import PrepareOptions
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx
from test_staging import _Writer


def _bytes(*sizes):
    return {n: torch.empty(k, dtype=torch.uint8) for n, k in zip("abcde", sizes)}


def test_the_tiers_are_a_device_prefix_then_a_host_run_then_in_place():
    params = _bytes(100, 50, 20, 30, 10)
    plan = plan_tiers(params, 120, 60)
    # "c" would fit the device budget after "b" is left out: a prefix, not a first fit
    assert (plan.device, plan.host, plan.in_place) == (["a"], ["b"], ["c", "d", "e"])
    plan = plan_tiers(params, 150, 50)
    assert (plan.device, plan.host, plan.in_place) == (["a", "b"], ["c", "d"], ["e"])
    plan = plan_tiers(params, None, 60)  # no bound on the device: no host tier needed
    assert (plan.device, plan.host, plan.in_place) == (list("abcde"), [], [])
    plan = plan_tiers(params, 0, None)   # everything in host memory
    assert (plan.device, plan.host, plan.in_place) == ([], list("abcde"), [])
    plan = plan_tiers(params, 0, 0)
    assert plan.in_place == list("abcde") and plan.tier_of()["c"] == "in_place"


def test_the_host_budget_is_checked_by_name():
    with pytest.raises(BadInputError, match="host_staging_budget_bytes: expected None or an int"):
        PrepareOptions.of({"staged": True, "host_staging_budget_bytes": -5})
    checked = PrepareOptions.of({"staged": True, "host_staging_budget_bytes": 1 << 20})
    assert checked.host_staging_budget_bytes == 1 << 20
    assert "host_staging_budget_bytes" not in checked.session_options()
    assert PrepareOptions.of({}).host_staging_budget_bytes == 0
    with pytest.raises(BadInputError, match="staged_delta_flip: expected one of"):
        PrepareOptions.of({"staged": True, "staged_delta_flip": "scatter"})
    assert PrepareOptions.of({}).staged_delta_flip == "apply"


def test_a_region_of_a_staging_tensor_is_the_same_region_of_the_live_param():
    big = torch.arange(4 * 10 * 6, dtype=torch.float32).reshape(4, 10, 6)
    live = big[1:3, :, 1:5]  # a view with an offset and strides, as vLLM may hold one
    staging = allocate(live, "device")
    assert staging.stride() == live.stride() and staging.shape == live.shape
    staging.copy_(live)
    for view in (staging[1, 2:7, 1:3], staging[:, 3], staging.transpose(0, 2)[2],
                 staging[0].view(torch.int32)[4:6]):
        mapped = live_view(view, staging, live)
        assert mapped.shape == view.shape and mapped.dtype == view.dtype
        assert torch.equal(mapped, view)
        assert mapped.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()


def test_recorded_deltas_apply_into_the_live_param_bit_exact():
    torch.manual_seed(0)
    live = {"w": torch.randn(16, 32).to(torch.bfloat16), "n": torch.randn(32).to(torch.bfloat16)}
    staging = {n: allocate(t, "device") for n, t in live.items()}
    for n in live:
        staging[n].copy_(live[n])
    deltas = StagedDeltas(staging, live)
    new = {n: t.clone() for n, t in live.items()}
    old_n = live["n"].clone()
    new["n"][3] = -2.0
    bits = new["w"].view(torch.int16)
    bits[::3, 5:9] += 1          # one unit in the last place on some elements (DIFF8)
    new["w"][7] = 3.0            # and a few whole new values
    writes = []
    for name, box in (("w", (slice(0, 8), slice(None))), ("w", (slice(8, 16), slice(None))),
                      ("n", (slice(None),))):
        view = staging[name][box]
        count, enc, payload = encode(new[name][box].contiguous(), view.contiguous())
        apply(view, count, enc, payload)  # as the transport does into staging
        writes.append((view, count, enc, payload))
    deltas.record(writes)
    deltas.record([(torch.zeros(3), 0, 0, None)])  # a view of no staging tensor: not kept
    assert len(deltas.regions) == 3 and deltas.targets() == {"w", "n"}
    assert not torch.equal(live["w"], new["w"])  # the live param is still N
    assert deltas.apply(skip=["n"]) == 2
    assert torch.equal(live["w"].view(torch.int16), new["w"].view(torch.int16))
    assert torch.equal(live["n"], old_n)  # skipped: the flip copies it whole instead
    assert deltas.apply(skip=["w"]) == 1 and torch.equal(live["n"], new["n"])


def test_the_host_tier_bounces_a_receive_recipe_through_a_buffer_and_back():
    host = {"p": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    other = torch.zeros(5)
    local_map = HFToLocalParamMap({"hf.p": LocalParamSpec(base=host["p"][1:]),
                                   "hf.q": LocalParamSpec(base=other)})
    tally = {"bounced_bytes": 0}
    assert bounce_host_specs(local_map, host, torch.device("cpu"), tally) == ["hf.p"]
    spec = local_map.specs["hf.p"]
    ctx = spec.begin()
    bounce = ctx.buf
    assert bounce.untyped_storage().data_ptr() != host["p"].untyped_storage().data_ptr()
    assert torch.equal(bounce, host["p"][1:])  # the staged bytes: a delta's base
    bounce.fill_(-1.0)                          # the transfer writes the bounce ...
    assert bool((host["p"][1:] == torch.arange(4, 12.).reshape(2, 4)).all())
    spec.finish(ctx)                            # ... and the post hook copies it back
    assert bool((host["p"][1:] == -1).all()) and bool((host["p"][0] == torch.arange(4.)).all())
    assert tally["bounced_bytes"] == 8 * 4
    assert local_map.specs["hf.q"].pre is None  # not host-staged: untouched


def test_a_bounce_keeps_the_inner_recipes_hooks():
    host = {"p": torch.zeros(4)}
    seen = []

    def pre(base):
        return RefitCtx(buf=torch.empty(4), extra={"base": base})

    def post(ctx):
        seen.append(ctx.buf.clone())
        ctx.extra["base"].copy_(ctx.buf * 2)

    local_map = HFToLocalParamMap({"hf.p": LocalParamSpec(base=host["p"], pre=pre, post=post)})
    bounce_host_specs(local_map, host, torch.device("cpu"), {"bounced_bytes": 0})
    ctx = local_map.specs["hf.p"].begin()
    ctx.buf.fill_(3.0)
    local_map.specs["hf.p"].finish(ctx)
    assert torch.equal(seen[0], torch.full((4,), 3.0)) and torch.equal(host["p"], torch.full((4,), 6.0))


def test_a_staged_refit_over_three_tiers_reports_them_and_flips_each():
    live, state = {"a": torch.zeros(4), "b": torch.zeros(8), "c": torch.zeros(2)}, WeightState(1)
    stager = StagedRefits(live, state, budget_bytes=4 * 4, host_budget_bytes=8 * 4)
    assert (stager.tiers.device, stager.tiers.host, stager.in_place) == (["a"], ["b"], ["c"])
    report = stager.state()["tiers"]
    assert report["device"] == {"params": 1, "budget_bytes": 16, "bytes": 16}
    assert report["host"]["params"] == 1 and report["host"]["bytes"] == 32
    assert report["host"]["pinned"] is False  # CPU: host memory, nothing to pin
    assert report["in_place"]["bytes"] == 8
    session = _Writer(stager, stager.targets(live.items()), 4.0, 2)
    session.release.set()
    stager.start(session)
    assert stager.wait(10)["phase"] == "waiting_for_pause"  # "c" waits for the pause
    assert all(bool((t == 0).all()) for t in live.values())
    out = stager.flip()
    assert all(bool((t == 4).all()) for t in live.values()) and state.version == 2
    assert out["staged"]["flip_copy_bytes"] == 16 + 32


def test_a_flip_that_fails_while_writing_says_the_live_weights_are_inconsistent():
    from megatron_reshard.receiver.staging import StagedRefitError

    live, state = {"a": torch.zeros(4), "b": torch.zeros(8)}, WeightState(1)
    stager = StagedRefits(live, state)
    session = _Writer(stager, stager.targets(live.items()), 2.0, 2)
    session.release.set()
    stager.start(session)
    stager.wait(10)
    stager.staging["b"] = torch.zeros(3)  # a copy that cannot happen (a fault mid-flip)
    with pytest.raises(StagedRefitError, match="the live weights are inconsistent"):
        stager.flip()
    assert not state.consistent and state.overwritten == {"a", "b"} and state.version == 1
    assert "the flip failed" in state.last_error
