"""A short soak (issue 52): a few dozen refits between a long-lived training world (real
megatron-core, dense then MoE, Adam steps) and a generation world (TP2), a handful of
faults from a fixed seed at random phases, every invariant checked after every refit and
fault (``megatron_reshard.tools.soak``); plus the checks themselves on hand-made replies,
so that each can be seen to fail."""

import pytest
import torch

from megatron_reshard.tools.soak import FAULTS, ISSUE_50, SoakConfig, run_soak
from megatron_reshard.tools.soak_checks import (Tally, check_delta_base, check_survivor,
                                                check_version, check_weights, slope)

pytestmark = pytest.mark.slow

REFITS, FAULTS_WANTED = 24, 8


@pytest.fixture(scope="module")
def report():
    # checksums off (the README's default): a delta over a base written behind the
    # library's back then stays silent until issue 50 is fixed, which the soak must see
    cfg = SoakConfig(refits=REFITS, faults=FAULTS_WANTED, seed=3, gen=2, timeout_s=5.0,
                     models=("dense", "moe"), switch_every=12, sample_every=4, ckpt_every=3,
                     kinds=FAULTS, checksums="off", quiet=True,
                     settle_samples=False)  # the leak figures are the long soak's
    return run_soak(cfg)


def _violations_after(report, causes_excluded=(), only=None):
    out = {}
    for counter, by_cause in report["violations_by_fault"].items():
        for cause, n in by_cause.items():
            base = cause.split()[0]
            if base in causes_excluded or (only is not None and base not in only):
                continue
            out[(counter, cause)] = n
    return out


def test_a_short_soak_runs_its_refits_and_faults_and_breaks_no_invariant(report):
    assert report["aborted"] is None, report["aborted"]
    assert report["refits"] >= REFITS and report["faults"] >= FAULTS_WANTED, report
    assert report["modes"].get("full") and report["modes"].get("delta"), report["modes"]
    c = report["counters"]
    assert c["weights_exact"] > REFITS and c["versions_checked"] > REFITS, c
    assert c["survivor_in_time"] > 0 and c["survivor_named_cause"] == c["survivor_in_time"], c
    assert report["hangs"] == 0, report["examples"]
    # every invariant held after the other faults; issue 50's two: the next test
    assert _violations_after(report, causes_excluded=ISSUE_50) == {}, report["examples"]
    # leak samples were taken on every long-lived rank
    assert {"gen", "train"} <= set(report["leaks"]), report["leaks"]
    for role in ("gen", "train"):
        figures = report["leaks"][role]["figures"]
        assert {"fds", "sockets", "threads", "rss_mib", "rss_trimmed_mib"} <= set(figures), role
        assert all("band_2se" in f and "flat" in f for f in figures.values()), figures
    # the host's shared memory left by dead ranks (measured here; unsettled samples may catch
    # a dead rank's manager before it unlinks: tests/test_soak_leaks.py checks it), and what
    # failed groups left per fault
    assert "orphan_segments" in report["leaks"]["host"]["figures"], report["leaks"]
    assert report["failed_group_leftovers"]["faults_measured"] > 0, report["failed_group_leftovers"]
    # RSS growth told apart by event (tools.soak_growth): the generation ranks live across
    # the model switch at refit 12, so refits, faults and the switch each get a share
    left = report["failed_group_leftovers"]
    assert any(w["switches"] for w in left["growth_windows"]), left["growth_windows"]
    gen = left["growth_by_event"]["gen"]["rss_trimmed_mib"]
    assert all(gen[e] is not None and gen[e][1] >= 0
               for e in ("per_1000_refits", "per_fault", "per_switch")), gen


def test_issue_50_faults_leave_no_silent_outcome(report):
    assert report["faults_by_kind"].get("params_moved") or report["faults_by_kind"].get("tamper_gen")
    assert _violations_after(report, only=ISSUE_50) == {}, report["examples"]


# ----------------------------------------------------------- the checks on hand-made replies

REFS = {3: {0: {"a": "x3", "b": "y3"}}, 4: {0: {"a": "x4", "b": "y4"}}}


