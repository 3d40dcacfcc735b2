"""vLLM's and Megatron's per-rank layouts as the refit describes them, checked against
tensors built independently (HF q/k/v interleaved by hand as Megatron holds them, the
test oracle's vLLM shards)."""

import pytest
import torch
from torch.distributed.tensor import Shard

from megatron_reshard.layout.geometry import rank_region, shard_ownerships
from megatron_reshard.layout.placements import BlockShard, build_mesh_info
from megatron_reshard.megatron.qkv import megatron_qkv_blocks, megatron_qkv_layout
from megatron_reshard.testing.vllm_like import expected_vllm_shard, random_hf_state_dict
from megatron_reshard.tools.plan_inputs import RefitParallelism, parallelism_problems, stage_inputs
from megatron_reshard.vllm_layout import (AttentionHeads, expert_block, expert_block_sizes,
                                          expert_gen_placement, qkv_gen_layout)


def test_expert_blocks_follow_vllms_linear_placement():
    assert expert_block_sizes(6, 4) == (2, 2, 1, 1)
    assert expert_block_sizes(10, 4) == (3, 3, 2, 2)
    assert [expert_block(6, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert expert_gen_placement(8, 4) == Shard(0)  # even: the same blocks as torch.chunk
    assert expert_gen_placement(6, 4) == BlockShard(0, (2, 2, 1, 1))


def test_megatron_qkv_blocks_split_a_kv_groups_rows_over_its_tp_ranks():
    # 4 q heads per group + k + v (head dim 4): 24 rows over 2 ranks -> 12 each
    heads = AttentionHeads(8, 2, 4)
    assert [megatron_qkv_blocks(heads, 4, w) for w in "qkv"] == [(12, 4), (0, 4), (0, 4)]
    # one KV head over TP4 (head dim 2): 12 rows, 3 per rank, cutting through heads
    heads = AttentionHeads(4, 1, 2)
    assert [megatron_qkv_blocks(heads, 4, w) for w in "qkv"] == [(3, 3, 2, 0), (0, 0, 1, 1),
                                                                 (0, 0, 0, 2)]


def _interleaved(q, k, v, nkv):
    """Megatron's linear_qkv rows, built by hand: per group, its q heads, then k, then v."""
    return torch.cat([torch.cat([qg, kg, vg]) for qg, kg, vg in
                      zip(q.chunk(nkv), k.chunk(nkv), v.chunk(nkv))])


@pytest.mark.parametrize("nh, nkv, hd, tp", [(8, 2, 4, 1), (8, 2, 4, 2), (8, 2, 4, 4),
                                             (8, 2, 4, 8), (4, 1, 2, 4), (6, 2, 2, 4)])
def test_each_train_ranks_per_group_boxes_are_its_rows_of_linear_qkv(nh, nkv, hd, tp):
    heads, hidden = AttentionHeads(nh, nkv, hd), 3
    g = torch.Generator().manual_seed(0)
    hf = {w: torch.randn(heads.hf_rows(w), hidden, generator=g) for w in "qkv"}
    chunks = _interleaved(hf["q"], hf["k"], hf["v"], nkv).chunk(tp)  # contiguous TP split
    mesh, dims = build_mesh_info(tp, 0, tp_size=tp)
    for rank in range(tp):
        got = []
        for w in "qkv":
            grouped = hf[w].reshape(nkv, -1, hidden)
            split, placements = megatron_qkv_layout(mesh, dims, heads, w)
            box, _ = rank_region(grouped.shape, split, placements, rank)
            got.append(grouped[tuple(slice(a, b) for a, b in box)])  # [groups, rows, H]
        # per group held: its q rows, then k, then v
        assert torch.equal(torch.cat(got, 1).reshape(-1, hidden), chunks[rank]), rank


@pytest.mark.parametrize("gen_tp", [1, 2, 4, 8])
def test_each_gen_ranks_per_group_boxes_are_its_qkv_proj_rows(gen_tp):
    cfg = dict(hidden_size=16, num_attention_heads=8, num_key_value_heads=2, head_dim=4,
               intermediate_size=8, num_hidden_layers=1, vocab_size=64, attention_bias=True)
    full = random_hf_state_dict(cfg, torch.float32)
    mesh, dims = build_mesh_info(gen_tp, 0, tp_size=gen_tp)
    for kind in ("weight", "bias"):
        for rank in range(gen_tp):
            rows = []
            for w in "qkv":
                t = full[f"model.layers.0.self_attn.{w}_proj.{kind}"]
                grouped = t.reshape(2, -1, *t.shape[1:])
                split, placements = qkv_gen_layout(mesh, dims, 2, w)
                box, _ = rank_region(grouped.shape, split, placements, rank)
                rows.append(grouped[tuple(slice(a, b) for a, b in box)].reshape(-1, *t.shape[1:]))
            want = expected_vllm_shard(cfg, f"model.layers.0.self_attn.qkv_proj.{kind}", full,
                                       rank, gen_tp)
            assert torch.equal(torch.cat(rows), want), (kind, rank)


def test_plan_takes_uneven_gen_ep_in_vllms_blocks():
    cfg = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
               head_dim=4, intermediate_size=48, num_experts=6, moe_intermediate_size=16,
               vocab_size=100, tie_word_embeddings=False)
    lay = RefitParallelism(train_world=2, gen_world=4, train_tp=1, train_ep=2, gen_tp=4, gen_ep=4)
    assert parallelism_problems(lay, cfg) == []
    experts = [p for p in stage_inputs(lay, cfg)[0].params if ".experts." in p.name]
    assert experts
    for p in experts:
        shape, *_, d_shape, d_ranks, d_dims = p.key
        own = shard_ownerships(shape, d_shape, d_ranks, d_dims)
        blocks = [own[2 + r].boxes[0][0] for r in range(4)]
        assert blocks == [expert_block(6, r, 4) for r in range(4)], p.name


def test_block_shard_wire_form_round_trips_and_bad_blocks_are_named():
    from megatron_reshard.layout.placements import MeshInfo, placements_to_plain, restore_placement

    pl = BlockShard(0, (2, 2, 1, 1))
    assert placements_to_plain([pl]) == [{"dim": 0, "blocks": [2, 2, 1, 1]}]
    assert restore_placement({"dim": 0, "blocks": [2, 2, 1, 1]}) == pl
    mesh = MeshInfo(torch.arange(4))
    assert [rank_region((6, 3), mesh, [pl], r)[0][0] for r in range(4)] == [(0, 2), (2, 4),
                                                                            (4, 5), (5, 6)]
    with pytest.raises(ValueError, match=r"block sizes \[2, 2, 1, 1\] .* dim of 7"):
        rank_region((7, 3), mesh, [pl], 0)
    with pytest.raises(ValueError, match=r"block sizes must be >= 0"):
        BlockShard(0, (1, -1))


def test_payload_check_refuses_blocks_that_are_not_sizes():
    from megatron_reshard.receiver.payload_check import RefitPayloadError, validate_payload
    from megatron_reshard.testing.vllm_like import build_plain_payload

    cfg = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
               intermediate_size=8, num_hidden_layers=1, vocab_size=64, num_experts=6,
               moe_intermediate_size=8)
    payload = build_plain_payload(cfg, random_hf_state_dict(cfg), {"tp_size": 1},
                                  {"tp_size": 4, "ep_size": 4}, 1, 4)
    validate_payload(payload)  # vLLM's blocks 2, 2, 1, 1 are fine
    entry = next(p for ps in payload["per_layer_params"].values() for p in ps
                 if any(pl.get("blocks") for pl in p["dst_placements"]))
    next(pl for pl in entry["dst_placements"] if pl.get("blocks"))["blocks"] = [2, -1, 4, 1]
    with pytest.raises(RefitPayloadError, match=r"'blocks' must be a non-empty list of integers"):
        validate_payload(payload)
