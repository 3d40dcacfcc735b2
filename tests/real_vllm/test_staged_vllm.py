"""Staged refits through the ``megatron_reshard`` vLLM weight-transfer backend (issue 53):
a real megatron-core training side (TP2) and generation ranks holding vLLM's own Qwen3
class (TP2) under vLLM's parallel state, each driving its engine as vLLM's GPU worker does,
with ``prepare_options={"staged": True}``: ``update_weights({"staged": True})`` returns at
once, the live params stay at version N until ``finish_weight_update()`` flips, after which
they are bit-equal to vLLM's own ``load_weights`` of the same full tensors. A staged refit
the training side breaks part-way fails at the flip and leaves version N live, consistent,
bit-equal to the last good oracle (an in-place refit leaves it inconsistent:
test_vllm_backend.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment  # noqa: E402

set_vllm_cpu_environment()

from test_real_vllm import FAMILIES, layout, vllm_config_json  # noqa: E402

REFITS = 2


@pytest.fixture(scope="module")
def staged(pool):
    from megatron_reshard.tools.run_config import RefitRunConfig
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    family = FAMILIES["qwen3"]
    cfg = RefitRunConfig(model="dense", model_overrides=dict(family.model), refits=REFITS,
                         verify=True, dtype="bfloat16", quiet=True, timeout_s=30,
                         **layout("tp2", "tp2"))
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), fail_extra=True, driver="worker", staged=True,
                       num_ports=cfg.train_pp + 2, timeout_s=300)
    return {r["role"] + str(r["rank"]): r for r in results}


@pytest.mark.slow
def test_staged_refits_through_the_backend_are_bit_equal_to_vllms_loading(staged):
    for key in ("gen0", "gen1"):
        g = staged[key]
        assert g["differences"] == [[]] * REFITS, (key, g["differences"])
        assert g["versions"] == list(range(1, REFITS + 1)), key
        # the transfer ran and committed while the live params kept version N
        assert g["changed_before_flip"] == [[]] * REFITS, (key, g["changed_before_flip"])


@pytest.mark.slow
def test_a_staged_refit_broken_part_way_leaves_version_n_live_and_consistent(staged):
    from megatron_reshard.tools.vllm_backend_refit import PLANTED

    assert PLANTED in staged["train0"]["bench"]["error"]
    for key in ("gen0", "gen1"):
        f = staged[key]["failed"]
        assert f is not None, key
        w = f["weights"]
        assert "staged refit failed" in f["error"] and PLANTED in f["error"], f["error"]
        assert w["state"] == "consistent" and w["version"] == REFITS, w
        assert w["overwritten"] == [] and w["staged"]["phase"] == "failed", w
        assert f["differ_from_last_good"] == [], f  # bit-equal to vLLM's load of version N


@pytest.mark.slow
def test_staged_mode_with_vllms_online_fp8_layers_is_refused_at_init_on_every_rank(pool):
    """vLLM's online block FP8 converts its layers in their storage after each refit
    (``receiver.staged_conversion``): no staging for that. Every generation rank refuses
    at init naming the layers; the training ranks raise the same refusal (fault boards)."""
    pytest.importorskip("compressed_tensors")  # vLLM's quantization registry imports it
    from test_online_fp8 import QWEN3_MOE_FP8, _cfg

    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job
    from megatron_reshard.tools.worlds import RankFailure

    cfg = _cfg()
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), moe_backend="flashinfer_cutlass",
                       quantization="fp8_per_block", staged=True, num_ports=cfg.train_pp + 2,
                       timeout_s=600, return_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    for r in results:
        assert "a staged refit cannot stage that" in r.text, (r.rank, r.text[-2000:])
    gens = [r for r in results if r.rank >= cfg.train_world]
    assert gens and all("prepare_refit option staged" in r.text for r in gens)
