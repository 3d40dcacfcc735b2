"""Refits into MoE storage that vLLM's post-load step put in a GPU kernel's order.

The generation ranks build vLLM 0.33's own Qwen3-MoE class with the unquantized MoE
backend a GPU worker would select (``--moe-backend flashinfer_cutlass`` /
``flashinfer_trtllm``; honoured on the CPU by ``testing.vllm_models``), so vLLM's own
allocation (TRTLLM: the per-rank intermediate 48 or 96 padded to 128) and its own
post-load conversion (CUTLASS: w13 as [up; gate]; TRTLLM: zero padding and FlashInfer's
block layout) run. Then two refits with changed weights through the real worker
extension, each compared bit for bit with a second vLLM model loaded by vLLM's
``load_weights`` and the same post-load (``tools.vllm_refit``), and one generation rank
given a wrong mapping on purpose, which the comparison must report.

Backends whose conversion cannot run here are refused before any byte moves
(``receiver.kernel_layouts``): checked on vLLM's live layer with its backend set as ROCm,
XPU or MoonEP would select it, and with vLLM's block-FP8 methods in place of the live ones
(the learned orders alone never write FP8 layers: the worker converts those by vLLM's own
code, ``tests/real_vllm/test_fp8_staged_conversion.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv
pytest.importorskip("flashinfer.fused_moe.core")  # its permutation helpers run on the CPU

from test_real_vllm import REFITS, Family, _build, layout, vllm_config_json  # noqa: E402
from hf_configs import TINY_MODEL  # noqa: E402
from megatron_reshard.tools.vllm_refit import kernel_orders_job, vllm_refit_job  # noqa: E402
from megatron_reshard.tools.run_config import RefitRunConfig  # noqa: E402

pytestmark = pytest.mark.slow

# hidden 128 (TRTLLM's block layout needs 128-row tiles of w2); expert intermediate 96:
# 48 per rank under gen TP2, 96 whole under vLLM EP, both padded to 128 by TRTLLM
QWEN3_MOE = Family(dict(TINY_MODEL, family="qwen3_moe", qk_layernorm=True, hidden_size=128,
                        num_moe_experts=8, moe_ffn_hidden_size=96, moe_layer_freq=[0, 1, 1, 1]),
                   "Qwen3MoeForCausalLM", dict(attention_bias=False), ())
MOE_LAYERS = 3
CASES = {
    "cutlass-tp2": ("flashinfer_cutlass", "tp2 ep2", "tp2", {}),
    "cutlass-vllm-ep": ("flashinfer_cutlass", "tp1 ep2", "tp2 ep2", {}),
    "trtllm-tp2": ("flashinfer_trtllm", "tp2 ep2", "tp2", dict(plant_order_error_on=1)),
    "trtllm-vllm-ep": ("flashinfer_trtllm", "tp1 ep2", "tp2 ep2", {}),
}


@pytest.fixture(scope="module")
def refitted(pool):
    cache: dict = {}

    def get(case: str) -> list[dict]:
        if case not in cache:
            backend, train, gen, extra = CASES[case]
            cfg = RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE.model),
                                 refits=REFITS, verify=True, dtype="bfloat16", quiet=True,
                                 timeout_s=120, **layout(train, gen))
            results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                               vllm_config_json(QWEN3_MOE), model_builder=_build,
                               moe_backend=backend, **extra, num_ports=cfg.train_pp + 2,
                               timeout_s=420)
            cache[case] = [r for r in results if r["role"] == "gen"]
        return cache[case]

    return get


def _planted_rank(case: str):
    return CASES[case][3].get("plant_order_error_on")


@pytest.mark.parametrize("case", list(CASES))
def test_refit_into_kernel_order_is_bit_equal_to_vllms_own_loading(refitted, case):
    backend = CASES[case][0].replace("flashinfer_", "FLASHINFER_").upper()
    for g in refitted(case):
        if g["rank"] == _planted_rank(case):
            continue
        who = f"{case} gen rank {g['rank']}"
        # the receiver knew, before any byte moved, that vLLM stores the experts its way
        orders = g["kernel_orders"]
        # CUTLASS reorders w13 only ([up; gate]); TRTLLM both (its block layout)
        leaves = ("w13_weight",) if "CUTLASS" in backend else ("w13_weight", "w2_weight")
        assert sorted(orders) == sorted(f"model.layers.{i}.mlp.experts.routed_experts.{leaf}"
                                        for i in range(1, MOE_LAYERS + 1) for leaf in leaves), who
        assert set(orders.values()) == {backend}, (who, orders)
        assert g["differences"] == [[]] * REFITS, f"{who}: differs from vLLM: {g['differences']}"
        assert g["moved"] == [[]] * REFITS, f"{who}: params moved to new storage: {g['moved']}"
        assert g["weights"]["state"] == "consistent" and g["weights"]["version"] == REFITS, who
        # TRTLLM's padding is held by vLLM, not left uncovered
        assert g["summary"]["uncovered_targets"] == {}, (who, g["summary"]["uncovered_targets"])
        assert g["stand_in_differences"] == [[]] * REFITS, (who, g["stand_in_differences"])


def test_a_planted_mapping_error_fails_the_comparison(refitted):
    """Gen rank 1 of the TRTLLM case maps two rows of one expert tensor the wrong way round:
    after every refit the comparison with vLLM reports exactly that tensor on that rank."""
    planted = next(g for g in refitted("trtllm-tp2") if g["rank"] == 1)
    target = min(planted["kernel_orders"])
    assert planted["differences"] == [[target]] * REFITS, planted["differences"]


def test_trtllm_through_the_weight_transfer_backend_and_the_colocated_transport(pool):
    """The other front door (vLLM's weight-transfer engine, driven as vLLM's GPU worker
    drives it) and the other transport (copies out of the training ranks' shared memory):
    two refits into TRTLLM-ordered storage, bit-equal to vLLM's own loading."""
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    cfg = RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         transport="colocated", **layout("tp2 ep2", "tp2"))
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE), moe_backend="flashinfer_trtllm",
                       num_ports=cfg.train_pp + 2, timeout_s=420)
    gens = [r for r in results if r["role"] == "gen"]
    assert {r["transport"] for r in results if r["role"] == "train"} == {"colocated"}
    for g in gens:
        assert g["engine"] == "MegatronReshardWeightTransferEngine"
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        assert g["versions"] == list(range(1, REFITS + 1)), g["rank"]


