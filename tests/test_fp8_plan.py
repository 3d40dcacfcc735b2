"""Block-FP8 refit planning and receiver mapping, without processes: where each weight is
quantized, the refusal of splits that cut a 128x128 block (on both sides, before any
communication), and FP8 storage filled from full HF tensors against the independent oracle."""

import dataclasses

import msgspec
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.geometry import box_index, rank_region
from megatron_reshard.fp8.plan import (
    Fp8SplitError,
    plan_block_fp8,
    plan_mxfp8,
    scale_layout_problems,
    scale_placements,
)
from megatron_reshard.layout.placements import BlockShard, PaddedShard, build_mesh_info
from megatron_reshard.wire.metadata import (
    build_nccl_reshard_refit_info,
    restore_refit_info_placements,
)
from megatron_reshard.megatron.qkv import megatron_qkv_layout
from megatron_reshard.fp8.quant import quantize_blockwise_fp8
from megatron_reshard.receiver.fp8_targets import fp8_receive_spec
from megatron_reshard.receiver.full_weights import load_full_weights
from megatron_reshard.receiver.targets import TargetError, VllmTargets
from megatron_reshard.testing.fp8_reference import expected_vllm_fp8_params, reference_block_fp8
from megatron_reshard.testing.vllm_like import (
    build_plain_payload,
    build_vllm_like_model,
    random_hf_state_dict,
)
from megatron_reshard.vllm_layout import qkv_gen_layout
from megatron_reshard.vllm_layout.dense import AttentionHeads
from megatron_reshard.wire.records import ParamRecord, RefitPayload

H = 256


def _ffn_info(inter: int, train_tp: int, gen_tp: int) -> dict:
    meta = {f"model.layers.0.mlp.{p}_proj.weight": {"shape": [inter, H] if p != "down" else [H, inter],
                                                    "dtype": "torch.bfloat16"}
            for p in ("gate", "up", "down")}
    return build_nccl_reshard_refit_info(meta, {"tp_size": train_tp}, {"tp_size": gen_tp},
                                         train_tp, gen_tp)


def _entries(info) -> list[ParamRecord]:
    return list(RefitPayload.of(info).params())


def test_whole_block_train_shards_are_quantized_by_the_sender_with_a_scale_entry_after_each():
    info = _ffn_info(512, train_tp=2, gen_tp=2)
    info, counts = plan_block_fp8(info, stage_world=2)
    assert counts == {"sender": 3, "receiver": 0, "train_fp8": 0}
    entries = _entries(info)
    assert [p.name.rsplit(".", 2)[-2:] for p in entries] == [
        ["gate_proj", "weight"], ["gate_proj", "weight_scale_inv"], ["up_proj", "weight"],
        ["up_proj", "weight_scale_inv"], ["down_proj", "weight"], ["down_proj", "weight_scale_inv"]]
    gate, gate_scale = entries[0], entries[1]
    assert gate.dtype == "torch.float8_e4m3fn" and gate.gen_quant == "sender"
    assert gate_scale.global_shape == (4, 2) and gate_scale.dtype == "torch.float32"
    assert gate_scale.dst_placements == gate.dst_placements
    assert tuple(entries[5].global_shape) == (2, 4)  # down [256, 512]
    # the planned info still goes on the wire as plain data
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(info.to_plain()))
    assert restore_refit_info_placements(wire)["gen_quant"] == {"format": "block_fp8", "block": [128, 128]}


def test_train_shards_that_cut_blocks_leave_quantization_to_the_receiver():
    info = _ffn_info(384, train_tp=2, gen_tp=1)  # 192 rows per train rank
    info, counts = plan_block_fp8(info, stage_world=2)
    assert counts == {"sender": 0, "receiver": 3, "train_fp8": 0}
    assert all(p.dtype == "torch.bfloat16" and p.gen_quant == "receiver" for p in _entries(info))


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


def test_the_oracle_quantizes_a_tile_as_vllm_online_numerics_say():
    w = torch.zeros(130, 3)
    w[0, 0], w[129, 2] = 2.0, -0.5  # two row tiles: amax 2 and 0.5
    q, s = reference_block_fp8(w)
    assert torch.equal(s, 1 / torch.tensor([[224.0], [896.0]]))  # scale_inv = amax / 448
    assert q[0, 0].float() == 448 and q[129, 2].float() == -448
    assert reference_block_fp8(torch.zeros(4, 4))[1].item() == (torch.tensor(1e-4) / 448).item()  # vLLM's amax floor


