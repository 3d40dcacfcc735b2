"""Refits into vLLM's online block FP8 (``--quantization fp8_per_block``): a BF16 checkpoint
that vLLM quantizes while loading (``receiver.staged_conversion``, DESIGN "Value transforms").

First the quantizer: ``fp8.quant.quantize_blockwise_fp8`` (what the sender and the receiver
run) and the tests' oracle ``testing.fp8_reference.reference_block_fp8``, each against
vLLM's own ``per_block_cast_to_fp8`` (the function vLLM's online layers call), byte for
byte and bit for bit, on random and edge inputs.

Then the refit: the generation ranks build vLLM 0.33's Qwen3-MoE (one dense layer, three
expert layers) from the BF16 config with ``quantization="fp8_per_block"`` (vLLM's dummy
load quantizes online and runs its post-load); the trainer plans
``gen_quant="block_fp8_online"``: the weights travel in BF16 and each generation rank
quantizes them with vLLM's own ``per_block_cast_to_fp8``, matrix by matrix as vLLM does
(``receiver.online_quant``). Two refits with changed weights from real megatron-core, each compared bit for bit with a
second vLLM model loaded by vLLM's ``load_weights`` from the BF16 HF tensors with the same
online quantization and post-load. FP8 MoE backends: FlashInfer CUTLASS (its conversion
swaps w13 and clamps the scales; one gen rank skips it on purpose and must be caught),
Triton (identity) and FlashInfer TRTLLM (block-major 4-D experts, gen TP and vLLM EP).
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv
pytest.importorskip("compressed_tensors")  # vLLM's quantization registry imports it

from test_fp8_staged_conversion import (MOE_LAYERS, QWEN3_MOE_FP8, _check_staged_table,  # noqa: E402
                                        needs_flashinfer)
from test_real_vllm import REFITS, _build, layout, vllm_config_json  # noqa: E402
from megatron_reshard.fp8.quant import quantize_blockwise_fp8  # noqa: E402
from megatron_reshard.testing.fp8_reference import reference_block_fp8  # noqa: E402
from megatron_reshard.tools.run_config import RefitRunConfig  # noqa: E402
from megatron_reshard.tools.vllm_refit import vllm_refit_job  # noqa: E402

PLANTED_RANK = 1
LINEAR = "Fp8PerBlockOnlineLinearMethod:CutlassFp8BlockScaledMMKernel"


def _edge_inputs() -> dict[str, torch.Tensor]:
    """BF16 matrices (vLLM quantizes the BF16 checkpoint): random with magnitudes changing
    from tile to tile, partial edge tiles, zeros, values under vLLM's amax floor, the bf16
    extremes (largest finite, smallest subnormal) and a tile whose amax is exactly 448."""
    g = torch.Generator().manual_seed(34)
    out = {}
    for shape in [(256, 384), (300, 200), (129, 127), (1, 1), (8, 128), (3, 1000)]:
        w = torch.randn(shape, generator=g)
        rows = torch.arange(shape[0]).reshape(-1, 1) // 64
        cols = torch.arange(shape[1]).reshape(1, -1) // 16
        out[f"random{shape}"] = (w * torch.pow(10.0, ((rows * 7 + cols * 3) % 11 - 5).float())).bfloat16()
    big = torch.finfo(torch.bfloat16).max
    tiny = 2.0 ** -133  # the smallest bf16 subnormal
    mixed = torch.zeros(300, 260, dtype=torch.bfloat16)
    mixed[:128, 128:256] = torch.randn(128, 128, generator=g).bfloat16() * 1e-6  # under the floor
    mixed[128:256, :128] = big
    mixed[128:256, 128:256] = -big
    mixed[256:, :128] = tiny
    mixed[256:, 256:] = torch.randn(44, 4, generator=g).bfloat16() * big / 4
    mixed[0, 0] = 1e-4  # the floor itself
    out["mixed"] = mixed
    exact = torch.randn(130, 130, generator=g).clamp(-1, 1).bfloat16()
    exact[5, 5] = 448.0
    out["amax 448"] = exact
    out["zeros"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    return out


def test_the_block_quantizer_and_the_oracle_are_bit_identical_to_vllms():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    for label, w in _edge_inputs().items():
        want_q, want_s = per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
        assert want_s.dtype == torch.float32 and want_q.dtype == torch.float8_e4m3fn, label
        for who, (q, s) in (("fp8.quant", quantize_blockwise_fp8(w)),
                            ("fp8_reference", reference_block_fp8(w))):
            assert q.shape == want_q.shape and s.shape == want_s.shape, (label, who)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (label, who)
            assert torch.equal(s.view(torch.int32), want_s.view(torch.int32)), (label, who)
    # experts quantized as one [E, N, K] tensor: each expert's bytes are vLLM's of it alone
    one = _edge_inputs()["random(300, 200)"]
    experts = torch.stack([one, (one.float() * 3).bfloat16()])
    q, s = quantize_blockwise_fp8(experts)
    for e in range(2):
        want_q, want_s = per_block_cast_to_fp8(experts[e], block_size=[128, 128])
        assert torch.equal(q[e].view(torch.uint8), want_q.view(torch.uint8)), e
        assert torch.equal(s[e], want_s), e


def test_a_changed_quantizer_is_caught():
    """The comparison above sees one rounding step of difference: a scale computed as the
    reciprocal of 448 / amax (the numerics before vLLM's) differs from vLLM's bytes."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = _edge_inputs()["random(256, 384)"]
    want_q, want_s = per_block_cast_to_fp8(w, block_size=[128, 128])
    amax = w.float().reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    other = torch.reciprocal(torch.reciprocal(amax) * 448.0)
    assert not torch.equal(other, want_s)


def _cfg(gen: str = "tp2", gen_precision: str = "fp8_online") -> RefitRunConfig:
    return RefitRunConfig(model="dense", model_overrides=dict(QWEN3_MOE_FP8.model), refits=REFITS,
                          verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                          gen_precision=gen_precision, **layout("tp2 ep2", gen))


def _online_refit(pool, moe_backend: str, gen: str = "tp2", **options) -> list[dict]:
    cfg = _cfg(gen)
    assert cfg.gen_quant == "block_fp8_online"
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), model_builder=_build,
                       moe_backend=moe_backend, quantization="fp8_per_block",
                       num_ports=cfg.train_pp + 2, timeout_s=600, **options)
    return [r for r in results if r["role"] == "gen"]


