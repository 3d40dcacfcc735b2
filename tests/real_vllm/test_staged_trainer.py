"""A staged update driven by vLLM's trainer API (issue 53): ``MegatronReshardTrainerInitInfo(
staged=True)`` is the one flag. A real megatron-core training side (TP2) refits with
``send_weights()`` through vLLM's ``WeightTransferTrainerFactory``; the generation ranks run
vLLM's own GPU ``Worker`` weight-sync methods over vLLM's Qwen3 class (TP2), driven through
the client only (``tools.vllm_backend_refit``, driver "trainer"). Each ``update_weights``
call returns with the refit still to come (the staged phase is not idle: the transfer runs
outside vLLM's calls), ``finish_weight_update`` flips, and the weights are bit-equal to
vLLM's own ``load_weights`` of the same full tensors after every update."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment  # noqa: E402

set_vllm_cpu_environment()

from test_real_vllm import FAMILIES, layout, vllm_config_json  # noqa: E402

REFITS = 2


@pytest.mark.slow
def test_the_trainer_engines_staged_flag_stages_and_flips_bit_equal_to_vllms_loading(pool):
    from megatron_reshard.tools.run_config import RefitRunConfig
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    family = FAMILIES["qwen3"]
    cfg = RefitRunConfig(model="dense", model_overrides=dict(family.model), refits=REFITS,
                         verify=True, dtype="bfloat16", quiet=True, timeout_s=30,
                         **layout("tp2", "tp2"))
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), driver="trainer", staged=True,
                       num_ports=cfg.train_pp + 2, timeout_s=300)
    gens = [r for r in results if r["role"] == "gen"]
    assert len(gens) == 2
    for g in gens:
        assert g["errors"] == [], g["errors"]
        assert g["differences"] == [[]] * REFITS, g["differences"]
        assert g["versions"] == list(range(1, REFITS + 1))
        # update_weights returned before the refit: staged, not refitted inside the call
        assert len(g["phase_after_update"]) == REFITS
        assert all(p in ("receiving", "staged") for p in g["phase_after_update"]), g


@pytest.mark.slow
def test_a_failed_staged_refit_through_the_trainer_api_leaves_vllms_update_closed(pool):
    """Training rank 0 breaks the third refit part-way. The workers' staged update had
    returned, so vLLM's update is open: the trainer engine finishes it anyway (the flip
    raises, version N stays live) and, as vLLM's ``Worker`` keeps its update open after a
    finish that raised, calls the same finish again, which closes it. The trainer's
    ``shutdown`` is then accepted (vLLM refuses it during an update), and a restarted
    trainer's refit lands bit-equal to vLLM's loading."""
    from megatron_reshard.tools.run_config import RefitRunConfig
    from megatron_reshard.tools.vllm_backend_refit import PLANTED, backend_refit_job

    cfg = RefitRunConfig(model="dense", model_overrides=dict(FAMILIES["qwen3"].model),
                         refits=REFITS, verify=True, dtype="bfloat16", quiet=True, timeout_s=30,
                         **layout("tp2", "tp2"))
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(FAMILIES["qwen3"]), driver="trainer", staged=True,
                       fail_extra=True, num_ports=3 * cfg.train_pp + 2, timeout_s=300)
    train = [r for r in results if r["role"] == "train"]
    assert PLANTED in train[0]["bench"]["error"], train[0]["bench"]
    for t in train:
        assert t["bench"]["error"] is not None and t["bench"]["refused"] is not None, t["bench"]
        assert t["bench"]["restarted"]["version"] == REFITS + 2, t["bench"]
    update = ["start_weight_update", "update_weights", "finish_weight_update"]
    for g in (r for r in results if r["role"] == "gen"):
        assert g["calls"] == (["init_weight_transfer_engine"] + update * (REFITS + 1)
                              + ["finish_weight_update", "shutdown_weight_transfer_engine"]
                              + ["init_weight_transfer_engine", "shutdown_weight_transfer_engine"]
                              + ["init_weight_transfer_engine"] + update
                              + ["shutdown_weight_transfer_engine", "stop"]), g["calls"]
        f = g["failed"]
        assert "staged refit failed" in f["error"] and PLANTED in f["error"], f["error"]
        assert f["weights"]["state"] == "consistent" and f["weights"]["version"] == REFITS, f
        assert f["differ_from_last_good"] == [], f  # version N live, bit-equal to its load
        # the same finish again (unlabelled) closed vLLM's update, the weights as they were
        [(label, closed)] = g["closed_after_failure"]
        assert label is None and closed["state"] == "consistent" and \
            closed["version"] == REFITS, closed
        assert [m for m, _ in g["errors"]] == ["finish_weight_update",
                                               "init_weight_transfer_engine"], g["errors"]
        assert g["differences"] == [[]] * (REFITS + 1), g["differences"]
        assert g["versions"] == list(range(1, REFITS + 1)) + [REFITS + 2], g["versions"]


@pytest.mark.parametrize("options,words", [
    ({"staged": True}, "staged"),  # the flag, not a worker option: one switch for both sides
    ({"staging_budget_bytes": 1 << 20}, "both bounded"),
])
def test_the_staged_flag_is_the_one_switch_and_a_bounded_budget_is_refused(options, words):
    from megatron_reshard.errors import BadInputError
    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo

    with pytest.raises(BadInputError, match=words):
        MegatronReshardTrainerInitInfo(host="127.0.0.1", ports_by_stage=[29500], rank=0,
                                       staged=True, worker_options=options)
    # one budget unbounded: nothing is received in place, the engine's flip order works
    MegatronReshardTrainerInitInfo(host="127.0.0.1", ports_by_stage=[29500], rank=0, staged=True,
                                   worker_options={"staging_budget_bytes": 1 << 20,
                                                   "host_staging_budget_bytes": None})
