"""Refits into block-FP8 layers whose vLLM post-load step computes (``receiver.staged_conversion``).

The generation ranks build vLLM 0.33's own Qwen3-MoE class from a block-FP8 config
(``weight_block_size`` [128, 128], routers unquantized) with the FP8 MoE backend
``--moe-backend flashinfer_cutlass`` (Hopper's choice under EP: w13 and its scales
swapped to [up; gate], block scales clamped) and the CUTLASS block-FP8 linear kernel;
the CPU shim in ``testing.vllm_models`` only builds those kernel objects without CUDA.
The refit receives the FP8 bytes and scales in checkpoint order into vLLM's storage and
runs vLLM's own conversion of each layer after every refit. Two refits with changed
weights, each compared bit for bit with a second vLLM model loaded by vLLM's
``load_weights`` from the block-FP8 checkpoint of the same full tensors
(``testing.fp8_reference``'s tile quantizer) and the same post-load. One generation rank
skips the conversion of one layer on purpose; the comparison must report exactly it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv
pytest.importorskip("compressed_tensors")  # vLLM's quantization registry imports it

from test_real_vllm import REFITS, Family, _build, layout, vllm_config_json  # noqa: E402
from hf_configs import TINY_MODEL  # noqa: E402
from megatron_reshard.testing import vllm_models as vm  # noqa: E402
from megatron_reshard.tools.vllm_refit import vllm_refit_job  # noqa: E402
from megatron_reshard.tools.run_config import RefitRunConfig  # noqa: E402

pytestmark = pytest.mark.slow
# vLLM's FP8 post-load for FlashInfer TRTLLM experts shuffles them with flashinfer's own
# helpers, which not every vLLM of the range brings (0.25.1's venv has no flashinfer)
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer is not installed: vLLM's FP8 FlashInfer TRTLLM post-load needs it")

# every per-rank q / k / v / gate / up / down and expert slice whole 128x128 tiles under
# train TP2 EP2 and gen TP2: head_dim 128, hidden 128, intermediate 256 (128 per rank)
QWEN3_MOE_FP8 = Family(dict(TINY_MODEL, family="qwen3_moe", qk_layernorm=True, hidden_size=128,
                            head_dim=128, num_attention_heads=2, num_query_groups=2,
                            ffn_hidden_size=256, num_moe_experts=8, moe_ffn_hidden_size=256,
                            moe_layer_freq=[0, 1, 1, 1]),
                       "Qwen3MoeForCausalLM", dict(attention_bias=False), ())
MOE_LAYERS = (1, 2, 3)
PLANTED_RANK = 1
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_staged_conversion.py")


def _bench():
    """scripts/bench_staged_conversion.py as a module (its table of a gen rank's result)."""
    spec = importlib.util.spec_from_file_location("bench_staged_conversion", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_staged_table(g: dict, staging: bool) -> dict:
    """The bench's per-layer figures of one gen rank, checked against what the refit did:
    one row per staged layer, each converted once per refit, its bytes those vLLM holds
    for the layer, the totals their sums; ``staging``: whether any conversion needed
    bytes apart (FlashInfer's swap does, Triton's identity never)."""
    layers = g["report"]["staged_conversion"]["layers"]
    table = _bench().staged_table(g)
    rows, totals = table["rows"], table["totals"]
    assert [r["layer"] for r in rows] == layers, rows
    assert all(r["conversions"] == REFITS for r in rows), rows
    assert all(r["layer_bytes"] > 0 and r["convert_s"] >= 0 and r["peak_staging_bytes"] >= 0
               for r in rows), rows
    assert all(r["peak_staging_bytes"] <= r["layer_bytes"] for r in rows), rows
    assert totals["peak_staging_bytes"] == max(r["peak_staging_bytes"] for r in rows), totals
    assert totals["layer_bytes"] == sum(r["layer_bytes"] for r in rows), totals
    assert 0 < totals["convert_share"] < 1 and totals["refits"] == REFITS, totals
    assert (totals["sum_staging_bytes"] > 0) == staging, rows
    assert table["rows"][0]["layer"] in _bench().format_table("t", table)
    return table


def fp8_config_json() -> dict:
    return dict(vllm_config_json(QWEN3_MOE_FP8), quantization_config=vm.fp8_quantization_config(
        [f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS]))


def _cfg(**extra) -> RefitRunConfig:
    return RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE_FP8.model), refits=REFITS,
                          verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                          gen_precision="fp8", **layout("tp2 ep2", "tp2"), **extra)


