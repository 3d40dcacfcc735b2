"""Params vLLM holds in float32 whatever the model dtype. Torch-free.

Facts (vLLM 0.33): ``Glm4MoE`` (``models/glm4_moe.py``) builds its router ``gate`` with
``params_dtype=torch.float32`` and its ``e_score_correction_bias`` in float32; DeepSeek-V3
(``models/deepseek_v2.py``) the score-correction bias. vLLM's ``load_weights`` widens the
checkpoint's BF16 values into them with ``copy_``, which is exact.

Megatron-Core keeps the score-correction bias (``expert_bias``) in float32 too, but the
router weight in the model dtype, so GLM-4.5's router travels in BF16 and the receiver widens
it on write. Only these names are widened: anywhere else a wire dtype other than the
target's is a configuration mistake (e.g. a float32 generation model) and refused.
"""

from __future__ import annotations

import re

# Qwen3-Next: the Gated-DeltaNet layer's A_log (``qwen_gdn_linear_attn.py``) likewise;
# Nemotron-H: the Mamba-2 mixer's A, which holds -exp(A_log) (``vllm_layout.mamba``)
FLOAT32_PARAM_RE = re.compile(r"\.mlp\.gate\.(?:weight|e_score_correction_bias)$|\.linear_attn\.A_log$"
                              r"|\.mixer\.A_log$")

# wire dtype names -> target dtype names it is widened into exactly (every value representable)
WIDENING = {"torch.bfloat16": ("torch.float32",), "torch.float16": ("torch.float32",)}


def may_widen(hf_name: str, wire_dtype: str, target_dtype: str) -> bool:
    """Whether ``hf_name`` sent as ``wire_dtype`` is written into a ``target_dtype`` param by
    widening: only for params vLLM holds in float32 whatever the model dtype."""
    return (FLOAT32_PARAM_RE.search(hf_name) is not None
            and target_dtype in WIDENING.get(wire_dtype, ()))
