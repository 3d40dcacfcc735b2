"""No refit reports a version over params it did not write, and versions only increase.

Real processes: a real megatron-core model (dense, Qwen3-shaped, bf16) on 2 training ranks
(PP2: two refit groups) and 2 generation ranks (TP2) whose vLLM-layout model holds two
params no payload entry covers (a bias the training model lacks and an extra scale). One
job, three rounds of refit groups:

1. ``prepare_refit`` without ``keep_as_loaded``: refused on both generation ranks, naming
   the two params; both training ranks raise it through the fault board at their refit.
2. with ``keep_as_loaded``: ``refit(version=5)`` commits, ``refit(version=3)`` is refused
   on every rank naming both versions (nothing moves, the groups stay usable), and
   ``refit(version=6)`` commits; the kept params are reported as not refitted and still
   hold what was loaded. Then the two stages send versions 10 and 11: refused everywhere.
3. a restarted trainer (new sender, new groups, no history) sending version 4 to workers
   that hold 6 is refused by what the workers hold; its default version is 7; resending 7
   with ``allow_version_reuse=True`` commits.
4. on round 3's groups, which already refitted: the generation ranks ``prepare_refit``
   again (a new session: it has not compared plans yet) and the senders refit (version 8);
   then stage 0's training rank alone builds a new sender on its group, stage 1's keeps
   its own, and they refit (version 9). Each time exactly the groups holding a rank that
   has not checked the plan run the check on every rank, and both refits commit.
"""

import time

import pytest
import torch

from megatron_reshard.receiver import MegatronReshardWorkerExtension
from two_worlds import dense_pp2_source, join_world

TRAIN, GEN = 2, 2
TIMEOUT_S = 60.0  # long: a pass proves errors came through the fault board, not a timeout
EXTRA = {"model.layers.0.self_attn.o_proj.bias": (64,), "model.norm.extra_scale": (64,)}
KEEP = ["model.layers.0.self_attn.o_proj.bias", "model.norm.extra_*"]  # a name and a pattern


def _catch(fn):
    try:
        return {"value": fn(), "type": None, "error": None}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"value": None, "type": type(exc).__name__, "error": str(exc)}


def _trust_job(job):
    control, side, rank = join_world(job, TRAIN, GEN)
    return _train(job, control) if side == "train" else _gen(job, control, rank)


def _train(job, control):
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.megatron.sender import RefitSender

    _, source, _, _ = dense_pp2_source(GEN, num_layers=2)
    if job.rank == 0:
        control.set("payload", source.payload_bytes())

    groups = {}

    def sender(round_: int) -> RefitSender:
        groups[round_] = create_refit_group(job.host, job.ports[2 * round_ - 1 + source.stage],
                                            source.stage_local_rank, 1 + GEN, "gloo", TIMEOUT_S,
                                            who=f"train rank {job.rank}",
                                            label=f"refit group of PP stage {source.stage}")
        # the sender takes the source or its frozen plan (round 2 exercises the plan)
        return RefitSender(source.plan if round_ == 2 else source, groups[round_])

    s1 = sender(1)
    out = {"round1": _catch(lambda: s1.refit(version=1))}
    control.set(f"round1/train/{job.rank}", "1")
    s2 = sender(2)
    out["round2"] = [_catch(lambda v=v: s2.refit(version=v)) for v in (5, 3, 6)]
    # the two stages' groups disagree (each fine alone): only the generation ranks see
    # both, and tell each group in the check's second round
    out["split"] = _catch(lambda: s2.refit(version=10 + source.stage))
    s3 = sender(3)
    out["round3"] = [_catch(lambda: s3.refit(version=4)), _catch(s3.refit),
                     _catch(lambda: s3.refit(version=7, allow_version_reuse=True))]
    out["round4"] = [_catch(s3.refit)]  # the generation ranks prepared again
    s4 = RefitSender(source, groups[3]) if source.stage == 0 else s3
    out["round4"].append(_catch(s4.refit))
    return out


class _Worker(MegatronReshardWorkerExtension):
    def __init__(self, model):
        self._model = model

    def get_refit_model(self):
        return self._model


def _gen(job, control, gen_rank):
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.testing.vllm_like import build_vllm_like_model

    control.wait(["payload"])
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], gen_rank, GEN, 1, torch.bfloat16)
    for name, shape in EXTRA.items():  # params the training model does not have
        module, leaf = name.rsplit(".", 1)
        model.get_submodule(module).register_parameter(
            leaf, torch.nn.Parameter(torch.full(shape, float("nan"), dtype=torch.bfloat16),
                                     requires_grad=False))
    worker = _Worker(model)

    def join(round_: int) -> None:
        worker.init_refit_groups(job.host, [job.ports[2 * round_ - 1], job.ports[2 * round_]],
                                 1 + gen_rank, 1 + GEN, "gloo", TIMEOUT_S)

    join(1)
    out = {"round1": _catch(lambda: worker.prepare_refit(payload))}
    control.wait([f"round1/train/{r}" for r in range(TRAIN)])  # peers read the board first
    join(2)
    out["prepare2"] = worker.prepare_refit(payload, {"keep_as_loaded": KEEP})
    out["round2"] = [_catch(worker.refit) for _ in range(3)]
    out["split"] = _catch(worker.refit)
    out["state2"] = worker.refit_weights_state()
    out["report2"] = worker.report()
    join(3)
    worker.prepare_refit(payload, {"keep_as_loaded": KEEP})
    out["round3"] = [_catch(worker.refit) for _ in range(3)]
    out["state3"] = worker.refit_weights_state()
    worker.prepare_refit(payload, {"keep_as_loaded": KEEP})  # same groups, a new session
    out["round4"] = [_catch(worker.refit) for _ in range(2)]
    out["state4"] = worker.refit_weights_state()
    params = dict(model.named_parameters())
    out["kept_nan"] = {n: bool(torch.isnan(params[n]).all()) for n in EXTRA}
    out["written"] = sorted(n for n, p in params.items() if n not in EXTRA and not torch.isnan(p).any())
    out["names"] = sorted(n for n in params if n not in EXTRA)
    time.sleep(0.5)
    return out