@pytest.fixture(scope="module")
def cutlass_fp8(pool):
    cfg = _cfg()
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, fp8_config_json(),
                       model_builder=_build, moe_backend="flashinfer_cutlass",
                       plant_staged_error_on=PLANTED_RANK, num_ports=cfg.train_pp + 2, timeout_s=480)
    return [r for r in results if r["role"] == "gen"]


def test_fp8_refit_through_vllms_conversion_is_bit_equal_to_vllms_own_loading(cutlass_fp8):
    for g in cutlass_fp8:
        if g["rank"] == PLANTED_RANK:
            continue
        who = f"gen rank {g['rank']}"
        assert g["kernel_orders"] == {}, who  # nothing written through a learned order
        staged = g["report"]["staged_conversion"]
        assert sorted(staged["backends"]) == ["Fp8LinearMethod:CutlassFp8BlockScaledMMKernel",
                                              "Fp8MoEMethod:FLASHINFER_CUTLASS"], (who, staged)
        assert len(staged["layers"]) == 4 * 2 + 1 * 2 + len(MOE_LAYERS), (who, staged["layers"])
        assert staged["conversions"] == REFITS * len(staged["layers"]), (who, staged)
        # every staged layer converted once per refit, and the swap needed staging
        assert staged["layers"] and staged["peak_staging_bytes"] > 0, (who, staged)
        for stats in g["refits"]:
            assert sorted(stats["staged_converted"]) == sorted(staged["layers"]), who
        assert g["differences"] == [[]] * REFITS, f"{who}: differs from vLLM: {g['differences']}"
        assert g["moved"] == [[]] * REFITS, f"{who}: params moved to new storage: {g['moved']}"
        assert g["kv_scales_changed"] == [[]] * REFITS, who
        assert g["weights"]["state"] == "consistent" and g["weights"]["version"] == REFITS, who


def test_the_staging_cost_is_reported_per_layer(cutlass_fp8):
    """report()'s per-layer figures, as scripts/bench_staged_conversion.py prints them:
    FlashInfer CUTLASS stages the swapped w13 and its scales of each expert layer (the
    w13 share of the layer: 2/3 of its FP8 bytes) and nothing for the linear layers,
    whose CUTLASS block kernel keeps the bytes."""
    g = next(g for g in cutlass_fp8 if g["rank"] != PLANTED_RANK)
    rows = {r["layer"]: r for r in _check_staged_table(g, staging=True)["rows"]}
    for i in MOE_LAYERS:
        moe = rows[f"model.layers.{i}.mlp.experts.routed_experts"]
        assert moe["backend"] == "Fp8MoEMethod:FLASHINFER_CUTLASS", moe
        assert moe["peak_staging_bytes"] > moe["layer_bytes"] // 2, moe
    linear = [r for r in rows.values() if r["backend"].startswith("Fp8LinearMethod")]
    assert linear and all(r["peak_staging_bytes"] == 0 for r in linear), linear


def test_a_skipped_conversion_fails_the_comparison(cutlass_fp8):
    """Gen rank 1 takes its first FP8 expert layer as checkpoint order (its conversion
    skipped): after every refit the comparison with vLLM reports exactly that layer's w13
    and its scales (FlashInfer CUTLASS swaps both; w2 and its scales it keeps)."""
    planted = next(g for g in cutlass_fp8 if g["rank"] == PLANTED_RANK)
    layer = "model.layers.1.mlp.experts.routed_experts"
    assert planted["differences"] == [[f"{layer}.w13_weight", f"{layer}.w13_weight_scale_inv"]] * REFITS, \
        planted["differences"]



