"""A demo preset's model built under Megatron's parallel state, with its refit source: the
one set-up the multi-process tests and the CPU benchmarks share (tools only: it reads the
demo presets)."""

from __future__ import annotations

from typing import Optional

import torch


def tiny_source(preset_name: str, gen_tp: int, *, pp: int = 1, seed: Optional[int] = None,
                timeout_minutes: int = 1, packed_params: Optional[str] = None, **overrides):
    """Under a training world of ``pp`` ranks (TP1, PP ``pp``): the demo preset's model (bf16,
    ``overrides`` applied to the preset, weights seeded by ``seed`` when given) and its
    ``MegatronRefitSource`` for gen TP ``gen_tp`` (``packed_params``: the source's option);
    returns (model, source, family, vocab_size)."""
    from megatron.core import parallel_state as ps

    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.tools.e2e import keep_expert_bias_fp32_
    from megatron_reshard.tools.run_config import MODEL_PRESETS

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                                 distributed_timeout_minutes=timeout_minutes)
    preset = dict(MODEL_PRESETS[preset_name], **overrides)
    family = preset.pop("family")
    spec = TinyGPTSpec(dtype="bfloat16", **preset)
    if seed is not None:
        torch.manual_seed(seed)
    model = build_gpt_model(spec).to(dtype=torch.bfloat16)
    keep_expert_bias_fp32_(model)  # a no-op without a router bias
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": gen_tp, "ep_size": 1, "pp_size": 1},
                                 gen_world_size=gen_tp, family=family, vocab_size=spec.vocab_size,
                                 packed_params=packed_params)
    return model, source, family, spec.vocab_size


__all__ = ["tiny_source"]