def _fp8_targets(tp_rank: int, tp_size: int, **override):
    cfg = dict(CFG, **override)
    model = build_vllm_like_model(cfg, tp_rank, tp_size, quant="block_fp8")
    return VllmTargets.from_named_parameters(model.named_parameters(), cfg, tp_rank, tp_size,
                                             label=f"gen rank {tp_rank}")


def _gate_entry(inter: int, gen_tp: int, quantize: bool) -> dict:
    info = _ffn_info(inter, train_tp=1, gen_tp=gen_tp)
    if quantize:
        info, _ = plan_block_fp8(info, stage_world=1)
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
    planned, counts = plan_block_fp8(payload, stage_world=2)
    assert counts["sender"] > 0
    from megatron_reshard.receiver.payload_check import validate_payload
    validate_payload(planned.to_plain(), "gen rank 0")
    RefitPayload.from_plain(planned.to_plain(), "gen rank 0")


def test_training_fp8_weights_are_planned_as_they_are_and_refused_when_a_train_shard_cuts_a_block():
    info = _ffn_info(512, train_tp=2, gen_tp=1)
    names = frozenset(p.name for p in _entries(info))
    info, counts = plan_block_fp8(info, stage_world=2, train_fp8=names)
    assert counts["train_fp8"] == 3
    assert [p.gen_quant for p in _entries(info)][::2] == ["train_fp8"] * 3
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
    info, counts = plan_mxfp8(info, stage_world=2)
    assert counts["receiver"] == 3
    assert all(p.dtype == "torch.bfloat16" for p in _entries(info))
    assert info.gen_quant == {"format": "mxfp8", "block": [1, 32]}
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


# q/k/v per KV group when training TP cuts a KV group (Megatron's rows as BlockShard blocks)

HEADS = AttentionHeads(num_heads=4, num_kv_heads=1, head_dim=128)  # 768 rows per KV group


def _qkv_info(train_tp: int, gen_tp: int, heads: AttentionHeads = HEADS) -> dict:
    """q/k/v entries as the Megatron source builds them: per KV group, Megatron's rows on the
    training mesh (BlockShard when TP > nkv), vLLM's on the generation mesh."""
    train, train_dims = build_mesh_info(train_tp, 0, tp_size=train_tp)
    gen, gen_dims = build_mesh_info(gen_tp, train_tp, tp_size=gen_tp)
    entries = []
    for which in ("q", "k", "v"):
        rows = heads.hf_rows(which) // heads.num_kv_heads
        src_mesh, src_pl = megatron_qkv_layout(train, train_dims, heads, which)
        dst_mesh, dst_pl = qkv_gen_layout(gen, gen_dims, heads.num_kv_heads, which)
        entries.append({"name": f"model.layers.0.self_attn.{which}_proj.weight",
                        "global_shape": (heads.num_kv_heads, rows, H), "dtype": "torch.bfloat16",
                        "src_mesh_info": src_mesh, "src_placements": src_pl,
                        "dst_mesh_info": dst_mesh, "dst_placements": dst_pl})
    return {"layer_names": ["model.layers.0"], "per_layer_params": {"model.layers.0": entries}}


def _assert_rank_scales_are_the_oracles(weight: ParamRecord, scale: ParamRecord,
                                        full: torch.Tensor) -> int:
    """Every rank's shard (both sides) quantized on its own gives the oracle's bytes, and the
    oracle's scales over the region the scale entry's placements give that rank."""
    shape, s_shape = weight.global_shape, scale.global_shape
    q_ref, s_ref = reference_block_fp8(full.reshape(-1, shape[-1]))  # the HF tensor's tiles
    q_ref, s_ref = q_ref.view(torch.uint8).reshape(shape), s_ref.reshape(s_shape)
    checked = 0
    for side in ("src", "dst"):
        for rank in weight.mesh(side).ranks():
            w_box = rank_region(shape, weight.mesh(side), weight.placements(side), rank)[0]
            s_box = rank_region(s_shape, scale.mesh(side), scale.placements(side), rank)[0]
            q, s = quantize_blockwise_fp8(full.reshape(shape)[box_index(w_box)])
            assert torch.equal(q.view(torch.uint8), q_ref[box_index(w_box)]), (side, rank)
            assert torch.equal(s, s_ref[box_index(s_box)]), (side, rank, w_box, s_box)
            checked += 1
    return checked