@needs_flashinfer
@pytest.mark.parametrize("gen", ["tp2", "tp2 ep2"])
def test_fp8_trtllm_experts_are_received_through_a_checkpoint_shaped_view(pool, gen):
    """Block-FP8 experts under FlashInfer TRTLLM (Blackwell's default): vLLM re-allocates
    them in TRTLLM's block-major 4-D shape; the refit writes checkpoint order through a
    checkpoint-shaped view of that storage and runs vLLM's conversion into it. Gen TP2 and
    vLLM EP, two refits each, bit-equal to vLLM's own loading, no param moved."""
    cfg = RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE_FP8.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         gen_precision="fp8", **layout("tp2 ep2", gen))
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, fp8_config_json(),
                       model_builder=_build, moe_backend="flashinfer_trtllm",
                       num_ports=cfg.train_pp + 2, timeout_s=480)
    for g in (r for r in results if r["role"] == "gen"):
        staged = g["report"]["staged_conversion"]
        assert "Fp8MoEMethod:FLASHINFER_TRTLLM" in staged["backends"], staged
        assert staged["peak_staging_bytes"] > 0, staged
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        assert g["moved"] == [[]] * REFITS, (g["rank"], g["moved"])
        rows = _check_staged_table(g, staging=True)["rows"]
        # TRTLLM's shuffle returns every weight anew: all of an expert layer but w2's scales
        experts = [r for r in rows if r["backend"] == "Fp8MoEMethod:FLASHINFER_TRTLLM"]
        assert experts and all(r["peak_staging_bytes"] > 0.9 * r["layer_bytes"] for r in experts), experts


def test_fp8_triton_experts_take_the_staged_path_at_no_cost(pool):
    """Block-FP8 experts under Triton (Hopper without EP): vLLM's conversion returns its
    input, so the staged path converts in place with no staging; two refits bit-equal."""
    cfg = _cfg()
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, fp8_config_json(),
                       model_builder=_build, moe_backend="triton", num_ports=cfg.train_pp + 2,
                       timeout_s=480)
    for g in (r for r in results if r["role"] == "gen"):
        staged = g["report"]["staged_conversion"]
        assert "Fp8MoEMethod:TRITON" in staged["backends"], staged
        assert staged["peak_staging_bytes"] == 0, staged
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        _check_staged_table(g, staging=False)  # zero on every row of the bench's table

# FP8 MoE backends whose conversion does not run on this CPU or repacks with its own device
# kernels: DeepGEMM (its scale layout needs the deep_gemm package), Marlin, ROCm AITER,
# Humming, vLLM's CPU and XPU experts
NOT_HERE = ("DEEPGEMM", "MARLIN", "AITER", "HUMMING", "CPU", "XPU")


@needs_flashinfer  # its last check builds the TRTLLM experts
def test_fp8_backends_whose_conversion_cannot_run_here_are_refused(pool):
    from megatron_reshard.testing.vllm_staged_checks import fp8_refusals_job

    (out,) = pool.run(fp8_refusals_job, 1, fp8_config_json(), NOT_HERE, num_ports=1, timeout_s=300)
    assert ("model.layers.1.mlp.experts.routed_experts", "Fp8MoEMethod", "FLASHINFER_CUTLASS") \
        in [tuple(s) for s in out["staged"]]
    for backend in NOT_HERE:
        message = out["refused"][backend]
        assert message is not None, backend
        assert "model.layers.1.mlp.experts.routed_experts: quant method Fp8MoEMethod, " \
               f"kernel backend {backend}:" in message, message
        assert "--moe-backend flashinfer_cutlass, flashinfer_trtllm or triton" in message, message
    assert "does not run on this cpu device" in out["refused"]["DEEPGEMM"], out["refused"]["DEEPGEMM"]
    marlin = out["marlin_linear"]
    assert marlin and "model.layers.0.self_attn.qkv_proj: quant method Fp8LinearMethod" in marlin
    assert "Marlin" in marlin and "drop --quantization" in marlin, marlin
    # block-FP8 TRTLLM re-allocates its experts in its own 4-D shape: received through a
    # checkpoint-shaped view of that storage, not refused
    assert out["trtllm"] is None, out["trtllm"]
    # the learned orders alone (no staged path) still refuse every FP8 layer
    assert out["orders_alone"] and "Fp8" in out["orders_alone"], out["orders_alone"]


