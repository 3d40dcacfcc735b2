"""Delta refits into vLLM's own model classes, checked against vLLM's own loading, through
both front doors: the worker extension (``testing.vllm_refit``) and the weight-transfer
backend (``testing.vllm_backend_refit``, driven as vLLM's GPU worker drives it).

The senders ask for deltas (``RefitSender(delta=True)``); between refits the training
model takes real optimizer steps (AdamW over FP32 master weights, lr 1e-6:
``testing.optimizer_steps``), so 1-3% of the BF16 elements change, as in RL training.
Refit 1 is full (no base), the others deltas; after every refit each generation rank
builds a second vLLM instance loaded by vLLM's ``load_weights`` from the full HF tensors
and compares every parameter and buffer bit for bit (what a full refit is checked against
in test_real_vllm.py and test_vllm_backend.py). The generation side's report says the
mode, what a full refit would have moved into the rank (``full_bytes``) and what arrived
(``bytes_received``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from megatron_reshard.tools.run_config import RefitRunConfig  # noqa: E402
from test_real_vllm import FAMILIES, _build, layout, vllm_config_json  # noqa: E402

pytestmark = pytest.mark.slow

REFITS = 4
MODES = ["full"] + ["delta"] * (REFITS - 1)


def _cfg(family, train: str, gen: str, **over) -> RefitRunConfig:
    return RefitRunConfig(model="dense", model_overrides=dict(family.model), refits=REFITS,
                          dtype="bfloat16", quiet=True, timeout_s=120, delta=True,
                          update="adam", **layout(train, gen), **over)


def _check_reports(reports: list) -> None:
    assert [r["mode"] for r in reports] == MODES, reports
    full = reports[0]
    assert full["bytes_received"] == full["full_bytes"] > 0, full
    for r in reports[1:]:
        assert r["full_bytes"] == full["full_bytes"], r
        # the bulk as deltas: a small fraction of a full refit (the other params, packed
        # and broadcast, still travel whole)
        assert 0 < r["bytes_received"] < 0.25 * r["full_bytes"], r


@pytest.mark.parametrize("family_id,train,gen", [("qwen3", "tp2", "tp2"),
                                                 ("qwen3_moe", "tp2 pp2 ep2", "tp2")])
def test_delta_refits_through_the_worker_extension_equal_vllms_own_loading(
        pool, family_id, train, gen):
    from megatron_reshard.tools.vllm_refit import vllm_refit_job

    family = FAMILIES[family_id]
    cfg = _cfg(family, train, gen, verify=True)
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), model_builder=_build,
                       num_ports=cfg.train_pp + 2, timeout_s=600)
    for res in results:
        if res["role"] == "train":
            assert [r["mode"] for r in res["refits"]] == MODES, [
                r.get("full_reason") for r in res["refits"]]
            continue
        assert res["differences"] == [[]] * REFITS, res["differences"]
        assert res["stand_in_differences"] == [[]] * REFITS
        assert res["moved"] == [[]] * REFITS  # in place: vLLM's addresses kept
        _check_reports([{k: r.get(k) for k in ("mode", "full_bytes", "bytes_received")}
                        for r in res["refits"]])
        report = res["report"]
        assert report["mode"] == "delta" and report["bytes_received"] < report["full_bytes"]
        assert res["weights"]["state"] == "consistent" and res["weights"]["version"] == REFITS


def test_delta_refits_through_the_weight_transfer_backend_equal_vllms_own_loading(pool):
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    family = FAMILIES["qwen3"]
    cfg = _cfg(family, "tp2", "tp2", verify=False)
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), driver="worker",
                       num_ports=cfg.train_pp + 2, timeout_s=600)
    gens = [r for r in results if r["role"] == "gen"]
    for res in results:
        if res["role"] == "train":
            assert [r["mode"] for r in res["refits"]] == MODES
    for gen in gens:
        assert gen["differences"] == [[]] * REFITS, gen["differences"]
        assert gen["versions"] == list(range(1, REFITS + 1))
        _check_reports(gen["reports"])


@pytest.mark.parametrize("moe_backend", ["triton", "flashinfer_cutlass"])
def test_block_fp8_deltas_only_where_vllms_conversion_keeps_the_bytes(pool, moe_backend):
    """Block-FP8 Qwen3-MoE, the CUTLASS block linear kernel, Adam steps, deltas asked for.
    vLLM's own conversion runs after each refit (``receiver.staged_conversion``). With
    Triton experts every conversion hands back its inputs untouched (learned by the dry run,
    checked again on each live call): the storage keeps the bytes as they arrived, so the
    refits after the first go as deltas. FlashInfer CUTLASS swaps w13 and clamps its scales:
    every refit is full on every rank and the reason names the conversion. Each refit is
    bit-equal to vLLM's own loading of the block-FP8 checkpoint."""
    pytest.importorskip("compressed_tensors")  # vLLM's quantization registry imports it
    if moe_backend == "flashinfer_cutlass":
        pytest.importorskip("flashinfer")
    from megatron_reshard.tools.vllm_refit import vllm_refit_job
    from test_fp8_staged_conversion import QWEN3_MOE_FP8, fp8_config_json

    cfg = RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE_FP8.model), refits=3,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120, delta=True,
                         update="adam", gen_precision="fp8", **layout("tp2 ep2", "tp2"))
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, fp8_config_json(),
                       model_builder=_build, moe_backend=moe_backend, num_ports=cfg.train_pp + 2,
                       timeout_s=480)
    kept = moe_backend == "triton"
    modes = ["full", "delta", "delta"] if kept else ["full"] * 3
    for res in results:
        refits = res["refits"]
        assert [r["mode"] for r in refits] == modes, [(r["mode"], r["full_reason"]) for r in refits]
        if not kept:
            for r in refits[1:]:
                assert "vLLM's own conversion rewrote" in r["full_reason"], r["full_reason"]
        if res["role"] == "train":
            continue
        assert res["differences"] == [[]] * 3, res["differences"]
        assert res["report"]["staged_conversion"]["conversions"] > 0
        if kept:
            assert all(r["bytes_received"] < r["full_bytes"] for r in refits[1:]), refits
        assert res["weights"]["state"] == "consistent" and res["weights"]["version"] == 3
