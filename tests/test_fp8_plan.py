"""Block-FP8 refit planning and receiver mapping, without processes: where each weight is
quantized, the refusal of splits that cut a 128x128 block (on both sides, before any
communication), and FP8 storage filled from full HF tensors against the independent oracle."""

import msgspec
import pytest
import torch

from megatron_reshard.fp8_plan import Fp8SplitError, plan_block_fp8, plan_mxfp8
from megatron_reshard.metadata import (
    build_nccl_reshard_refit_info,
    make_nccl_reshard_refit_info_wire_safe,
    restore_refit_info_placements,
)
from megatron_reshard.receiver.fp8_targets import fp8_receive_spec
from megatron_reshard.receiver.targets import TargetError, VllmTargets, load_full_weights
from megatron_reshard.testing.fp8_reference import expected_vllm_fp8_params, reference_block_fp8
from megatron_reshard.testing.vllm_like import (
    build_plain_payload,
    build_vllm_like_model,
    random_hf_state_dict,
)

H = 256


def _ffn_info(inter: int, train_tp: int, gen_tp: int) -> dict:
    meta = {f"model.layers.0.mlp.{p}_proj.weight": {"shape": [inter, H] if p != "down" else [H, inter],
                                                    "dtype": "torch.bfloat16"}
            for p in ("gate", "up", "down")}
    return build_nccl_reshard_refit_info(meta, {"tp_size": train_tp}, {"tp_size": gen_tp},
                                         train_tp, gen_tp)


def _entries(info: dict) -> list[dict]:
    return [p for layer in info["layer_names"] for p in info["per_layer_params"][layer]]


def test_whole_block_train_shards_are_quantized_by_the_sender_with_a_scale_entry_after_each():
    info = _ffn_info(512, train_tp=2, gen_tp=2)
    counts = plan_block_fp8(info, stage_world=2)
    assert counts == {"sender": 3, "receiver": 0, "train_fp8": 0}
    entries = _entries(info)
    assert [p["name"].rsplit(".", 2)[-2:] for p in entries] == [
        ["gate_proj", "weight"], ["gate_proj", "weight_scale_inv"], ["up_proj", "weight"],
        ["up_proj", "weight_scale_inv"], ["down_proj", "weight"], ["down_proj", "weight_scale_inv"]]
    gate, gate_scale = entries[0], entries[1]
    assert gate["dtype"] == "torch.float8_e4m3fn" and gate["gen_quant"] == "sender"
    assert gate_scale["global_shape"] == (4, 2) and gate_scale["dtype"] == "torch.float32"
    assert gate_scale["dst_placements"] == gate["dst_placements"]
    assert tuple(entries[5]["global_shape"]) == (2, 4)  # down [256, 512]
    # the planned info still goes on the wire as plain data
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(make_nccl_reshard_refit_info_wire_safe(info)))
    assert restore_refit_info_placements(wire)["gen_quant"] == {"format": "block_fp8", "block": [128, 128]}


def test_train_shards_that_cut_blocks_leave_quantization_to_the_receiver():
    info = _ffn_info(384, train_tp=2, gen_tp=1)  # 192 rows per train rank
    assert plan_block_fp8(info, stage_world=2) == {"sender": 0, "receiver": 3, "train_fp8": 0}
    assert all(p["dtype"] == "torch.bfloat16" and p["gen_quant"] == "receiver" for p in _entries(info))


def test_a_generation_split_that_cuts_a_block_is_refused_naming_param_rank_and_sizes():
    info = _ffn_info(768, train_tp=1, gen_tp=4)  # 192 rows per gen rank
    with pytest.raises(Fp8SplitError) as err:
        plan_block_fp8(info, stage_world=1)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight: generation rank 1" in msg
    assert "[[192, 384], [0, 256]]" in msg and "multiple of 128" in msg
    assert "down_proj" in msg  # every violation is listed


CFG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
           intermediate_size=512, moe_intermediate_size=256, num_experts=4, num_hidden_layers=2,
           vocab_size=300, moe_layers=[1])