def test_per_tensor_and_online_fp8_are_refused_naming_what_to_change(pool):
    """Per-tensor FP8 (a checkpoint without ``weight_block_size``) and vLLM's online FP8
    (``--quantization fp8_per_tensor`` on the BF16 checkpoint, and ``fp8``, which vLLM 0.33
    maps to it): vLLM's post-load quantizes with ``vllm._C``'s ``scaled_fp8_quant``, which
    does not run on this CPU (shown on the per-tensor checkpoint's own post-load), so no
    oracle can check a refit of them (online ``fp8_per_block`` is refitted:
    ``test_online_fp8.py``). The live layers are refused, the message naming the layer,
    vLLM's quant method, the kernel backend and the setting to change."""
    from megatron_reshard.testing.vllm_staged_checks import per_tensor_refusals_job

    per_tensor = {k: v for k, v in vm.fp8_quantization_config().items() if k != "weight_block_size"}
    per_tensor["ignored_layers"] = [f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS]
    (out,) = pool.run(per_tensor_refusals_job, 1, vllm_config_json(QWEN3_MOE_FP8), per_tensor,
                      ("fp8", "fp8_per_tensor"), num_ports=1, timeout_s=300)
    checkpoint = out["checkpoint"]
    assert {"Fp8LinearMethod", "Fp8MoEMethod"} <= set(checkpoint["methods"]), checkpoint
    assert checkpoint["post_load"] and "scaled_fp8_quant" in checkpoint["post_load"], checkpoint
    message = checkpoint["refused"]
    assert message and message.startswith("model.layers.0.self_attn.qkv_proj: quant method "
                                          "Fp8LinearMethod, kernel backend "
                                          "CutlassFP8ScaledMMLinearKernel: per-tensor"), message
    for label in ("online:fp8", "online:fp8_per_tensor"):
        case = out[label]
        assert {"Fp8PerTensorOnlineLinearMethod", "Fp8PerTensorOnlineMoEMethod"} <= \
            set(case["methods"]), (label, case["methods"])
        message = case["refused"]
        assert message and message.startswith(
            "model.layers.0.self_attn.qkv_proj: quant method Fp8PerTensorOnlineLinearMethod, "
            "kernel backend CutlassFP8ScaledMMLinearKernel: vLLM quantizes this layer's BF16 "
            "weights while loading"), (label, message)
    experts = "model.layers.1.mlp.experts.routed_experts: quant method "
    assert out["checkpoint"]["moe_refused"].startswith(
        experts + "Fp8MoEMethod, kernel backend FLASHINFER_CUTLASS: per-tensor"), out["checkpoint"]
    for label in ("online:fp8", "online:fp8_per_tensor"):
        assert out[label]["moe_refused"].startswith(
            experts + "Fp8PerTensorOnlineMoEMethod, kernel backend FLASHINFER_CUTLASS: vLLM "
            "quantizes"), (label, out[label]["moe_refused"])
    for label, case in out.items():
        setting = 'gen_quant="block_fp8_online"' if label.startswith("online") else 'gen_quant="block_fp8"'
        for message in (case["refused"], case["moe_refused"]):
            assert "drop --quantization" in message and setting in message, message


def test_a_refused_fp8_backend_stops_every_rank_at_prepare_refit(pool):
    """Block-FP8 experts that report the Marlin backend (vLLM's choice on GPUs without FP8
    hardware): every generation rank refuses at ``prepare_refit`` naming layer, method,
    backend and setting, and the training ranks raise the same refusal (fault boards); no
    byte moves."""
    from megatron_reshard.tools.worlds import RankFailure

    cfg = _cfg()
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, fp8_config_json(),
                       model_builder=_build, moe_backend="flashinfer_cutlass",
                       as_moe_backend="MARLIN", num_ports=cfg.train_pp + 2, timeout_s=480,
                       return_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    for r in results:
        assert "kernel backend MARLIN" in r.text and "--moe-backend" in r.text, \
            (r.rank, r.text[-2000:])
    gens = [r for r in results if r.rank >= cfg.train_world]
    assert all("prepare_refit" in r.text and "KernelLayoutError" in r.text for r in gens)


