"""BF16 training -> block-FP8 generation, end to end on CPU: real megatron-core training
ranks, vLLM-layout FP8 storage on the generation ranks.

Every generation parameter (FP8 bytes, fp32 scales, the BF16 rest) is compared bit for
bit after every refit against the independent quantizer (``testing.fp8_reference``)
applied to the full HF tensors and sliced by the vLLM layout.
"""

from megatron_reshard.e2e import RefitRunConfig, run_rank, summarize


def _refit_job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


def _run(pool, **overrides):
    cfg = RefitRunConfig(refits=2, quiet=True, timeout_s=60, gen_precision="fp8", **overrides)
    results = pool.run(_refit_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=300)
    return summarize(cfg, results)


def test_dense_train_tp2_to_gen_tp2_sender_quantized_bit_exact(pool):
    summary = _run(pool, model="dense", train_world=2, train_tp=2, train_pp=1, train_ep=1,
                   gen_world=2, gen_tp=2)
    assert summary["verified"], summary["per_gen_rank"]
