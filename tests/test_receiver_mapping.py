"""HF names land in vLLM's per-rank storage exactly as vLLM lays it out (single process).

The oracle is ``expected_vllm_shard`` (plain slicing, written independently). The bulk
tests deliver each payload region with a local copy cut by torch.chunk from the full
tensor, standing in for the transport, which the end-to-end test covers.
"""

import pytest
import torch

from megatron_reshard.receiver.full_weights import coverage_gaps, load_full_weights
from megatron_reshard.receiver.incoming import restore_payload
from megatron_reshard.receiver.param_map import build_receiver_param_map
from megatron_reshard.receiver.targets import VllmTargets
from megatron_reshard.vllm_layout.moe import expert_block
from megatron_reshard.testing.vllm_like import (
    build_plain_payload,
    build_vllm_like_model,
    expected_vllm_shard,
    grouped_hf_tensors,
    random_hf_state_dict,
)

DENSE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             intermediate_size=64, num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False,
             gated=True, qk_norm=True, family="qwen3")
CONFIGS = {
    "dense": DENSE,
    "dense_nongated_llama": dict(DENSE, gated=False, qk_norm=False, num_key_value_heads=8,
                                 head_dim=None, family="llama"),
    "moe": dict(DENSE, num_experts=8, moe_intermediate_size=32, family="qwen3_moe"),
    "moe_first_layer_dense": dict(DENSE, num_experts=8, moe_intermediate_size=32, moe_layers=[1]),
    "moe_nongated": dict(DENSE, num_experts=8, moe_intermediate_size=32, gated=False),
    "qwen2_moe": dict(DENSE, num_experts=8, moe_intermediate_size=32, qk_norm=False,
                      attention_bias=True, tie_word_embeddings=True,
                      shared_expert_intermediate_size=32, family="qwen2_moe"),
    # GLM-4.5: q/k/v biases, DeepSeek's shared_experts and score-correction bias, first layer
    # dense; vLLM holds the router gate.weight in float32 (the BF16 wire is widened on write)
    "glm4_moe": dict(DENSE, num_experts=8, moe_intermediate_size=32, qk_norm=False,
                     attention_bias=True, shared_expert_intermediate_size=32,
                     router_expert_bias=True, moe_layers=[1], family="glm4_moe"),
}
LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 4)]  # (gen tp, gen ep)


def _cases(moe_only_for_ep=True):
    for name, cfg in CONFIGS.items():
        for tp, ep in LAYOUTS:
            if ep > 1 and not cfg.get("num_experts"):
                continue
            yield pytest.param(name, tp, ep, id=f"{name}-tp{tp}-ep{ep}")


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _slice_by_placements(full, mesh, placements, rank):
    coord = (mesh.mesh == rank).nonzero()[0].tolist()
    t = full
    for axis, p in enumerate(placements):
        if getattr(p, "dim", None) is not None:
            t = torch.chunk(t, mesh.shape[axis], dim=p.dim)[coord[axis]]
    return t


@pytest.mark.parametrize("name,tp,ep", list(_cases()))
def test_full_weights_land_where_vllm_keeps_them(name, tp, ep):
    cfg = CONFIGS[name]
    full = random_hf_state_dict(cfg, seed=1)
    for rank in range(tp):
        for nesting in (False, True):
            model = build_vllm_like_model(cfg, rank, tp, ep, routed_experts_nesting=nesting)
            targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, rank, tp, ep)
            load_full_weights(targets, full)
            for vname, p in model.named_parameters():
                assert _same(p, expected_vllm_shard(cfg, vname, full, rank, tp, ep)), (vname, rank)
            plans = [targets.resolve(n, t.shape) for n, t in full.items()]
            assert coverage_gaps(targets, plans) == {}


