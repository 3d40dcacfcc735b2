"""vLLM's per-rank layout of gpt-oss (``GptOssForCausalLM``): the names it renames and its
experts.

Facts (vLLM ``model_executor/models/gpt_oss.py``, BF16 weights; MXFP4 is a different
storage, see the README):

- Names: HF ``model.embed_tokens`` is vLLM's ``model.embedding``, ``.self_attn.`` is
  ``.attn.``; ``attn.sinks [nh/T]`` holds the rank's heads; ``qkv_proj`` / ``o_proj`` /
  norms / ``mlp.router.{weight,bias}`` as in the dense layout (biases follow their rows;
  ``o_proj.bias`` and the router are whole on every rank).
- Experts (FusedMoE, ``routed_experts`` nested in vLLM 0.33): ``w13_weight [E_l, 2*I_p, H]``
  holds the rows of the checkpoint's ``gate_up_proj [H, 2I]`` transposed, gate and up still
  interleaved (vLLM's ``swigluoai`` activation reads them so); without EP rank r takes the
  columns ``[2*r*I_p, 2*(r+1)*I_p)``, with EP whole experts. ``w13_bias [E_l, 2*I_p]`` the
  same columns of ``gate_up_proj_bias``. ``w2_weight [E_l, H, I_p]`` is ``down_proj [I, H]``
  rows ``[r*I_p, (r+1)*I_p)`` transposed. ``w2_bias [E_l, H]`` is ``down_proj_bias`` on MoE
  TP rank 0 and zero on the others (the TP all-reduce would add it T times).
- Expert blocks with EP: vLLM's contiguous blocks (``moe.expert_block``).
"""

from __future__ import annotations

import re
from typing import Collection

# HF name fragment -> vLLM's, for the models that rename (GptOssModel)
RENAMES = (("model.embed_tokens.", "model.embedding."), (".self_attn.", ".attn."))

EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$")

# HF name -> TP dim on both sides (None: whole on every rank), for the direct params of
# gpt-oss beyond the dense ones (read by ``dense.tp_dim_of``)
TP_DIM_RULES = (
    (re.compile(r"\.self_attn\.sinks$"), 0),
    (re.compile(r"\.self_attn\.o_proj\.bias$"), None),
    (re.compile(r"\.mlp\.router\.(?:weight|bias)$"), None),
)


def renames_names(param_names: Collection[str]) -> bool:
    """Whether a model's params use gpt-oss's vLLM names: attention under ``.attn.`` with a
    fused ``qkv_proj`` and nothing under ``.self_attn.``."""
    return (any(".attn.qkv_proj." in n for n in param_names)
            and not any(".self_attn." in n for n in param_names))


def vllm_name(hf_name: str) -> str:
    for old, new in RENAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name


def expert_targets(prefix: str, proj: str, bias: bool) -> list[str]:
    """vLLM param names (flat, then nested) holding ``<prefix>.<e>.<proj>[_bias]``."""
    leaf = ("w13" if proj == "gate_up_proj" else "w2") + ("_bias" if bias else "_weight")
    return [f"{prefix}.{leaf}", f"{prefix}.routed_experts.{leaf}"]


def inter_columns(proj: str, inter_per_rank: int, tp_index: int) -> tuple[int, int]:
    """The checkpoint's intermediate range ``[lo, hi)`` one rank holds: interleaved gate/up
    columns (``gate_up_proj``: twice the rows) or ``down_proj`` rows."""
    width = 2 * inter_per_rank if proj == "gate_up_proj" else inter_per_rank
    return tp_index * width, (tp_index + 1) * width


def down_bias_is_zero(tp_index: int) -> bool:
    """``w2_bias`` of MoE TP rank ``tp_index`` is zero (not the checkpoint's bias) when > 0."""
    return tp_index > 0
