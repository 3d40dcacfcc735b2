"""Megatron-Core → HF parameter names per model family, declared as data.

No Megatron import, no torch: names only. A table is a tuple of :class:`Rule`: a regex
matched against a Megatron name (relative to ``decoder.layers.<i>.`` for layer rules, to
the model root for top rules), a *kind* that says how the Megatron tensor maps onto the HF
tensors, and the HF name templates (``{layer}`` = global 0-based layer index, ``{expert}`` =
global expert index). A new family is a few lines in :data:`FAMILIES`; the one engine
that reads these tables, and what each kind means for tensors, is ``converters``.

Kinds (T = TP size; experts are never TP-sharded here because expert-TP > 1 is refused):

==============  ====================================================================
``replicated``  one target, the tensor as is (norms, router, row-parallel bias)
``column``      one target, TP-sharded on dim 0
``row``         one target, TP-sharded on dim 1 (``linear_proj``, ``linear_fc2``)
``vocab``       one target, TP-sharded on dim 0, Megatron vocab padding rows stripped
``qkv``         three targets q/k/v, TP dim 0, rows interleaved per KV group
``fc1``         targets (gate, up): each TP rank holds ``[gate_r ; up_r]``;
                not gated → only ``up`` (the second target)
``expert_fc1``  per-expert fc1 (regex group 1 = local expert index), gate/up halves
``expert_fc2``  per-expert fc2 → down
``grouped_fc1`` legacy grouped GEMM ``weight1 [H, E_l·2I]`` (memory ``[E_l, H, 2I]``)
``grouped_fc2`` legacy grouped GEMM ``weight2 [E_l·I, H]`` (memory ``[E_l, I, H]``)
``mla_down``    MLA ``linear_q_down_proj`` / ``linear_kv_down_proj``: ``column`` in the local
                spec (ColumnParallelLinear), ``replicated`` in the TE spec (TELinear
                ``duplicated``); ``NameConverter.mla_down_replicated`` picks
``skip``        not a weight (``_extra_state``)
==============  ====================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

LAYER = "model.layers.{layer}"
EXPERT = LAYER + ".mlp.experts.{expert}"


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.pattern))

    def match(self, name: str) -> Optional[re.Match]:
        return self._regex.fullmatch(name)  # type: ignore[attr-defined]


def _rules(*rows: tuple) -> tuple[Rule, ...]:
    return tuple(Rule(p, k, tuple(t)) for p, k, t in rows)


TOP_RULES = _rules(
    (r"embedding\.word_embeddings\.weight", "vocab", ["model.embed_tokens.weight"]),
    (r"decoder\.final_layernorm\.weight", "replicated", ["model.norm.weight"]),
    (r"output_layer\.weight", "vocab", ["lm_head.weight"]),
)

NORM_RULES = _rules(
    (r"input_layernorm\.weight", "replicated", [LAYER + ".input_layernorm.weight"]),
    (r"pre_mlp_layernorm\.weight", "replicated", [LAYER + ".post_attention_layernorm.weight"]),
    # Transformer-Engine spec: norms fused into the following linear.
    (r"self_attention\.linear_qkv\.layer_norm_weight", "replicated", [LAYER + ".input_layernorm.weight"]),
    (r"mlp\.linear_fc1\.layer_norm_weight", "replicated", [LAYER + ".post_attention_layernorm.weight"]),
)

ATTENTION_RULES = _rules(
    (r"self_attention\.linear_qkv\.weight", "qkv",
     [LAYER + ".self_attn.q_proj.weight", LAYER + ".self_attn.k_proj.weight", LAYER + ".self_attn.v_proj.weight"]),
    (r"self_attention\.linear_qkv\.bias", "qkv",
     [LAYER + ".self_attn.q_proj.bias", LAYER + ".self_attn.k_proj.bias", LAYER + ".self_attn.v_proj.bias"]),
    (r"self_attention\.linear_proj\.weight", "row", [LAYER + ".self_attn.o_proj.weight"]),
    (r"self_attention\.q_layernorm\.weight", "replicated", [LAYER + ".self_attn.q_norm.weight"]),
    (r"self_attention\.k_layernorm\.weight", "replicated", [LAYER + ".self_attn.k_norm.weight"]),
)

ATTN = LAYER + ".self_attn."

# Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2). Rows of the up projections are
# head-major on both sides ([nope | rope] resp. [nope | v] per head), so TP chunks are
# chunks of the HF rows. Norms: local spec q_layernorm / kv_layernorm, TE spec fused into
# the up projection (layer_norm_weight).
MLA_ATTENTION_RULES = _rules(
    (r"self_attention\.linear_q_proj\.weight", "column", [ATTN + "q_proj.weight"]),
    (r"self_attention\.linear_q_down_proj\.weight", "mla_down", [ATTN + "q_a_proj.weight"]),
    (r"self_attention\.linear_q_up_proj\.weight", "column", [ATTN + "q_b_proj.weight"]),
    (r"self_attention\.linear_kv_down_proj\.weight", "mla_down", [ATTN + "kv_a_proj_with_mqa.weight"]),
    (r"self_attention\.linear_kv_up_proj\.weight", "column", [ATTN + "kv_b_proj.weight"]),
    (r"self_attention\.q_layernorm\.weight", "replicated", [ATTN + "q_a_layernorm.weight"]),
    (r"self_attention\.kv_layernorm\.weight", "replicated", [ATTN + "kv_a_layernorm.weight"]),
    (r"self_attention\.linear_q_up_proj\.layer_norm_weight", "replicated", [ATTN + "q_a_layernorm.weight"]),
    (r"self_attention\.linear_kv_up_proj\.layer_norm_weight", "replicated", [ATTN + "kv_a_layernorm.weight"]),
)

DENSE_MLP_RULES = _rules(
    (r"mlp\.linear_fc1\.weight", "fc1", [LAYER + ".mlp.gate_proj.weight", LAYER + ".mlp.up_proj.weight"]),
    (r"mlp\.linear_fc2\.weight", "row", [LAYER + ".mlp.down_proj.weight"]),
)

MOE_RULES = _rules(
    (r"mlp\.router\.weight", "replicated", [LAYER + ".mlp.gate.weight"]),
    # SequentialMLP (local spec) and TEGroupedMLP (weight<i> per local expert).
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight", "expert_fc1",
     [EXPERT + ".gate_proj.weight", EXPERT + ".up_proj.weight"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", "expert_fc2", [EXPERT + ".down_proj.weight"]),
    (r"mlp\.experts\.linear_fc1\.weight(\d+)", "expert_fc1",
     [EXPERT + ".gate_proj.weight", EXPERT + ".up_proj.weight"]),
    (r"mlp\.experts\.linear_fc2\.weight(\d+)", "expert_fc2", [EXPERT + ".down_proj.weight"]),
    # Legacy grouped GEMM: all local experts in one parameter.
    (r"mlp\.experts\.weight1", "grouped_fc1", [EXPERT + ".gate_proj.weight", EXPERT + ".up_proj.weight"]),
    (r"mlp\.experts\.weight2", "grouped_fc2", [EXPERT + ".down_proj.weight"]),
)


def _shared_expert_rules(prefix: str) -> tuple[Rule, ...]:
    return _rules(
        (r"mlp\.shared_experts\.linear_fc1\.weight", "fc1",
         [f"{LAYER}.mlp.{prefix}.gate_proj.weight", f"{LAYER}.mlp.{prefix}.up_proj.weight"]),
        (r"mlp\.shared_experts\.linear_fc2\.weight", "row", [f"{LAYER}.mlp.{prefix}.down_proj.weight"]),
    )


SKIP_RULES = _rules((r".*_extra_state", "skip", []))

#: DeepSeek-V3-style MoE extras (also GLM-4.5's): ``shared_experts`` and the router's
#: score-correction bias (Megatron's ``expert_bias`` buffer)
_ROUTER_BIASED_SHARED = _shared_expert_rules("shared_experts") + _rules(
    (r"mlp\.router\.expert_bias", "replicated", [LAYER + ".mlp.gate.e_score_correction_bias"]),
)

_DENSE = SKIP_RULES + NORM_RULES + ATTENTION_RULES + DENSE_MLP_RULES

#: family -> (top rules, layer rules). MoE families keep the dense MLP rules for dense layers
#: (DeepSeek-V3's first dense layers, ``moe_layer_freq`` patterns).
FAMILIES: dict[str, tuple[tuple[Rule, ...], tuple[Rule, ...]]] = {
    "llama": (TOP_RULES, _DENSE),
    "qwen2": (TOP_RULES, _DENSE),
    "qwen3": (TOP_RULES, _DENSE),
    "qwen3_moe": (TOP_RULES, _DENSE + MOE_RULES),
    "qwen2_moe": (TOP_RULES, _DENSE + MOE_RULES + _shared_expert_rules("shared_expert") + _rules(
        (r"mlp\.shared_experts\.gate_weight", "replicated", [LAYER + ".mlp.shared_expert_gate.weight"]),
    )),
    # MLA rules first: they claim q_layernorm (q_a_layernorm here, q_norm in GQA families);
    # the GQA rules stay for DeepSeek-style MoE models built with plain attention.
    "deepseek_v3": (TOP_RULES, SKIP_RULES + MLA_ATTENTION_RULES + _DENSE + MOE_RULES + _ROUTER_BIASED_SHARED),
    # GLM-4.5/4.6/4.7 (Glm4MoeForCausalLM): GQA with q/k/v biases (optional q/k norms),
    # DeepSeek-V3's MoE names (shared_experts, score-correction bias), first-k dense layers.
    # Partial rotary changes no weight.
    "glm4_moe": (TOP_RULES, _DENSE + MOE_RULES + _ROUTER_BIASED_SHARED),
}