@pytest.mark.parametrize("name,tp,ep", list(_cases()))
@pytest.mark.parametrize("strided_in_place", [True, False])
def test_bulk_payload_regions_land_where_vllm_keeps_them(name, tp, ep, strided_in_place):
    cfg = CONFIGS[name]
    full = random_hf_state_dict(cfg, seed=2)
    grouped = grouped_hf_tensors(full)
    train_world = 2
    payload = restore_payload(build_plain_payload(cfg, full, {"tp_size": 2}, {"tp_size": tp, "ep_size": ep},
                                                  train_world, tp))
    for rank in range(tp):
        model = build_vllm_like_model(cfg, rank, tp, ep)
        targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, rank, tp, ep)
        specs, plans = build_receiver_param_map(payload, targets, train_world + rank, strided_in_place)
        bulk_names = [p.name for ps in payload.per_layer_params.values() for p in ps]
        assert sorted(specs.specs) == sorted(bulk_names)
        for ps in payload.per_layer_params.values():
            for p in ps:
                spec = specs.get(p.name)
                ctx = spec.begin()
                ctx.buf.copy_(_slice_by_placements(grouped[p.name], p.dst_mesh_info,
                                                   p.dst_placements, train_world + rank))
                spec.finish(ctx)
        other_names = [e.name for e in payload.other_params]
        load_full_weights(targets, {n: full[n] for n in other_names})
        for vname, param in model.named_parameters():
            assert _same(param, expected_vllm_shard(cfg, vname, full, rank, tp, ep)), (vname, rank)
        others = [targets.resolve(n, full[n].shape) for n in other_names]
        assert coverage_gaps(targets, plans + others) == {}


def _spec_kinds(cfg, tp, ep, strided_in_place):
    full = random_hf_state_dict(cfg, seed=3)
    payload = restore_payload(build_plain_payload(cfg, full, {"tp_size": 1}, {"tp_size": tp, "ep_size": ep},
                                                  1, tp))
    model = build_vllm_like_model(cfg, 0, tp, ep)
    params = dict(model.named_parameters())
    targets = VllmTargets.from_named_parameters(params, cfg, 0, tp, ep)
    specs, _ = build_receiver_param_map(payload, targets, 1, strided_in_place)
    return params, specs


def test_contiguous_regions_are_received_in_place_without_hooks():
    params, specs = _spec_kinds(CONFIGS["dense"], 2, 1, strided_in_place=False)
    gate = specs.get("model.layers.0.mlp.gate_proj.weight")
    up = specs.get("model.layers.0.mlp.up_proj.weight")
    down = specs.get("model.layers.0.mlp.down_proj.weight")
    fused = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate.pre is gate.post is up.pre is down.pre is None
    assert gate.base.data_ptr() == fused.data_ptr()  # rows [0, F/T): gate_r
    assert up.base.data_ptr() == fused.data_ptr() + fused.shape[0] // 2 * fused.stride(0) * fused.element_size()
    assert down.base.data_ptr() == params["model.layers.0.mlp.down_proj.weight"].data_ptr()


def test_strided_expert_halves_get_a_buffer_only_when_asked():
    moe = CONFIGS["moe"]
    params, in_place = _spec_kinds(moe, 2, 1, strided_in_place=True)
    _, buffered = _spec_kinds(moe, 2, 1, strided_in_place=False)
    gate = "model.layers.0.mlp.experts.gate_proj.weight"
    down = "model.layers.0.mlp.experts.down_proj.weight"
    assert in_place.get(gate).pre is None and not in_place.get(gate).base.is_contiguous()
    assert buffered.get(gate).pre is not None and buffered.get(gate).post is not None
    assert buffered.get(down).pre is None  # w2 is the whole target: written in place
    # one expert per rank: the gate half of w13 is a contiguous slice, so no buffer
    one_each = dict(moe, num_experts=2)
    _, specs = _spec_kinds(one_each, 2, 2, strided_in_place=False)
    assert specs.get(gate).pre is None and specs.get(gate).base.is_contiguous()


def test_kv_heads_are_replicated_when_tp_exceeds_kv_heads():
    cfg = DENSE  # 2 KV heads at TP 4: ranks 0,1 hold head 0; ranks 2,3 hold head 1
    full = random_hf_state_dict(cfg, seed=4)
    k = full["model.layers.0.self_attn.k_proj.weight"]
    hd, q_rows = cfg["head_dim"], cfg["num_attention_heads"] // 4 * cfg["head_dim"]
    for rank in range(4):
        model = build_vllm_like_model(cfg, rank, 4)
        load_full_weights(VllmTargets.from_named_parameters(model.named_parameters(), cfg, rank, 4), full)
        qkv = dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
        head = rank // 2
        assert _same(qkv[q_rows:q_rows + hd], k[head * hd:(head + 1) * hd])