def test_train_tp_cutting_a_kv_group_on_whole_blocks_gives_scale_blocks_in_tiles_bit_exact():
    info = _qkv_info(train_tp=2, gen_tp=2)
    info, counts = plan_block_fp8(info, stage_world=2)
    assert counts == {"sender": 3, "receiver": 0, "train_fp8": 0}
    entries = _entries(info)
    blocks = {e.name.split(".", 4)[-1]: e.src_placements[-1] for e in entries}
    # rows [384 | 128] of q, [0 | 128] of k and v; scales [3 | 1] and [0 | 1] tiles
    assert blocks == {
        "q_proj.weight": BlockShard(1, (384, 128)), "q_proj.weight_scale_inv": BlockShard(1, (3, 1)),
        "k_proj.weight": BlockShard(1, (0, 128)), "k_proj.weight_scale_inv": BlockShard(1, (0, 1)),
        "v_proj.weight": BlockShard(1, (0, 128)), "v_proj.weight_scale_inv": BlockShard(1, (0, 1))}
    torch.manual_seed(0)
    for weight, scale in zip(entries[::2], entries[1::2]):
        assert scale.dst_placements == weight.dst_placements  # Shard / Replicate stay
        full = torch.randn(weight.global_shape).to(torch.bfloat16)
        assert _assert_rank_scales_are_the_oracles(weight, scale, full) == 4
    # the planned info goes on the wire and comes back with the tile blocks
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(info.to_plain()))
    back = _entries(wire)
    assert back[1].src_placements[-1] == BlockShard(1, (3, 1))
    # the generation ranks' receiver takes each scale entry into its scale box
    for gen_rank in range(2):
        targets = _fp8_targets(gen_rank, 2, num_key_value_heads=1)
        for scale in back[1::2]:
            fp8_receive_spec(targets, scale, rank_in_group=2 + gen_rank)


def test_train_tp_cutting_a_kv_group_off_block_boundaries_leaves_those_weights_to_the_receiver():
    # 192 rows per train rank: q [192 | 192 | 128 | 0] and k [0 | 0 | 64 | 64] cut blocks and
    # travel in bf16; v [0 | 0 | 0 | 128] is whole blocks on every rank: sender-quantized
    info = _qkv_info(train_tp=4, gen_tp=2)
    info, counts = plan_block_fp8(info, stage_world=4)
    assert counts == {"sender": 1, "receiver": 2, "train_fp8": 0}
    q, k, v, v_scale = _entries(info)
    assert [p.gen_quant for p in (q, k, v)] == ["receiver", "receiver", "sender"]
    assert q.dtype == k.dtype == "torch.bfloat16"
    assert v_scale.src_placements[-1] == BlockShard(1, (0, 0, 0, 1))
    torch.manual_seed(1)
    full = torch.randn(v.global_shape).to(torch.bfloat16)
    assert _assert_rank_scales_are_the_oracles(v, v_scale, full) == 6
    names = frozenset(p.name for p in _entries(_qkv_info(4, 2)))
    with pytest.raises(Fp8SplitError, match=r"q_proj.weight: held in blockwise FP8 for training, "
                                            r"but training rank 0 .*\(dim 1 \[0, 192\) of 512"):
        plan_block_fp8(_qkv_info(train_tp=4, gen_tp=2), stage_world=4, train_fp8=names)


def test_scale_placements_count_explicit_sizes_in_tiles_and_refuse_a_cut_boundary():
    shape = (2, 320, 256)  # rows 320: the last row tile is partial
    assert scale_placements([Replicate(), BlockShard(1, (256, 64))], shape) == [
        Replicate(), BlockShard(1, (2, 1))]
    assert scale_placements([{"dim": 1, "blocks": [0, 320]}, {}], shape) == [
        {"dim": 1, "blocks": [0, 3]}, {}]
    assert scale_placements([BlockShard(0, (1, 1)), Shard(2)], shape) == [  # experts dim kept
        BlockShard(0, (1, 1)), Shard(2)]
    assert scale_placements([PaddedShard(-2, 512)], (320, 256)) == [PaddedShard(-2, 4)]
    with pytest.raises(Fp8SplitError, match=r"boundary at 192 \(after mesh coordinate 0\), which "
                                            r"cuts a 128-element FP8 block"):
        scale_placements([BlockShard(1, (192, 128))], shape, where="w_scale_inv")
    # the partial edge tile: each rank's own quantization is the oracle's, bit for bit
    mesh, _ = build_mesh_info(2, 0, tp_size=2)
    weight = {"name": "w", "global_shape": (1, 320, 256), "src_mesh_info": mesh,
              "src_placements": [BlockShard(1, (256, 64))], "dst_mesh_info": mesh,
              "dst_placements": [BlockShard(1, (128, 192))]}
    scale = {**weight, "name": "w_scale_inv", "global_shape": (1, 3, 2),
             "src_placements": scale_placements(weight["src_placements"], (1, 320, 256)),
             "dst_placements": scale_placements(weight["dst_placements"], (1, 320, 256))}
    weight, scale = (ParamRecord.from_entry(dict(e, dtype="torch.bfloat16")) for e in (weight, scale))
    assert scale_layout_problems(weight, scale, stage_world=0) == []
    full = (torch.randn(1, 320, 256) * torch.arange(1, 321).reshape(1, 320, 1)).to(torch.bfloat16)
    assert _assert_rank_scales_are_the_oracles(weight, scale, full) == 4