@pytest.mark.parametrize("fmt", ["block_fp8", "mxfp8"])
@pytest.mark.parametrize("tp_size,ep_size", [(1, 1), (2, 1), (2, 2)])
def test_full_hf_weights_quantize_into_fp8_storage_as_the_oracle_says(tp_size, ep_size, fmt):
    full = random_hf_state_dict(CFG, seed=3)
    for tp_rank in range(tp_size):
        model = build_vllm_like_model(CFG, tp_rank, tp_size, ep_size, quant=fmt)
        targets = VllmTargets.from_named_parameters(model.named_parameters(), CFG, tp_rank, tp_size,
                                                    ep_size=ep_size)
        load_full_weights(targets, full)
        expected = expected_vllm_fp8_params(CFG, full, tp_rank, tp_size, ep_size, fmt=fmt)
        got = dict(model.named_parameters())
        assert set(got) == set(expected)
        for name, want in expected.items():
            assert got[name].dtype == want.dtype, name
            assert torch.equal(got[name].view(torch.uint8) if want.dtype == torch.float8_e4m3fn
                               else got[name], want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn
                               else want), name


def test_the_oracle_quantizes_a_tile_as_nemo_rl_numerics_say():
    w = torch.zeros(130, 3)
    w[0, 0], w[129, 2] = 2.0, -0.5  # two row tiles: amax 2 and 0.5
    q, s = reference_block_fp8(w)
    assert torch.equal(s, 1 / torch.tensor([[224.0], [896.0]]))  # scale = (1 / amax) * 448
    assert q[0, 0].float() == 448 and q[129, 2].float() == -448
    assert reference_block_fp8(torch.zeros(4, 4))[1].item() == 1.0  # amax 0: scale 1


def _fp8_targets(tp_rank: int, tp_size: int, **override):
    cfg = dict(CFG, **override)
    model = build_vllm_like_model(cfg, tp_rank, tp_size, quant="block_fp8")
    return VllmTargets.from_named_parameters(model.named_parameters(), cfg, tp_rank, tp_size,
                                             label=f"gen rank {tp_rank}")


def _gate_entry(inter: int, gen_tp: int, quantize: bool) -> dict:
    info = _ffn_info(inter, train_tp=1, gen_tp=gen_tp)
    if quantize:
        plan_block_fp8(info, stage_world=1)
    return _entries(info)[0]


def test_receiver_refuses_a_region_that_cuts_a_block_of_its_fp8_storage():
    # FFN 384 over gen TP2: each rank's gate_up_proj holds 192 + 192 rows
    targets = _fp8_targets(1, 2, intermediate_size=384)
    entry = _gate_entry(384, gen_tp=2, quantize=False)
    with pytest.raises(TargetError) as err:
        fp8_receive_spec(targets, entry, rank_in_group=2)
    msg = str(err.value)
    assert msg.startswith("model.layers.0.mlp.gate_proj.weight: on gen rank 1")
    assert "cuts a 128x128 FP8 block" in msg and "of 384" in msg


def test_receiver_refuses_fp8_bytes_for_bf16_storage_and_a_wrong_scale_shape():
    bf16 = build_vllm_like_model(CFG, 0, 2)
    targets = VllmTargets.from_named_parameters(bf16.named_parameters(), CFG, 0, 2, label="gen rank 0")
    entry = _gate_entry(512, gen_tp=2, quantize=True)
    with pytest.raises(TargetError, match="payload sends FP8 bytes but the vLLM params"):
        fp8_receive_spec(targets, entry, rank_in_group=1)
    fp8 = _fp8_targets(0, 2)
    fp8.params["model.layers.0.mlp.gate_up_proj.weight_scale_inv"] = torch.zeros(3, 2)
    with pytest.raises(TargetError, match=r"weight_scale_inv' on gen rank 0 .* is \[3, 2\] "
                                          r"torch.float32, expected \[4, 2\]"):
        fp8_receive_spec(fp8, entry, rank_in_group=1)


def test_receiver_bf16_fallback_quantizes_its_region_in_the_post_hook():
    targets = _fp8_targets(1, 2)
    entry = _gate_entry(512, gen_tp=2, quantize=False)  # bf16 on the wire
    spec, plan = fp8_receive_spec(targets, entry, rank_in_group=2)
    gate = torch.randn(512, H).to(torch.bfloat16)
    ctx = spec.begin()
    assert ctx.buf.dtype == torch.bfloat16 and tuple(ctx.buf.shape) == (256, H)
    ctx.buf.copy_(gate[256:])
    spec.finish(ctx)
    q, s = reference_block_fp8(gate)
    got = targets.params["model.layers.0.mlp.gate_up_proj.weight"][:256]
    assert torch.equal(got.view(torch.uint8), q[256:].view(torch.uint8))
    assert torch.equal(targets.params["model.layers.0.mlp.gate_up_proj.weight_scale_inv"][:2], s[2:])
    assert {p.target for p in plan.pieces} == {"model.layers.0.mlp.gate_up_proj.weight",
                                               "model.layers.0.mlp.gate_up_proj.weight_scale_inv"}


