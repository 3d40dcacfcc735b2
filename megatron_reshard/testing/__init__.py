"""Test and demo helpers (torch only): vLLM-like per-rank models and their expected contents."""

from megatron_reshard.testing.vllm_like import (
    build_vllm_like_model,
    expected_vllm_shard,
    hf_param_shapes,
    random_hf_state_dict,
    vllm_param_shapes,
)

__all__ = ["build_vllm_like_model", "expected_vllm_shard", "hf_param_shapes",
           "random_hf_state_dict", "vllm_param_shapes"]