def test_a_scale_entry_not_in_tiles_of_its_weight_is_refused_naming_param_rank_and_regions():
    info, _ = plan_block_fp8(_qkv_info(train_tp=2, gen_tp=2), stage_world=2)
    q, q_scale = _entries(info)[:2]
    # the defect of issue 13: the scale entry given the weight's row blocks
    stale = dataclasses.replace(q_scale, src_placements=q.src_placements)
    msg = "\n".join(scale_layout_problems(q, stale, stage_world=2))
    assert "q_proj.weight_scale_inv: training rank 0: its scale placements are invalid for " \
           "scales of [1, 4, 2]" in msg and "[384, 128]" in msg
    replicated = dataclasses.replace(q_scale, dst_placements=(Replicate(), Replicate()))
    assert scale_layout_problems(q, replicated, stage_world=2) == [
        "model.layers.0.self_attn.q_proj.weight_scale_inv: generation rank 0: holds weight region "
        "[[0, 1], [0, 256], [0, 256]] of [1, 512, 256], so expected scale region [[0, 1], [0, 2], "
        "[0, 2]], found [[0, 1], [0, 4], [0, 2]] of [1, 4, 2]",
        "model.layers.0.self_attn.q_proj.weight_scale_inv: generation rank 1: holds weight region "
        "[[0, 1], [256, 512], [0, 256]] of [1, 512, 256], so expected scale region [[0, 1], [2, 4], "
        "[0, 2]], found [[0, 1], [0, 4], [0, 2]] of [1, 4, 2]"]


def test_blockwise_fp8_training_qkv_slices_of_a_cut_kv_group_are_views_of_the_tiles():
    from megatron_reshard.megatron.converters import Converted, ModelDims
    from megatron_reshard.megatron.fp8_source import train_fp8_views
    from megatron_reshard.megatron.fp8_storage import BlockwiseFp8Weight

    names = tuple(f"model.layers.0.self_attn.{w}_proj.weight" for w in "qkv")
    conv = Converted("decoder.layers.0.self_attention.linear_qkv.weight", "qkv", names)
    dims = ModelDims(tp_size=2, num_attention_heads=4, num_query_groups=1, head_dim=128,
                     vocab_size=300, gated=True)
    torch.manual_seed(2)
    group = torch.randn(768, H).to(torch.bfloat16)  # one KV group: q 512 | k 128 | v 128
    q_ref, s_ref = reference_block_fp8(group, pow2=True)
    for tp_rank, (lo, hi) in enumerate(((0, 384), (384, 768))):
        shard = group[lo:hi].clone()
        q, s = reference_block_fp8(shard, pow2=True)  # the rank's own tiles, as TE keeps them
        shard.blockwise_fp8 = BlockwiseFp8Weight(q, s)
        views, problems = train_fp8_views([(conv, shard)], dims, tp_rank=tp_rank)
        assert problems == []
        # the rank's slice of each of q, k, v: [384 | 128], [0 | 128], [0 | 128] rows
        for name, (a, b) in zip(names, ((0, 512), (512, 640), (640, 768))):
            a, b = max(a, lo), min(b, hi)
            data, scale = views[name]
            assert data.shape == (1, max(0, b - a), H) and scale.shape == (1, max(0, b - a) // 128, 2)
            if b > a:
                assert torch.equal(data[0].view(torch.uint8), q_ref[a:b].view(torch.uint8))
                assert torch.equal(scale[0], s_ref[a // 128:b // 128])
    # over TP4 each rank holds 192 rows of the group: its own tiles are not the group's
    dims = ModelDims(tp_size=4, num_attention_heads=4, num_query_groups=1, head_dim=128,
                     vocab_size=300, gated=True)
    shard = group[192:384].clone()
    shard.blockwise_fp8 = BlockwiseFp8Weight(*reference_block_fp8(shard, pow2=True))
    views, problems = train_fp8_views([(conv, shard)], dims, tp_rank=1)
    assert views == {} and problems == [
        "decoder.layers.0.self_attention.linear_qkv.weight: blockwise FP8 q/k/v rows of TP rank 1 "
        "(192 rows of a KV group of 768: q/k/v [192, 0, 0]) are not whole 128-row blocks"]