@pytest.mark.parametrize("transport", ["colocated", "p2p"])
def test_fp8_through_the_weight_transfer_backend(pool, transport):
    """The other front door (vLLM's weight-transfer engine, driven as vLLM's GPU worker
    drives it), over both transports: two refits into block-FP8 layers converted by vLLM's
    own code, bit-equal to vLLM's own loading of the FP8 checkpoint."""
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    cfg = _cfg(transport=transport)
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg, fp8_config_json(),
                       moe_backend="flashinfer_cutlass", num_ports=cfg.train_pp + 2, timeout_s=480)
    assert {r["transport"] for r in results if r["role"] == "train"} == {transport}
    for g in (r for r in results if r["role"] == "gen"):
        assert g["engine"] == "MegatronReshardWeightTransferEngine"
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        assert g["versions"] == list(range(1, REFITS + 1)), g["rank"]


# DeepSeek-V3's MLA at tiny scale in block FP8: every q_a / kv_a (kv_lora + rope) / q_b /
# kv_b / o_proj part and every per-rank expert and shared-expert slice whole 128x128 tiles
DEEPSEEK_FP8 = Family(dict(TINY_MODEL, family="deepseek_v3", hidden_size=128, num_attention_heads=2,
                           ffn_hidden_size=256, num_moe_experts=8, moe_ffn_hidden_size=256,
                           moe_shared_expert_intermediate_size=256, moe_layer_freq=[0, 1, 1, 1],
                           multi_latent_attention=True, q_lora_rank=128, kv_lora_rank=128,
                           qk_head_dim=128, qk_pos_emb_head_dim=128, v_head_dim=128,
                           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                           moe_router_topk_scaling_factor=2.5, layernorm_epsilon=1e-6),
                      "DeepseekV3ForCausalLM", dict(topk_method="noaux_tc", scoring_func="sigmoid"), ())


def test_mla_over_fp8_kv_b_proj_is_derived_after_its_conversion(pool):
    """DeepSeek-V3's MLA with a block-FP8 ``kv_b_proj``: vLLM's MLA post-load absorbs the
    dequantized ``kv_b_proj`` into ``W_UK_T`` / ``W_UV`` copies. After each refit the worker
    converts the FP8 layers first (vLLM's own code), then re-derives every MLA layer into
    its storage, as vLLM's loader orders them: two refits bit-equal to vLLM's own loading
    of the FP8 checkpoint, derived tensors included."""
    hf = dict(vllm_config_json(DEEPSEEK_FP8), quantization_config=vm.fp8_quantization_config(
        [f"model.layers.{i}.mlp.gate" for i in MOE_LAYERS]))
    cfg = RefitRunConfig(model="dense", model_overrides=dict(DEEPSEEK_FP8.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         gen_precision="fp8", **layout("tp2 ep2", "tp2"))
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, hf,
                       model_builder=_build, moe_backend="flashinfer_cutlass",
                       num_ports=cfg.train_pp + 2, timeout_s=480)
    for g in (r for r in results if r["role"] == "gen"):
        who = f"gen rank {g['rank']}"
        staged = g["report"]["staged_conversion"]
        assert "model.layers.0.self_attn.kv_b_proj" in staged["layers"], (who, staged["layers"])
        for stats in g["refits"]:
            assert len(stats["derived_refreshed"]) == 4, (who, stats["derived_refreshed"])
            assert "peak_staging_bytes" in stats["derived_staging"], (who, stats)
        assert g["differences"] == [[]] * REFITS, f"{who}: differs from vLLM: {g['differences']}"
        assert g["moved"] == [[]] * REFITS, f"{who}: params moved to new storage: {g['moved']}"
        assert g["weights"]["state"] == "consistent", who
