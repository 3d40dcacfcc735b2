"""BF16 training -> block-FP8 generation, end to end on CPU: real megatron-core training
ranks, vLLM-layout FP8 storage on the generation ranks.

Every generation parameter (FP8 bytes, fp32 scales, the BF16 rest) is compared bit for
bit after every refit against the independent quantizer (``testing.fp8_reference``)
applied to the full HF tensors and sliced by the vLLM layout.
"""

from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.run_config import RefitRunConfig


def _refit_job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


def _run(pool, **overrides):
    cfg = RefitRunConfig(**{"refits": 2, "quiet": True, "timeout_s": 60, "gen_precision": "fp8",
                            **overrides})
    results = pool.run(_refit_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=300)
    return summarize(cfg, results)


def test_dense_train_tp2_to_gen_tp2_sender_quantized_bit_exact(pool):
    summary = _run(pool, model="dense", train_world=2, train_tp=2, train_pp=1, train_ep=1,
                   gen_world=2, gen_tp=2)
    assert summary["verified"], summary["per_gen_rank"]


def test_moe_train_tp2_ep2_to_gen_tp2_experts_tp_sharded_bit_exact(pool):
    summary = _run(pool, model="moe", train_world=4, train_tp=2, train_pp=1, train_ep=2,
                   gen_world=2, gen_tp=2)
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0
    # linear weights travel as e4m3 + scales: a bit over half of what bf16 would land
    assert 0.5 < summary["bytes_vs_unquantized"] < 0.6


def test_moe_train_tp2_pp2_ep2_to_gen_tp1_bit_exact(pool):
    summary = _run(pool, model="moe", train_world=4, train_tp=2, train_pp=2, train_ep=2,
                   gen_world=1, gen_tp=1)
    assert summary["verified"], summary["per_gen_rank"]


def test_moe_train_tp2_to_gen_tp2_ep2_whole_experts_bit_exact(pool):
    summary = _run(pool, model="moe", train_world=2, train_tp=2, train_pp=1, train_ep=1,
                   gen_world=2, gen_tp=2, gen_ep=2)
    assert summary["verified"], summary["per_gen_rank"]


def test_train_tp_cutting_a_kv_group_on_whole_blocks_sends_fp8_qkv_with_scales_in_blocks(pool):
    # 1 KV head over train TP2: each rank holds half of the group's 768 rows, q rows [384 |
    # 128] and k/v [0 | 128] (BlockShard), all whole 128-row blocks, so the sender quantizes
    # them and the scales travel with the same blocks counted in tiles ([3 | 1], [0 | 1]).
    # FFN 384: 192 rows per train rank cut a block, so gate/up/down travel in bf16 and gen
    # TP1 quantizes them; o_proj goes by the packed path (a full bf16 tensor, quantized on
    # write by the receiver)
    summary = _run(pool, model="dense", model_overrides={"ffn_hidden_size": 384, "num_query_groups": 1},
                   train_world=2, train_tp=2, train_pp=1, train_ep=1, gen_world=1, gen_tp=1,
                   packed_params=r"self_attn\.o_proj\.")
    assert summary["verified"], summary["per_gen_rank"]
    row = summary["per_gen_rank"][0]
    assert row["misc_bytes"] > 0 and summary["exact_path_fraction"] < 1.0
    assert summary["bytes_vs_unquantized"] > 0.6  # the FFN crossed in bf16


def test_train_tp_cutting_a_kv_group_off_block_boundaries_sends_bf16_qkv_for_the_receiver(pool):
    # 1 KV head over train TP4: 768 rows per group, 192 per train rank: q rows [192 | 192 |
    # 128 | 0] and k rows [0 | 0 | 64 | 64] cut 128-row blocks, so they travel in bf16 per
    # group and each gen rank (TP2: half the q rows, the KV head replicated) quantizes its HF
    # rows; v rows [0 | 0 | 0 | 128] are whole blocks: sender-quantized, scales [0 | 0 | 0 | 1];
    # FFN 512 / TP4 = 128 rows per rank is whole blocks, quantized by the sender
    summary = _run(pool, model="dense", model_overrides={"num_query_groups": 1}, train_world=4,
                   train_tp=4, train_pp=1, train_ep=1, gen_world=2, gen_tp=2)
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0