def test_vocab_padding_rows_are_zero():
    cfg = DENSE  # vocab 100 -> padded 128 -> 32 rows per rank at TP 4; rank 3 holds rows 96..127
    full = random_hf_state_dict(cfg, seed=5)
    model = build_vllm_like_model(cfg, 3, 4)
    load_full_weights(VllmTargets.from_named_parameters(model.named_parameters(), cfg, 3, 4), full)
    embed = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert embed.shape[0] == 32
    assert _same(embed[:4], full["model.embed_tokens.weight"][96:100])
    assert torch.count_nonzero(embed[4:]) == 0


def test_expert_blocks_give_the_remainder_to_the_first_ranks():
    assert [expert_block(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [expert_block(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_uneven_experts_over_ep_follow_vllm_blocks_when_loaded_whole():
    cfg = dict(CONFIGS["moe"], num_experts=6)  # EP 4: ranks hold 2, 2, 1, 1 experts
    full = random_hf_state_dict(cfg, seed=6)
    for rank in range(4):
        model = build_vllm_like_model(cfg, rank, 4, 4)
        load_full_weights(VllmTargets.from_named_parameters(model.named_parameters(), cfg, rank, 4, 4), full)
        w13 = dict(model.named_parameters())["model.layers.1.mlp.experts.w13_weight"]
        assert w13.shape[0] == (2 if rank < 2 else 1)
        assert _same(w13, expected_vllm_shard(cfg, "model.layers.1.mlp.experts.w13_weight", full, rank, 4, 4))


@pytest.mark.parametrize("name,ep", [("dense", 1), ("moe", 1), ("moe", 2)])
def test_generation_replicas_each_receive_the_full_tp_layout(name, ep):
    cfg, tp, replicas, train_world = CONFIGS[name], 2, 2, 2
    full = random_hf_state_dict(cfg, seed=8)
    grouped = grouped_hf_tensors(full)
    payload = restore_payload(build_plain_payload(cfg, full, {"tp_size": 2}, {"tp_size": tp, "ep_size": ep},
                                                  train_world, tp * replicas))
    for gen_rank in range(tp * replicas):
        rank = gen_rank % tp
        model = build_vllm_like_model(cfg, rank, tp, ep)
        targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, rank, tp, ep)
        specs, plans = build_receiver_param_map(payload, targets, train_world + gen_rank)
        for ps in payload.per_layer_params.values():
            for p in ps:
                spec = specs.get(p.name)
                spec.base.copy_(_slice_by_placements(grouped[p.name], p.dst_mesh_info,
                                                     p.dst_placements, train_world + gen_rank))
        bulk_targets = {piece.target for plan in plans for piece in plan.pieces}
        assert len(bulk_targets) == 4  # two layers x (gate_up_proj, down_proj) or (w13, w2)
        for vname, param in model.named_parameters():
            if vname in bulk_targets:
                assert _same(param, expected_vllm_shard(cfg, vname, full, rank, tp, ep)), (vname, gen_rank)


def test_a_float32_target_takes_bf16_widened_but_a_narrower_target_is_refused():
    """GLM-4.5's router: vLLM holds it in float32, the wire carries BF16; received into a
    BF16 buffer, then widened exactly. The other way (float32 wire, BF16 target) would lose
    bits and is refused, naming the param."""
    from megatron_reshard.receiver.targets import TargetError, bulk_receive_plan, receive_spec

    cfg = CONFIGS["glm4_moe"]
    name = "model.layers.1.mlp.gate.weight"
    model = build_vllm_like_model(cfg, 1, 2)
    targets = VllmTargets.from_named_parameters(model.named_parameters(), cfg, 1, 2)
    bf16 = random_hf_state_dict(cfg, seed=4)[name]
    plan = bulk_receive_plan(targets, name, bf16.shape, tuple((0, n) for n in bf16.shape), torch.bfloat16)
    spec = receive_spec(targets, plan.pieces[0], wire_dtype=torch.bfloat16)
    ctx = spec.begin()
    assert ctx.buf.dtype == torch.bfloat16
    ctx.buf.copy_(bf16)
    spec.finish(ctx)
    assert _same(dict(model.named_parameters())[name], bf16.float())
    narrow = dict(cfg, family="qwen3_moe", shared_expert_intermediate_size=None)
    full = {n: t.float() for n, t in random_hf_state_dict(narrow, seed=3).items()}
    model = build_vllm_like_model(narrow, 0, 1)
    targets = VllmTargets.from_named_parameters(model.named_parameters(), narrow, 0, 1)
    with pytest.raises(TargetError, match=r"model\.embed_tokens\.weight: dtype mismatch.*wire dtype torch\.float32"):
        load_full_weights(targets, full)