def _check_bit_equal(g: dict, moe: str, local_experts: int = 8) -> dict:
    who = f"gen rank {g['rank']}"
    staged = g["report"]["staged_conversion"]
    assert sorted(staged["backends"]) == sorted([LINEAR, f"Fp8PerBlockOnlineMoEMethod:{moe}"]), (who, staged)
    # every linear layer (routers included: vLLM quantizes them too) and every expert layer
    assert len(staged["layers"]) == 4 + 4 * len(MOE_LAYERS), (who, staged["layers"])
    assert staged["conversions"] == REFITS * len(staged["layers"]), (who, staged)
    for stats in g["refits"]:
        assert sorted(stats["staged_converted"]) == sorted(staged["layers"]), who
    assert g["differences"] == [[]] * REFITS, f"{who}: differs from vLLM: {g['differences']}"
    assert g["moved"] == [[]] * REFITS, f"{who}: params moved to new storage: {g['moved']}"
    assert g["weights"]["state"] == "consistent" and g["weights"]["version"] == REFITS, who
    # every online matrix quantized on this rank by vLLM's function, once per refit: the
    # linear weights (qkv, o, gate_up, down of the dense layer, routers) and each expert's
    # w13 and w2 (vLLM's function per expert)
    matrices = 4 + len(MOE_LAYERS) * (3 + 2 * local_experts)
    for i, stats in enumerate(g["refits"]):
        online = stats["online_quant"]  # counted over the session
        assert online["matrices"] == (i + 1) * matrices, (who, online)
        assert online["pending_bytes"] == 0 and online["peak_pending_bytes"] > 0, (who, online)
    return staged