def _reply(state, version, after, overwritten=(), before=None, mode="full"):
    return {"state": {"state": state, "version": version, "started_from": version,
                      "overwritten": list(overwritten)}, "after": after,
            "before": before or {}, "mode": mode}


def test_a_consistent_state_over_other_bytes_is_counted_silent():
    tally = Tally()
    assert check_weights(tally, 0, _reply("consistent", 4, {"a": "x4", "b": "y4"}), REFS, (), None, "t")
    assert not check_weights(tally, 0, _reply("consistent", 4, {"a": "x4", "b": "y3"}), REFS, (),
                             "tamper_gen", "t")
    assert tally.counts["silent_wrong_weights"] == 1 and tally.counts["weights_exact"] == 1
    assert tally.silent_by_fault == {"tamper_gen": 1}
    assert tally.violations() == {"silent_wrong_weights": 1}


def test_an_inconsistent_state_must_keep_what_it_does_not_list():
    tally = Tally()
    # b overwritten and listed: fine; a unlisted but changed: the state lies
    assert check_weights(tally, 0, _reply("inconsistent", 3, {"a": "x3", "b": "zz"}, ["b"]),
                         REFS, (), None, "t")
    assert not check_weights(tally, 0, _reply("inconsistent", 3, {"a": "zz", "b": "y3"}, ["b"]),
                             REFS, (), None, "t")
    # unless the soak wrote it itself behind the library's back
    assert check_weights(tally, 0, _reply("inconsistent", 3, {"a": "zz", "b": "y3"}, ["b"]),
                         REFS, {"a"}, None, "t")
    assert tally.counts["inconsistent_state_wrong"] == 1


def test_versions_delta_bases_and_survivors_are_checked():
    tally = Tally()
    assert check_version(tally, 4, {"version": 5}, "t") == 5
    check_version(tally, 5, {"version": 4}, "t")
    assert tally.counts["version_decreased"] == 1
    check_delta_base(tally, 0, _reply("consistent", 4, {}, before={"a": "x3", "b": "y3"},
                                      mode="delta"), REFS, 3, "t")
    check_delta_base(tally, 0, _reply("consistent", 4, {}, before={"a": "x3", "b": "y9"},
                                      mode="delta"), REFS, 3, "t")
    assert tally.counts["delta_onto_wrong_base"] == 1 and tally.counts["delta_base_checked"] == 1
    check_survivor(tally, "gen0", {"error": "PeerFailure: train rank 0 failed", "at": 11.0}, 10.0,
                   5.0, "t")
    check_survivor(tally, "gen1", {"error": "RefitTimeout: gave no sign of life", "at": 21.0},
                   10.0, 5.0, "t")
    check_survivor(tally, "gen1", {"error": "RuntimeError: boom", "at": 10.5}, 10.0, 5.0, "t")
    check_survivor(tally, "train", None, 10.0, 5.0, "t")
    assert tally.counts["survivor_late"] == 1 and tally.counts["survivor_no_cause"] == 1
    assert tally.counts["survivor_no_error"] == 1 and tally.counts["survivor_in_time"] == 2


def test_leak_slope_is_least_squares():
    assert slope([(0, 1.0), (10, 2.0), (20, 3.0)]) == pytest.approx(0.1)
    assert slope([(0, 1.0), (10, 1.0)]) is None


# ------------------------------------------- what the soak found: destroyed groups kept alive


def _groups_let_go(job):
    """Three refit groups in turn (train 1 + gen 2, delta refits on), each destroyed after a
    refit, with the cyclic garbage collector off: how many ``RefitGroup`` objects are left
    alive on this rank once the last one is destroyed and dropped."""
    import gc
    import weakref

    import torch.distributed as dist

    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.tools.soak_rank import _Worker
    from megatron_reshard.tools.tiny_source import tiny_source
    from megatron_reshard.wire.codec import decode_payload

    control = dist.TCPStore(job.host, job.ports[0], 3, job.rank == 0)
    gc.collect()
    gc.disable()  # what a long-lived process sees between two runs of the cyclic collector
    try:
        if job.rank == 0:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            _, source, _, _ = tiny_source("dense", 2)
            control.set("payload", source.payload_bytes())
        else:
            payload = decode_payload(control.get("payload"))
            worker = _Worker(build_vllm_like_model(payload["hf_config"], job.rank - 1, 2, 1),
                             job.rank - 1, 2)
        kept = []
        for port in job.ports[1:4]:
            if job.rank == 0:
                group = create_refit_group(job.host, port, 0, 3, "gloo", 30.0)
                sender = RefitSender(source, group, delta=True)
                sender.refit()
                kept.append(weakref.ref(group))
                destroy_refit_group(group)
                del group, sender
            else:
                worker.init_refit_groups(job.host, [port], job.rank, 3, "gloo", 30.0)
                worker.prepare_refit(payload)
                worker.refit()
                kept.append(weakref.ref(worker.refit_worker_state.groups[0]))
                worker.destroy_refit_groups()
        return sum(ref() is not None for ref in kept)
    finally:
        gc.enable()


