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
``oss_*``       gpt-oss experts, one whole expert each: interleaved gate/up, transposed
                weights (``megatron.gpt_oss``); full tensors only
``gdn_*``       Qwen3-Next's Gated-DeltaNet ``in_proj`` (-> ``in_proj_qkvz``, ``in_proj_ba``;
                Qwen3.5: ``gdn_in_proj_flat`` -> ``in_proj_qkv``, ``_z``, ``_b``, ``_a``),
                ``conv1d`` and gated norm (+1 under zero-centred norms); ``gated_qkv``: ``linear_qkv`` with the attention output
                gate (``megatron.qwen3_next``); full tensors only
``mamba_*``     Nemotron-H's fused Mamba-2 ``in_proj`` ``[z, x, B, C, dt]`` / ``conv1d``
                ``[x, B, C]`` per TP rank (``megatron.mamba``)
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



# ---- gpt-oss (vLLM GptOssForCausalLM; megatron-core GPTModel with softmax_type="learnable",
# add_bias_linear=True). HF names as the checkpoint has them, experts one by one in the form
# vLLM's loader streams (``mlp.experts.<e>.gate_up_proj [H, 2I]`` with gate/up interleaved,
# ``down_proj [I, H]``, their ``_bias``): the tensor rules of the ``oss_*`` kinds are in
# ``megatron.gpt_oss``.
OSS_EXPERT = LAYER + ".mlp.experts.{expert}"
GPT_OSS_RULES = SKIP_RULES + NORM_RULES + ATTENTION_RULES + _rules(
    (r"self_attention\.linear_proj\.bias", "replicated", [ATTN + "o_proj.bias"]),
    # the learnable softmax offset per local head: HF's (and vLLM's) sinks, TP-split by head
    (r"self_attention\.core_attention\.softmax_offset", "column", [ATTN + "sinks"]),
    (r"mlp\.router\.weight", "replicated", [LAYER + ".mlp.router.weight"]),
    (r"mlp\.router\.bias", "replicated", [LAYER + ".mlp.router.bias"]),
    # SequentialMLP (local spec) and TEGroupedMLP (weight<i> / bias<i> per local expert)
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight", "oss_fc1", [OSS_EXPERT + ".gate_up_proj"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.bias", "oss_fc1_bias", [OSS_EXPERT + ".gate_up_proj_bias"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", "oss_fc2", [OSS_EXPERT + ".down_proj"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.bias", "oss_fc2_bias", [OSS_EXPERT + ".down_proj_bias"]),
    (r"mlp\.experts\.linear_fc1\.weight(\d+)", "oss_fc1", [OSS_EXPERT + ".gate_up_proj"]),
    (r"mlp\.experts\.linear_fc1\.bias(\d+)", "oss_fc1_bias", [OSS_EXPERT + ".gate_up_proj_bias"]),
    (r"mlp\.experts\.linear_fc2\.weight(\d+)", "oss_fc2", [OSS_EXPERT + ".down_proj"]),
    (r"mlp\.experts\.linear_fc2\.bias(\d+)", "oss_fc2_bias", [OSS_EXPERT + ".down_proj_bias"]),
)
FAMILIES["gpt_oss"] = (TOP_RULES, GPT_OSS_RULES)
# ---- end gpt-oss