@pytest.fixture(scope="module")
def cutlass_online(pool):
    return _online_refit(pool, "flashinfer_cutlass", plant_staged_error_on=PLANTED_RANK)


@pytest.mark.vllm_range
def test_online_block_fp8_refit_is_bit_equal_to_vllms_online_loading(cutlass_online):
    for g in cutlass_online:
        if g["rank"] != PLANTED_RANK:
            staged = _check_bit_equal(g, "FLASHINFER_CUTLASS")
            assert staged["peak_staging_bytes"] > 0, staged  # the swap of w13 and its scales
            _check_staged_table(g, staging=True)


@pytest.mark.vllm_range
def test_a_skipped_conversion_of_an_online_layer_fails_the_comparison(cutlass_online):
    planted = next(g for g in cutlass_online if g["rank"] == PLANTED_RANK)
    layer = "model.layers.1.mlp.experts.routed_experts"
    assert planted["differences"] == [[f"{layer}.w13_weight", f"{layer}.w13_weight_scale_inv"]] * REFITS, \
        planted["differences"]


def test_online_block_fp8_triton_experts(pool):
    for g in _online_refit(pool, "triton"):
        staged = _check_bit_equal(g, "TRITON")
        assert staged["peak_staging_bytes"] == 0, staged  # Triton's conversion is the identity


@needs_flashinfer
def test_online_block_fp8_trtllm_experts_under_vllm_ep(pool):
    for g in _online_refit(pool, "flashinfer_trtllm", gen="tp2 ep2"):
        staged = _check_bit_equal(g, "FLASHINFER_TRTLLM", local_experts=4)
        assert staged["peak_staging_bytes"] > 0, staged


def test_what_an_online_block_layer_holds_and_which_payloads_it_takes(pool):
    """After vLLM's online quantization a layer holds block FP8 as a checkpoint would
    (float8_e4m3fn weights of the checkpoint's shape, fp32 scale_inv per 128x128 tile,
    experts [E, ...]); a payload planned for BF16, or one sending training FP8 bytes, is
    refused naming the layer and gen_quant="block_fp8"; a block-FP8 payload is taken."""
    from megatron_reshard.testing.vllm_staged_checks import online_block_job

    (out,) = pool.run(online_block_job, 1, vllm_config_json(QWEN3_MOE_FP8), num_ports=1,
                      timeout_s=300)
    methods = {m for _, m, _ in out["staged"]}
    assert methods == {"Fp8PerBlockOnlineLinearMethod", "Fp8PerBlockOnlineMoEMethod"}, out["staged"]
    held = out["held"]
    assert held["model.layers.0.self_attn.qkv_proj.weight"] == ((768, 128), "torch.float8_e4m3fn")
    assert held["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == ((6, 1), "torch.float32")
    assert held["model.layers.1.mlp.gate.weight"] == ((8, 128), "torch.float8_e4m3fn")
    experts = "model.layers.1.mlp.experts.routed_experts."
    assert held[experts + "w13_weight"] == ((8, 512, 128), "torch.float8_e4m3fn")
    assert held[experts + "w13_weight_scale_inv"] == ((8, 4, 1), "torch.float32")
    assert held[experts + "w2_weight_scale_inv"] == ((8, 1, 2), "torch.float32")
    message = out["bf16_payload"]
    assert message and message.startswith("model.layers.0.self_attn.qkv_proj: quant method "
                                          "Fp8PerBlockOnlineLinearMethod"), message
    assert "planned for BF16" in message and 'gen_quant="block_fp8_online"' in message, message
    assert "training FP8 bytes" in out["train_fp8_payload"], out["train_fp8_payload"]
    assert out["block_payload"] is None, out["block_payload"]


def test_a_bf16_payload_into_online_fp8_stops_every_rank_at_prepare_refit(pool):
    """The trainer left gen_quant unset (a BF16 payload) while vLLM quantizes online: every
    generation rank refuses at ``prepare_refit`` naming the layer and gen_quant="block_fp8",
    the training ranks raise the same refusal (fault boards); no byte moves."""
    from megatron_reshard.tools.worlds import RankFailure

    cfg = _cfg(gen_precision="bf16")
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), model_builder=_build,
                       moe_backend="flashinfer_cutlass", quantization="fp8_per_block",
                       num_ports=cfg.train_pp + 2, timeout_s=600, return_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    for r in results:
        assert "Fp8PerBlockOnlineLinearMethod" in r.text and 'gen_quant="block_fp8_online"' in r.text, \
            (r.rank, r.text[-2000:])
    gens = [r for r in results if r.rank >= cfg.train_world]
    assert gens and all("prepare_refit" in r.text and "KernelLayoutError" in r.text for r in gens)