def test_plain_payload_planned_for_fp8_restores_and_validates():
    full = random_hf_state_dict(CFG, seed=1)
    payload = restore_refit_info_placements(build_plain_payload(
        CFG, full, {"tp_size": 2}, {"tp_size": 2}, 2, 2))
    counts = plan_block_fp8(payload, stage_world=2)
    assert counts["sender"] > 0
    from megatron_reshard.receiver.payload_check import validate_payload
    validate_payload(make_nccl_reshard_refit_info_wire_safe(payload), "gen rank 0")


def test_training_fp8_weights_are_planned_as_they_are_and_refused_when_a_train_shard_cuts_a_block():
    info = _ffn_info(512, train_tp=2, gen_tp=1)
    names = frozenset(p["name"] for p in _entries(info))
    assert plan_block_fp8(info, stage_world=2, train_fp8=names)["train_fp8"] == 3
    assert [p["gen_quant"] for p in _entries(info)][::2] == ["train_fp8"] * 3
    info = _ffn_info(384, train_tp=2, gen_tp=1)  # 192 rows per train rank
    with pytest.raises(Fp8SplitError, match=r"gate_proj.weight: held in blockwise FP8 for "
                                            r"training, but training rank 0 .* \[0, 192\) of 384"):
        plan_block_fp8(info, stage_world=2, train_fp8=names)


def test_plain_blockwise_fp8_training_weights_round_trip_through_their_dequantized_values():
    from megatron_reshard.megatron.fp8_storage import BlockwiseFp8Weight, blockwise_fp8_storage
    from megatron_reshard.testing.fp8_training import attach_blockwise_fp8_

    layer = torch.nn.Module()
    layer.linear_fc1 = torch.nn.Linear(300, 260, bias=False).to(torch.bfloat16)
    assert attach_blockwise_fp8_(layer) == 1
    weight = layer.linear_fc1.weight
    storage = blockwise_fp8_storage(weight)
    assert storage.data.shape == (260, 300) and storage.scale_inv.shape == (3, 3)
    q, s = reference_block_fp8(weight, pow2=True)
    assert torch.equal(q.view(torch.uint8), storage.data.view(torch.uint8))
    assert torch.equal(s, storage.scale_inv)
    assert blockwise_fp8_storage(torch.zeros(2, 2)) is None
    with pytest.raises(ValueError, match=r"scale_inv \[1, 1\]; expected torch.float8_e4m3fn data "
                                         r"and scale_inv \[3, 3\]"):
        BlockwiseFp8Weight(storage.data, torch.ones(1, 1))


def test_mxfp8_is_planned_for_the_receiver_and_refuses_a_split_that_cuts_a_32_block():
    info = _ffn_info(512, train_tp=2, gen_tp=2)
    assert plan_mxfp8(info, stage_world=2)["receiver"] == 3
    assert all(p["dtype"] == "torch.bfloat16" for p in _entries(info))
    assert info["gen_quant"] == {"format": "mxfp8", "block": [1, 32]}
    info = _ffn_info(192, train_tp=1, gen_tp=4)  # down_proj: 48 columns per gen rank
    with pytest.raises(Fp8SplitError, match=r"down_proj.weight: generation rank 1 .* cuts a 1x32 "
                                            r"FP8 block \(dim 1 \[48, 96\) of 192"):
        plan_mxfp8(info, stage_world=1)


def test_the_mxfp8_oracle_uses_e8m0_power_of_two_scales():
    from megatron_reshard.testing.fp8_reference import reference_mxfp8

    w = torch.zeros(1, 64)
    w[0, 0], w[0, 40] = 448.0, 449.0  # block 0 fits scale 2^0; block 1 needs 2^1
    q, s = reference_mxfp8(w)
    assert s.tolist() == [[127, 128]]
    assert q[0, 0].float() == 448 and q[0, 40].float() == 224  # 449/2 rounds to 224