def test_backends_whose_conversion_does_not_run_here_are_refused(pool):
    """vLLM's live TRTLLM layers, their backend then set as ROCm (AITER), XPU, MoonEP, TPU
    or an out-of-tree platform would select it: refused, naming the layer, the quant method,
    the backend and the setting that selects a supported one; never re-processed as MLA."""
    refused = ("AITER", "XPU", "MOONEP", "TPU", "OOT")
    (out,) = pool.run(kernel_orders_job, 1, vllm_config_json(QWEN3_MOE), "flashinfer_trtllm",
                      refused, num_ports=1, timeout_s=300)
    assert len(out["orders"]) == 2 * MOE_LAYERS, out["orders"]
    assert out["mla_layers"] == []  # no expert layer is ever re-run by receiver.derived
    for backend in refused:
        message = out["refused"][backend]
        assert message is not None, backend
        assert "model.layers.1.mlp.experts.routed_experts" in message, message
        assert "UnquantizedFusedMoEMethod" in message and f"kernel backend {backend}" in message
        assert "--moe-backend triton, flashinfer_cutlass or flashinfer_trtllm" in message
    # block-FP8 layers (vLLM's own method classes in place of the live ones): refused too
    moe, linear = out["quantized"]["moe"], out["quantized"]["linear"]
    assert moe and "routed_experts: quant method Fp8MoEMethod, kernel backend FLASHINFER_CUTLASS" in moe
    assert "drop --quantization" in moe and "--moe-backend" in moe, moe
    assert linear and "quant method Fp8LinearMethod" in linear and "drop --quantization" in linear
    # vLLM's real CPU experts prepack after loading (the shim sets that aside): refused
    prepack = out["cpu_prepack"]
    assert prepack and "kernel backend CPU" in prepack and "prepack" in prepack, prepack


def test_a_refused_backend_stops_every_rank_at_prepare_refit(pool):
    """A whole launch whose vLLM layers report the AITER backend (ROCm's): every generation
    rank refuses at ``prepare_refit`` with the layer, method, backend and setting, and the
    training ranks raise the same refusal (fault boards) instead of waiting; no refit runs."""
    from megatron_reshard.tools.worlds import RankFailure

    cfg = RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         **layout("tp2 ep2", "tp2"))
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE), model_builder=_build,
                       moe_backend="flashinfer_trtllm", as_moe_backend="AITER",
                       num_ports=cfg.train_pp + 2, timeout_s=420, return_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    for r in results:
        assert "KernelLayoutError" in r.text or "kernel backend AITER" in r.text, r.text[-2000:]
        assert "kernel backend AITER" in r.text and "--moe-backend" in r.text, (r.rank, r.text[-2000:])
    gens = [r for r in results if r.rank >= cfg.train_world]
    assert all("prepare_refit" in r.text and "KernelLayoutError" in r.text for r in gens)


@pytest.mark.parametrize("transport", ["colocated", "p2p"])
def test_cutlass_through_the_weight_transfer_backend(pool, transport):
    """FlashInfer CUTLASS (w13 as [up; gate], written through strided views) through vLLM's
    weight-transfer engine over both transports: two refits bit-equal to vLLM's loading."""
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    cfg = RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         transport=transport, **layout("tp2 ep2", "tp2"))
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE), moe_backend="flashinfer_cutlass",
                       num_ports=cfg.train_pp + 2, timeout_s=420)
    assert {r["transport"] for r in results if r["role"] == "train"} == {transport}
    for g in (r for r in results if r["role"] == "gen"):
        assert g["engine"] == "MegatronReshardWeightTransferEngine"
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        assert g["versions"] == list(range(1, REFITS + 1)), g["rank"]