@pytest.mark.vllm_range
def test_a_sender_quantized_plan_into_online_fp8_is_refused_before_any_byte_moves(pool):
    """The plan before this rule (``gen_quant="block_fp8"``: the trainer quantizes with
    ``fp8.quant``) into vLLM's online block FP8: on an H200 it gave one element of an
    expert's w2 one FP8 step off vLLM's own loading, silently. Now every generation rank
    refuses it while mapping at ``prepare_refit`` (a TargetError naming the param, the
    rank, what was expected, what was found, the setting and why); the training ranks raise
    the same refusal (fault boards) and no refit starts."""
    from megatron_reshard.tools.worlds import RankFailure

    cfg = _cfg(gen_precision="fp8")
    assert cfg.gen_quant == "block_fp8"
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), model_builder=_build,
                       moe_backend="triton", quantization="fp8_per_block",
                       num_ports=cfg.train_pp + 2, timeout_s=600, return_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    for r in results:
        text = r.text
        assert "TargetError" in text and "a layer vLLM quantizes online" in text, (r.rank, text[-2000:])
        assert "expected the weight in BF16" in text and "found FP8 bytes quantized by the " \
               "sender (gen_quant 'sender'" in text, (r.rank, text[-2000:])
        assert 'gen_quant="block_fp8_online"' in text and "H200" in text, (r.rank, text[-2000:])
        # the param (HF name), the rank, and the vLLM param it lands in
        assert re.search(r"TargetError: model\.layers\.\d+\.\S+_proj\.weight: on gen rank \d "
                         r"\(tp_rank \d of 2, ep_rank 0 of 1\) it lands in 'model\.layers\.", text), \
            (r.rank, text[text.find("TargetError"):])
    gens = [r for r in results if r.rank >= cfg.train_world]
    assert gens and all("prepare_refit" in r.text for r in gens)


@pytest.mark.vllm_range
def test_the_receivers_bytes_come_from_vllms_own_quantizer(pool):
    """What the GPU showed, made visible on the CPU: vLLM's ``per_block_cast_to_fp8`` (the
    name vLLM's online layers call) replaced in every generation process by a variant one
    element off per matrix it quantizes. vLLM's own online loading (the oracle) takes the
    variant; so must the refit, matrix for matrix: bit-equal again, and the receiver
    called it once per matrix vLLM quantizes. A refit whose bytes came from any other
    quantizer (the trainer's ``fp8.quant``, or vLLM's function called on other matrices)
    differs in those elements."""
    matrices = 4 + len(MOE_LAYERS) * (3 + 2 * 8)
    for g in _online_refit(pool, "triton", patch_block_quantizer=True):
        assert g["patched_calls_in_refits"] == [matrices] * REFITS, g["patched_calls_in_refits"]
        _check_bit_equal(g, "TRITON")