def test_a_destroyed_refit_group_is_let_go_without_the_cyclic_collector(pool):
    # the delta sender's base maker was a closure over the sender, kept by the sender's own
    # loop: a cycle that held every destroyed group (its store's thread and sockets on the
    # training rank) until the cyclic collector ran; the soak saw the store host's threads
    # and sockets climb with each rebuild
    alive = pool.run(_groups_let_go, 3, num_ports=4, timeout_s=240)
    assert alive == [0, 0, 0], alive


# ------------------------------------------ a model switch takes the model built before


def _model_turns(job):
    """One soak rank's turns, as model switches give them: dense, MoE, dense again, on the
    training side and on a generation rank; what the second dense turn got."""
    from megatron_reshard.tools.soak_rank import GenRank, Shelf, TrainRank
    from megatron_reshard.wire.codec import decode_payload

    def turn(model):
        train = TrainRank(None, model=model, gen=2, device="cpu", seed=0)
        gen = GenRank(None, gen_rank=0, gen=2, device="cpu", model=model,
                      payload=decode_payload(train.describe()["payload"]))
        return train, gen

    try:
        train, gen = turn("dense")
        train.step(lr=1e-3)
        stepped = {n: p.detach().clone() for n, p in train.model.named_parameters()}
        with torch.no_grad():  # what a refit leaves: weights, not the build's NaN
            for p in gen.model.parameters():
                p.zero_()
        turn("moe")
        train2, gen2 = turn("dense")
        floats = [p for p in gen2.model.parameters() if p.dtype.is_floating_point]
        rebuilt = TrainRank(None, model="dense", gen=2, device="cpu", seed=0, rebuild=True)
        return {"train_model_reused": train2.model is train.model,
                "source_reused": train2.source is train.source,
                "weights_kept": all(torch.equal(p, stepped[n])
                                    for n, p in train2.model.named_parameters()),
                "steps_kept": getattr(getattr(train2, "turn", None), "steps", 0),
                "gen_model_reused": gen2.model is gen.model,
                "gen_as_built": bool(floats) and all(bool(p.isnan().all()) for p in floats),
                "new_worker": gen2.worker is not gen.worker,
                "rebuilt_on_request": rebuilt.model is not train.model and rebuilt.turn.steps == 0}
    finally:
        Shelf.turns.clear()  # this pool worker runs other tests next


def test_a_model_switch_takes_the_model_this_process_built_before(pool):
    # the soak rebuilt a megatron model and a vLLM-layout model at every switch, in the same
    # process: RSS steps a job, which builds its model once, never takes (issue 52)
    (got,) = pool.run(_model_turns, 1, timeout_s=300)
    assert got == {"train_model_reused": True, "source_reused": True, "weights_kept": True,
                   "steps_kept": 1, "gen_model_reused": True, "gen_as_built": True,
                   "new_worker": True, "rebuilt_on_request": True}, got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_adam_step_on_a_model_on_the_gpu():
    # the GPU soak steps a model on cuda:0; the seeded gradients were left on the host
    from megatron_reshard.testing.optimizer_steps import adam_step_

    model = torch.nn.Linear(64, 64).to("cuda", torch.bfloat16)
    before = model.weight.detach().clone()
    adam_step_(model, 1, lr=1e-2)
    assert not torch.equal(before, model.weight.detach())