# ---- Nemotron-H (megatron-core MambaModel, hybrid layer pattern; HF/vLLM NemotronHForCausalLM).
# Checked on real megatron-core models (the local spec's names; the TE spec's fused-norm names
# at name level) against vLLM's own ``load_weights`` (tests/real_vllm/test_nemotron_h.py). The Mamba-2 mixer's tensor rules are in
# ``megatron.mamba``; MoE layers are refused (``megatron.nemotron_h``).
# Every layer is ``backbone.layers.<i>`` with one ``norm`` and one ``mixer`` (Mamba-2,
# attention, MLP or MoE, as the pattern says).
NH_LAYER = "backbone.layers.{layer}"
NH_MIXER = NH_LAYER + ".mixer."
NEMOTRON_H_TOP_RULES = _rules(
    (r"embedding\.word_embeddings\.weight", "vocab", ["backbone.embeddings.weight"]),
    (r"decoder\.final_norm\.weight", "replicated", ["backbone.norm_f.weight"]),
    (r"output_layer\.weight", "vocab", ["lm_head.weight"]),
)
NEMOTRON_H_RULES = SKIP_RULES + _rules(
    # the layer's pre-norm: MambaLayer.norm (local), fused into the first linear (TE spec)
    (r"norm\.weight", "replicated", [NH_LAYER + ".norm.weight"]),
    (r"mixer\.in_proj\.layer_norm_weight", "replicated", [NH_LAYER + ".norm.weight"]),
    (r"input_layernorm\.weight", "replicated", [NH_LAYER + ".norm.weight"]),
    (r"self_attention\.linear_qkv\.layer_norm_weight", "replicated", [NH_LAYER + ".norm.weight"]),
    (r"pre_mlp_layernorm\.weight", "replicated", [NH_LAYER + ".norm.weight"]),
    (r"mlp\.linear_fc1\.layer_norm_weight", "replicated", [NH_LAYER + ".norm.weight"]),
    # Mamba-2 mixer: in_proj rows [z, x, B, C, dt] and conv1d channels [x, B, C] are split
    # per TP rank segment by segment (megatron.mamba); A_log, D, dt_bias per head and the
    # gated norm per channel (each rank's groups) split on dim 0
    (r"mixer\.in_proj\.weight", "mamba_in_proj", [NH_MIXER + "in_proj.weight"]),
    (r"mixer\.conv1d\.weight", "mamba_conv1d", [NH_MIXER + "conv1d.weight"]),
    (r"mixer\.conv1d\.bias", "mamba_conv1d", [NH_MIXER + "conv1d.bias"]),
    (r"mixer\.A_log", "column", [NH_MIXER + "A_log"]),
    (r"mixer\.D", "column", [NH_MIXER + "D"]),
    (r"mixer\.dt_bias", "column", [NH_MIXER + "dt_bias"]),
    (r"mixer\.norm\.weight", "column", [NH_MIXER + "norm.weight"]),
    (r"mixer\.out_proj\.weight", "row", [NH_MIXER + "out_proj.weight"]),
    # attention layers
    (r"self_attention\.linear_qkv\.weight", "qkv",
     [NH_MIXER + "q_proj.weight", NH_MIXER + "k_proj.weight", NH_MIXER + "v_proj.weight"]),
    (r"self_attention\.linear_proj\.weight", "row", [NH_MIXER + "o_proj.weight"]),
    # MLP layers (squared ReLU, not gated: fc1 is up_proj alone, column parallel)
    (r"mlp\.linear_fc1\.weight", "column", [NH_MIXER + "up_proj.weight"]),
    (r"mlp\.linear_fc2\.weight", "row", [NH_MIXER + "down_proj.weight"]),
    # MoE layers (Nemotron-3 Nano): sigmoid router with score-correction bias, shared expert
    (r"mlp\.router\.weight", "replicated", [NH_MIXER + "gate.weight"]),
    (r"mlp\.router\.expert_bias", "replicated", [NH_MIXER + "gate.e_score_correction_bias"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight", "expert_fc1",
     [NH_MIXER + "experts.{expert}.gate_proj.weight", NH_MIXER + "experts.{expert}.up_proj.weight"]),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", "expert_fc2",
     [NH_MIXER + "experts.{expert}.down_proj.weight"]),
    (r"mlp\.experts\.linear_fc1\.weight(\d+)", "expert_fc1",
     [NH_MIXER + "experts.{expert}.gate_proj.weight", NH_MIXER + "experts.{expert}.up_proj.weight"]),
    (r"mlp\.experts\.linear_fc2\.weight(\d+)", "expert_fc2", [NH_MIXER + "experts.{expert}.down_proj.weight"]),
    (r"mlp\.shared_experts\.linear_fc1\.weight", "fc1",
     [NH_MIXER + "shared_experts.gate_proj.weight", NH_MIXER + "shared_experts.up_proj.weight"]),
    (r"mlp\.shared_experts\.linear_fc2\.weight", "row", [NH_MIXER + "shared_experts.down_proj.weight"]),
)
FAMILIES["nemotron_h"] = (NEMOTRON_H_TOP_RULES, NEMOTRON_H_RULES)
# ---- end Nemotron-H


