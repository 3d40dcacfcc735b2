"""GLM-4.5 (``glm4_moe``) end to end through the demo's path: real megatron-core model (CPU,
gloo, spawned ranks), the real sender and receiver, the stand-in vLLM storage checked against
the independent expected shards after every refit. The router travels in BF16 and lands in
the float32 ``gate.weight`` vLLM's ``Glm4MoE`` holds; every byte takes the exact path.
(vLLM's own class: tests/real_vllm; transformers' logits: tests/test_hf_oracle.py.)"""

from __future__ import annotations

import pytest

from megatron_reshard.tools.e2e import run_rank, summarize
from megatron_reshard.tools.run_config import RefitRunConfig


def _refit_job(job, cfg):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    return run_rank(job.rank, cfg)


LAYOUTS = {  # at most 6 processes (the shared pool)
    "train-tp2-pp2-ep2-to-gen-tp2": dict(train_world=4, train_tp=2, train_pp=2, train_ep=2,
                                         gen_world=2, gen_tp=2),
    "train-tp1-ep2-to-gen-tp4-ep4": dict(train_world=2, train_tp=1, train_pp=1, train_ep=2,
                                         gen_world=4, gen_tp=4, gen_ep=4),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_glm_refit_is_bit_exact_and_all_on_the_exact_path(pool, layout):
    cfg = RefitRunConfig(model="glm", refits=2, quiet=True, timeout_s=60, **LAYOUTS[layout])
    summary = summarize(cfg, pool.run(_refit_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=240))
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0, summary["per_gen_rank"]


def test_glm_refit_into_block_fp8_generation_is_bit_exact(pool):
    """Block-FP8 generation (``--gen-precision fp8``): the q/k/v biases travel per KV group
    next to the quantized weights, the router widened to float32, all on the exact path."""
    cfg = RefitRunConfig(model="glm", refits=1, quiet=True, timeout_s=60, gen_precision="fp8",
                         **LAYOUTS["train-tp2-pp2-ep2-to-gen-tp2"])
    summary = summarize(cfg, pool.run(_refit_job, cfg.train_world + cfg.gen_world, cfg, timeout_s=240))
    assert summary["verified"], summary["per_gen_rank"]
    assert summary["exact_path_fraction"] == 1.0, summary["per_gen_rank"]