# Blockwise-FP8 training weights (testing.fp8_training: plain tensors in TE's data/scale
# layout, power-of-two scales): their bytes and scales move as they are. The oracle gets
# them back from the dequantized full HF tensors (one encoding per value), not from the refit.


def test_blockwise_fp8_training_dense_tp2_to_gen_tp2_moves_the_training_bytes(pool):
    summary = _run(pool, model="dense", train_world=2, train_tp=2, train_pp=1, train_ep=1,
                   gen_world=2, gen_tp=2, train_precision="fp8_blockwise")
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0


def test_blockwise_fp8_training_with_train_tp_cutting_a_kv_group_moves_the_training_bytes(pool):
    # 1 KV head over train TP2: each rank's FP8 linear_qkv shard is half a KV group (q rows
    # [384 | 128], k/v [0 | 128]); its TE tiles start at its first row, which is a tile
    # boundary of the group, so its bytes and per-tile scales are sliced per q/k/v and moved
    summary = _run(pool, model="dense", model_overrides={"num_query_groups": 1}, train_world=2,
                   train_tp=2, train_pp=1, train_ep=1, gen_world=1, gen_tp=1,
                   train_precision="fp8_blockwise")
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0


def test_blockwise_fp8_training_moe_tp2_pp2_ep2_to_gen_tp1_moves_the_training_bytes(pool):
    summary = _run(pool, model="moe", train_world=4, train_tp=2, train_pp=2, train_ep=2,
                   gen_world=1, gen_tp=1, train_precision="fp8_blockwise")
    assert summary["verified"], summary["per_gen_rank"]


# BF16 training -> MXFP8 generation (NeMo-RL's is_mx): BF16 travels, the receiver quantizes
# each region into e4m3 + E8M0 scales per 32 elements of a row.


def test_mxfp8_dense_tp2_to_gen_tp2_quantized_on_the_receiver_bit_exact(pool):
    summary = _run(pool, model="dense", train_world=2, train_tp=2, train_pp=1, train_ep=1,
                   gen_world=2, gen_tp=2, gen_precision="mxfp8")
    assert summary["verified"], summary["per_gen_rank"]


def test_mxfp8_moe_tp2_pp2_ep2_to_gen_tp2_ep2_bit_exact(pool):
    summary = _run(pool, model="moe", train_world=4, train_tp=2, train_pp=2, train_ep=2,
                   gen_world=2, gen_tp=2, gen_ep=2, gen_precision="mxfp8")
    assert summary["verified"], summary["per_gen_rank"]


def test_qkv_per_kv_group_with_k_rows_not_whole_blocks_is_quantized_on_the_receiver(pool):
    # head_dim 64: a KV group's q rows (2 heads) are one block and go as FP8 bytes; its k/v
    # rows (64) are not, so they travel in bf16 per group and gen TP1 quantizes HF rows
    summary = _run(pool, model="dense", model_overrides={"head_dim": 64}, train_world=2,
                   train_tp=2, train_pp=1, train_ep=1, gen_world=1, gen_tp=1)
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0


def test_deepseek_mla_fp8_train_tp2_ep2_to_gen_tp2_bit_exact(pool):
    # `demo --model deepseek --gen-precision fp8`'s model (2 layers: dense then MoE; MLA dims
    # in whole blocks, vLLM's fused q_a/kv_a included) on fewer ranks
    summary = _run(pool, model="deepseek", train_world=2, train_tp=2, train_pp=1, train_ep=2,
                   gen_world=2, gen_tp=2)
    assert summary["verified"], summary["per_gen_rank"]