# ---- Qwen3-Next / Qwen3.5 text (megatron-core GPTModel with its own ``GatedDeltaNet`` layers,
# ``experimental_attention_variant="gated_delta_net"``, and ``attention_output_gate`` on the
# full-attention layers; HF/vLLM Qwen3NextForCausalLM). The tensor rules of the ``gdn_*`` /
# ``gated_qkv`` kinds are in ``megatron.qwen3_next``; A_log / dt_bias are per value head
# (TP dim 0), the gated norm is per channel of one head (replicated). MoE: Qwen2-MoE's names
# (``shared_expert``, ``shared_expert_gate``). The rules are checked on real megatron-core
# models against vLLM's own ``load_weights`` (tests/real_vllm).
LINEAR = LAYER + ".linear_attn."
_GATED_DELTA_NET_RULES = _rules(
    (r"self_attention\.in_proj\.weight", "gdn_in_proj",
     [LINEAR + "in_proj_qkvz.weight", LINEAR + "in_proj_ba.weight"]),
    # Transformer-Engine spec: the input norm fused into in_proj
    (r"self_attention\.in_proj\.layer_norm_weight", "replicated", [LAYER + ".input_layernorm.weight"]),
    (r"self_attention\.conv1d\.weight", "gdn_conv1d", [LINEAR + "conv1d.weight"]),
    (r"self_attention\.A_log", "column", [LINEAR + "A_log"]),
    (r"self_attention\.dt_bias", "column", [LINEAR + "dt_bias"]),
    # the gated norm: plus one where Megatron's norms are zero-centred (megatron.qwen3_next)
    (r"self_attention\.out_norm\.weight", "gdn_norm", [LINEAR + "norm.weight"]),
    (r"self_attention\.out_proj\.weight", "row", [LINEAR + "out_proj.weight"]),
    # full attention with the output gate: q_proj rows [q_h ; gate_h] per head
    (r"self_attention\.linear_qkv\.weight", "gated_qkv",
     [ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"]),
)
_QWEN_SHARED_EXPERT = _shared_expert_rules("shared_expert") + _rules(
    (r"mlp\.shared_experts\.gate_weight", "replicated", [LAYER + ".mlp.shared_expert_gate.weight"]),
)
FAMILIES["qwen3_next"] = (TOP_RULES, SKIP_RULES + _GATED_DELTA_NET_RULES + NORM_RULES + ATTENTION_RULES
                          + DENSE_MLP_RULES + MOE_RULES + _QWEN_SHARED_EXPERT)
# Qwen3.5 text (HF model_type ``qwen3_5_text`` dense, ``qwen3_5_moe_text`` MoE; vLLM
# Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM): Qwen3-Next's layers, the in_proj streams
# named apart and flat (``gdn_in_proj_flat``, ``megatron.qwen3_next``)
_QWEN3_5_IN_PROJ = _rules(
    (r"self_attention\.in_proj\.weight", "gdn_in_proj_flat",
     [LINEAR + "in_proj_qkv.weight", LINEAR + "in_proj_z.weight", LINEAR + "in_proj_b.weight",
      LINEAR + "in_proj_a.weight"]),
)
_QWEN3_5_RULES = (SKIP_RULES + _QWEN3_5_IN_PROJ
                  + tuple(r for r in _GATED_DELTA_NET_RULES if r.kind != "gdn_in_proj")
                  + NORM_RULES + ATTENTION_RULES + DENSE_MLP_RULES)
FAMILIES["qwen3_5_text"] = (TOP_RULES, _QWEN3_5_RULES)
FAMILIES["qwen3_5_moe_text"] = (TOP_RULES, _QWEN3_5_RULES + MOE_RULES + _QWEN_SHARED_EXPERT)
# ---- end Qwen3-Next
