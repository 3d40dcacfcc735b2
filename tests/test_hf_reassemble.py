"""The oracle's reassembly (tests/hf_reassemble.py) against the project's vLLM-layout oracle.

Two independent writings of vLLM's per-rank layouts must agree: slicing full HF tensors
with ``testing.vllm_like.expected_vllm_shard`` and putting the slices back together with
``hf_reassemble`` gives the original tensors, for every layout below. Single process.
"""

import pytest
import torch

from hf_reassemble import Dims, hf_state_dict_from_vllm_shards
from megatron_reshard.testing.vllm_like import expected_vllm_shard, random_hf_state_dict, vllm_param_shapes

DENSE = dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
             intermediate_size=48, num_hidden_layers=2, vocab_size=300, qk_norm=True)
MOE = dict(DENSE, num_experts=6, moe_intermediate_size=16, num_experts_per_tok=2)


def _dims(cfg: dict) -> Dims:
    return Dims(num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                vocab_size=cfg["vocab_size"], num_experts=cfg.get("num_experts", 0))


def _shards(cfg: dict, full: dict, tp: int, ep: int) -> list[dict]:
    return [{n: expected_vllm_shard(cfg, n, full, r, tp, ep) for n in vllm_param_shapes(cfg, r, tp, ep)}
            for r in range(tp)]


@pytest.mark.parametrize("cfg, tp, ep", [
    pytest.param(DENSE, 1, 1, id="dense-tp1"),
    pytest.param(DENSE, 2, 1, id="dense-tp2"),
    pytest.param(DENSE, 4, 1, id="dense-tp4-kv-replicated"),
    pytest.param(DENSE, 8, 1, id="dense-tp8-kv-replicated"),
    pytest.param(dict(DENSE, attention_bias=True, tie_word_embeddings=True), 4, 1, id="bias-tied-tp4"),
    pytest.param(dict(DENSE, num_key_value_heads=1), 2, 1, id="mqa-tp2"),
    pytest.param(MOE, 2, 1, id="moe-tp2"),
    pytest.param(MOE, 2, 2, id="moe-ep2"),
    pytest.param(MOE, 4, 4, id="moe-ep4-uneven"),  # 6 experts over EP4: blocks of 2, 2, 1, 1
    pytest.param(dict(MOE, shared_expert_intermediate_size=24, attention_bias=True), 2, 1,
                 id="shared-expert-bias-tp2"),
    pytest.param(dict(MOE, shared_expert_intermediate_size=24), 4, 4, id="shared-expert-ep4"),
])
def test_reassembly_inverts_the_vllm_layout(cfg, tp, ep):
    full = random_hf_state_dict(cfg, torch.float32, seed=tp * 10 + ep)
    got = hf_state_dict_from_vllm_shards(_shards(cfg, full, tp, ep), _dims(cfg), ep_size=ep)
    assert sorted(got) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(got[name], tensor), name


def test_reassembly_refuses_a_stale_kv_replica():
    full = random_hf_state_dict(DENSE, torch.float32)
    shards = _shards(DENSE, full, 4, 1)  # ranks 0 and 1 both hold KV head 0
    name = "model.layers.1.self_attn.qkv_proj.weight"
    shards[1][name] = shards[1][name].clone()
    shards[1][name][-1, 0] += 1.0  # a v row of the replica on rank 1
    with pytest.raises(AssertionError, match=r"qkv_proj.weight \(v head 0\): gen rank 1"):
        hf_state_dict_from_vllm_shards(shards, _dims(DENSE))


def test_reassembly_refuses_unwritten_storage():
    full = random_hf_state_dict(MOE, torch.float32)
    shards = _shards(MOE, full, 2, 2)
    shards[1]["model.layers.0.mlp.experts.w2_weight"][2, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="w2_weight: gen rank 1 still holds NaN"):
        hf_state_dict_from_vllm_shards(shards, _dims(MOE), ep_size=2)
