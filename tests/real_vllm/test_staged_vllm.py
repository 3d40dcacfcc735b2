"""Staged refits through the ``megatron_reshard`` vLLM weight-transfer backend (issue 53):
a real megatron-core training side (TP2) and generation ranks holding vLLM's own Qwen3
class (TP2) under vLLM's parallel state, each driving its engine as vLLM's GPU worker does,
with ``prepare_options={"staged": True}``: ``update_weights({"staged": True})`` returns at
once, the live params stay at version N until ``finish_weight_update()`` flips, after which
they are bit-equal to vLLM's own ``load_weights`` of the same full tensors. A staged refit
the training side breaks part-way fails at the flip and leaves version N live, consistent,
bit-equal to the last good oracle (an in-place refit leaves it inconsistent:
test_vllm_backend.py).

That run goes through vLLM's own ``Worker`` weight-sync methods (``retry``): vLLM keeps its
update session open after a finish that raised and refuses a new one while it is, so the
same finish again must close it; then the generation ranks join a restarted trainer's
groups, an update without a refit fails at its finish and the same call again closes it,
and a full refit lands bit-equal to vLLM's loading of its weights."""

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
                       retry=True, num_ports=2 * cfg.train_pp + 2, timeout_s=300)
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


def _closed_quietly(error, warnings, version):
    assert error is None, error
    assert len(warnings) == 1, warnings
    assert "closed" in warnings[0] and f"consistent at version {version}" in warnings[0], warnings


@pytest.mark.slow
def test_the_same_finish_again_closes_vllms_update_after_a_failed_flip(staged):
    """vLLM's ``Worker.finish_weight_update`` (0.34.0, unless ``VLLM_RELOAD_MODE=direct``;
    0.25.1 always) leaves ``_weight_update_active`` set when the engine's finish raises, and
    ``start_weight_update`` refuses while it is set: only a finish that returns ends it."""
    for key in ("gen0", "gen1"):
        f, r = staged[key]["failed"], staged[key]["retry"]
        assert f["open_after_failure"] is True, f  # vLLM kept its session open
        _closed_quietly(f["finish_error"], f["retry_warnings"], REFITS)
        assert r["stuck_after_failure"] is None, r  # vLLM's next start was not refused
        assert "finish_weight_update again closes this update" in f["error"], f["error"]
        # once: a further finish without an open update raises as before
        assert "without an open weight update" in r["finish_again"], r


@pytest.mark.slow
def test_after_a_failed_finish_without_a_refit_the_retry_closes_and_a_full_refit_lands(staged):
    """The generation ranks release the failed groups and join a restarted trainer's (in
    place now); an update without a refit raises at its finish, the same finish again
    closes it, and the restarted trainer's full refit is bit-equal to vLLM's loading."""
    assert staged["train0"]["bench"]["restarted"]["version"] == REFITS + 1
    for key in ("gen0", "gen1"):
        r = staged[key]["retry"]
        assert r["no_refit"].startswith("WeightUpdateError") and "no refit committed" in \
            r["no_refit"], r
        assert r["open_after_no_refit"] is True, r
        _closed_quietly(r["no_refit_retry"], r["no_refit_retry_warnings"], REFITS)
        assert r["stuck_after_no_refit"] is None, r
        assert "finish_weight_update again closes this update" in r["no_refit"], r
        w = r["weights"]
        assert w["state"] == "consistent" and w["version"] == REFITS + 1, w
        assert r["differences"] == [], r["differences"]


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
