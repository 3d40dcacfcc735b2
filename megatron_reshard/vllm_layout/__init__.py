"""How vLLM lays out each model weight on one generation rank: the one home of these facts.

Torch + stdlib only (the receiver imports it). Every part of the project that needs to
know what a vLLM rank holds reads it from here: the receiver (``receiver.targets``), the
training side when it describes the destination of each parameter
(``megatron.source``), the ``plan`` tool and the benches. The test oracle
(``testing.vllm_like``) restates the same facts independently on purpose.

- ``dense``: column / row parallel linears, ``qkv_proj`` (KV heads replicated when TP
  exceeds them), ``gate_up_proj``, biases, vocab padding, replicated params.
- ``moe``: FusedMoE ``w13_weight`` / ``w2_weight``, TP-sharded without EP, whole experts
  in vLLM's contiguous (possibly uneven) blocks with EP.
- ``mla`` (kept free for the MLA attention layout).
- ``gpt_oss``: GptOss's renames (``embedding``, ``attn``), sinks, and its experts (w13 rows
  = the checkpoint's interleaved gate/up columns, transposed; w2_bias on MoE TP rank 0).
- ``gated_delta_net``: Qwen3-Next's conv1d segments per TP rank, its gated q rows, and the
  whole key-head groups each rank must hold.
- ``mamba``: Nemotron-H's names (``backbone.`` checkpoint names), its Mamba-2 mixers' fused
  ``in_proj`` / ``conv1d`` per TP rank (one group replicated) and ``A = -exp(A_log)``.
- ``float32_params``: the params vLLM holds in float32 whatever the model dtype (GLM-4.5's
  router), which the receiver widens on write.
"""

from megatron_reshard.vllm_layout.dense import (
    GATE_UP_RE,
    QKV_RE,
    VOCAB_PADDING,
    AttentionHeads,
    gate_up_rows,
    is_qkv_per_group,
    padded_vocab_rows,
    qkv_gen_layout,
    tp_dim_of,
    vocab_rows_of_rank,
)
from megatron_reshard.vllm_layout.moe import (
    expert_block,
    expert_block_sizes,
    expert_gen_placement,
    expert_target_candidates,
    expert_tp_split,
)

__all__ = [
    "AttentionHeads", "GATE_UP_RE", "QKV_RE", "VOCAB_PADDING", "expert_block",
    "expert_block_sizes", "expert_gen_placement", "expert_target_candidates", "expert_tp_split",
    "gate_up_rows", "is_qkv_per_group", "padded_vocab_rows", "qkv_gen_layout", "tp_dim_of",
    "vocab_rows_of_rank",
]