@pytest.fixture(scope="module")
def trust(pool):
    return pool.run(_trust_job, TRAIN + GEN, num_ports=7, timeout_s=300)


def test_uncovered_params_are_refused_at_prepare_on_every_rank(trust):
    for gen in trust[TRAIN:]:
        res = gen["round1"]
        assert res["type"] == "UncoveredParamsError", res
        for name in EXTRA:
            assert name in res["error"], res["error"]
        assert "keep_as_loaded" in res["error"], res["error"]
    for train in trust[:TRAIN]:  # through the fault board, long before the 60 s timeout
        res = train["round1"]
        assert res["type"] == "PeerFailure", res
        assert "model.norm.extra_scale" in res["error"], res["error"]


def test_params_kept_as_loaded_are_reported_not_refitted(trust):
    for gen in trust[TRAIN:]:
        assert gen["prepare2"]["kept_as_loaded"] == sorted(EXTRA), gen["prepare2"]
        assert set(gen["prepare2"]["uncovered_targets"]) == set(EXTRA)
        for state in (gen["state2"], gen["state3"]):
            assert state["state"] == "consistent" and state["not_refitted"] == sorted(EXTRA), state
        assert gen["report2"]["weights"]["not_refitted"] == sorted(EXTRA)
        assert gen["report2"]["kept_as_loaded"] == sorted(EXTRA)
        assert gen["kept_nan"] == {n: True for n in EXTRA}  # still what was loaded
        assert gen["written"] == gen["names"]  # every other param was written


def test_a_version_that_does_not_increase_is_refused_on_every_rank(trust):
    for who, res in enumerate(trust):
        first, lower, higher = res["round2"]
        assert first["error"] is None and higher["error"] is None, (who, first, higher)
        assert lower["type"] == "VersionRefused", (who, lower)
        assert "refit version 3" in lower["error"] and "version 5" in lower["error"], lower
        assert (first["value"]["version"], higher["value"]["version"]) == (5, 6), who
    for gen in trust[TRAIN:]:
        assert gen["state2"]["version"] == 6 and gen["state2"]["refits"] == 2, gen["state2"]
        assert gen["state2"]["failed_refits"] == 0, gen["state2"]  # refused, not failed


def test_stages_that_send_different_versions_are_refused_on_every_rank(trust):
    for gen in trust[TRAIN:]:
        assert gen["split"]["type"] == "VersionRefused", gen["split"]
        assert "different versions: [10, 11]" in gen["split"]["error"], gen["split"]
    for train in trust[:TRAIN]:  # each group alone saw nothing wrong
        assert train["split"]["type"] == "VersionRefused", train["split"]
        assert "another PP stage's refit group" in train["split"]["error"], train["split"]


def test_a_restarted_trainer_is_checked_against_the_version_the_workers_hold(trust):
    for who, res in enumerate(trust):
        older, default, reused = res["round3"]
        assert older["type"] == "VersionRefused", (who, older)
        assert "refit version 4" in older["error"] and \
            "generation ranks hold version 6" in older["error"], older
        assert default["value"]["version"] == 7, (who, default)
        assert reused["error"] is None and reused["value"]["version"] == 7, (who, reused)
    for gen in trust[TRAIN:]:
        assert gen["state3"]["version"] == 7 and gen["state3"]["refits"] == 4, gen["state3"]


def test_a_new_session_or_sender_on_groups_that_refitted_checks_the_plan_and_goes_on(trust):
    for who, res in enumerate(trust):
        again, new_sender = res["round4"]
        assert again["error"] is None and again["value"]["version"] == 8, (who, again)
        assert new_sender["error"] is None and new_sender["value"]["version"] == 9, (who, new_sender)
    for gen in trust[TRAIN:]:
        assert gen["state4"]["version"] == 9 and gen["state4"]["state"] == "consistent", gen["state4"]
    # the generation ranks' new session: both groups checked the plan; then only stage 0's
    # group (its new sender)
    assert all(t["round4"][0]["value"]["verify_s"] is not None for t in trust[:TRAIN])
    train0, train1 = trust[0]["round4"][1]["value"], trust[1]["round4"][1]["value"]
    assert train0["verify_s"] is not None and train1["verify_s"] is None, (train0, train1)