def test_online_block_fp8_weights_on_the_packed_path(pool):
    """Attention and the experts' down projections sent as full BF16 tensors (the packed
    path, ``packed_params``): the receiver slices them and gathers vLLM's matrices from them
    as from the exact path; both refits bit-equal to vLLM's own online loading."""
    cfg = RefitRunConfig(**{**_cfg().__dict__, "packed_params": r"self_attn\.|down_proj"})
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), model_builder=_build,
                       moe_backend="triton", quantization="fp8_per_block",
                       num_ports=cfg.train_pp + 2, timeout_s=600)
    for g in (r for r in results if r["role"] == "gen"):
        _check_bit_equal(g, "TRITON")
        assert all(s["misc_bytes"] > 0 for s in g["refits"]), g["refits"]


@pytest.mark.parametrize("transport", ["colocated", "p2p"])
def test_online_block_fp8_through_the_weight_transfer_backend(pool, transport):
    """The other front door (vLLM's weight-transfer engine, driven as vLLM's GPU worker
    drives it), over both transports: two refits into online block-FP8 layers, bit-equal
    to vLLM's own online loading of the BF16 tensors."""
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job

    cfg = RefitRunConfig(**{**_cfg().__dict__, "transport": transport})
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), moe_backend="flashinfer_cutlass",
                       quantization="fp8_per_block", num_ports=cfg.train_pp + 2, timeout_s=600)
    assert {r["transport"] for r in results if r["role"] == "train"} == {transport}
    for g in (r for r in results if r["role"] == "gen"):
        assert g["engine"] == "MegatronReshardWeightTransferEngine"
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        assert g["versions"] == list(range(1, REFITS + 1)), g["rank"]


def test_experts_vllm_pads_to_whole_tiles_are_refused_before_any_byte_moves(pool):
    """A per-rank expert intermediate size that is not whole tiles (192): vLLM's online MoE
    method pads it to 256 (zeros between gate and up), storage the refit does not write
    through; every rank stops while mapping (a TargetError naming w13 and both shapes),
    never a silent write."""
    from megatron_reshard.tools.worlds import RankFailure

    padded = dict(QWEN3_MOE_FP8.model, moe_ffn_hidden_size=192)
    cfg = RefitRunConfig(model="dense", model_overrides=padded, refits=REFITS, verify=False,
                         dtype="bfloat16", quiet=True, timeout_s=120, gen_precision="fp8_online",
                         **layout("tp2 ep2", "tp1"))
    family = type(QWEN3_MOE_FP8)(padded, QWEN3_MOE_FP8.hf_class, QWEN3_MOE_FP8.hf_extra, ())
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), model_builder=_build, moe_backend="triton",
                       quantization="fp8_per_block", num_ports=cfg.train_pp + 2, timeout_s=600,
                       return_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    for r in results:
        assert "TargetError" in r.text and "routed_experts.w13_weight' has shape [8, 512, 128], " \
               "expected [8, 384, 128]" in r.text, (r.rank, r.text[-2000:])



def test_online_block_fp8_deltas_stay_full_while_routers_are_quantized_on_receive(pool):
    """Online block FP8 with Triton experts (an identity conversion), Adam steps, deltas
    asked for. vLLM quantizes the routers too, which the plan sends in BF16 and the
    receiver quantizes through a hook: no storage to diff in place, so every refit is full,
    the reason says why, and each is bit-equal to vLLM's own online loading."""
    cfg = RefitRunConfig(**{**_cfg().__dict__, "refits": 3, "delta": True, "update": "adam"})
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(QWEN3_MOE_FP8), model_builder=_build,
                       moe_backend="triton", quantization="fp8_per_block",
                       num_ports=cfg.train_pp + 2, timeout_s=600)
    for res in results:
        refits = res["refits"]
        assert [r["mode"] for r in refits] == ["full"] * 3, refits
        for r in refits[1:]:
            assert "holds a delta param through a hook" in r["full_reason"], r["full_reason"]
        if res["role"] == "gen":
            assert res["differences"] == [[]] * 3, res["differences"]
