"""vLLM's per-rank layout of the dense (non-expert) weights.

Facts (vLLM ``model_executor/layers/linear.py`` and ``vocab_parallel_embedding.py``):

- Column parallel ``[out/T, in]`` (rows split), row parallel ``[out, in/T]`` (columns
  split); a row-parallel bias is whole on every rank, a column-parallel one split like
  the rows.
- ``qkv_proj`` (QKVParallelLinear) holds ``[q_r | k_r | v_r]``: nh/T q heads; with T >= nkv
  one KV head, rank r holding head ``r // (T/nkv)`` (each KV head replicated over T/nkv
  ranks), else nkv/T KV heads. Its bias follows the rows.
- ``gate_up_proj`` (MergedColumnParallelLinear) holds ``[gate_r ; up_r]``.
- Embedding and LM head: the vocab padded to a multiple of 64, split evenly over TP,
  padding rows zero.
- Norms, q/k norms, the MoE router, its score-correction bias and the shared-expert gate
  are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.errors import BadInputError, MissingEntryError
from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.vllm_layout import gpt_oss, mamba

VOCAB_PADDING = 64

QKV_RE = re.compile(r"^(?P<prefix>.*)\.(?P<which>q|k|v)_proj\.(?P<kind>weight|bias)$")
# q/k/v of self-attention, which the refit sends per KV group (``is_qkv_per_group``)
QKV_PARAM_RE = re.compile(r"\.self_attn\.[qkv]_proj\.(?:weight|bias)$"
                          r"|^backbone\.layers\.\d+\.mixer\.[qkv]_proj\.(?:weight|bias)$")  # Nemotron-H
GATE_UP_RE = re.compile(r"^(?P<prefix>.*)\.(?P<which>gate|up)_proj\.(?P<kind>weight|bias)$")

# HF name -> the dim vLLM splits over its TP ranks (None: whole on every rank), for the
# params whose vLLM target has the HF name itself. Megatron-Core holds each of them the
# same way over its TP ranks, so they travel shard to shard with one placement rule.
TP_DIM_RULES: tuple[tuple[re.Pattern, Optional[int]], ...] = (
    (re.compile(r"\.self_attn\.o_proj\.weight$"), 1),
    (re.compile(r"layernorm\.weight$"), None),
    (re.compile(r"\.self_attn\.[qk]_norm\.weight$"), None),
    (re.compile(r"^model\.norm\.weight$"), None),
    (re.compile(r"\.mlp\.gate\.weight$"), None),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), None),
    (re.compile(r"\.mlp\.shared_expert_gate\.weight$"), None),
    # shared experts (Qwen2-MoE ``shared_expert``, DeepSeek ``shared_experts``): a dense MLP
    # over TP; gate/up land in its gate_up_proj
    (re.compile(r"\.mlp\.shared_experts?\.(?:gate|up)_proj\.weight$"), 0),
    (re.compile(r"\.mlp\.shared_experts?\.down_proj\.weight$"), 1),
    # Gated-DeltaNet (vllm_layout.gated_delta_net): per value head A_log / dt_bias, the
    # row-parallel out_proj; Qwen3.5's flat in_proj streams (q, k, v: the wire names of
    # in_proj_qkv's three segments) land in their output shards of in_proj_qkvz / in_proj_ba
    (re.compile(r"\.linear_attn\.(?:A_log|dt_bias)$"), 0),
    (re.compile(r"\.linear_attn\.out_proj\.weight$"), 1),
    (re.compile(r"\.linear_attn\.in_proj_(?:q|k|v|z|b|a)\.weight$"), 0),
    # the conv1d channels' segments sent apart (conv1d_q / _k / _v), each split over TP
    (re.compile(r"\.linear_attn\.conv1d_(?:q|k|v)\.weight$"), 0),
) + gpt_oss.TP_DIM_RULES + mamba.TP_DIM_RULES
NOT_LISTED = -1


def tp_dim_of(hf_name: str):
    """The TP dim of a param listed in ``TP_DIM_RULES`` (None: replicated); ``NOT_LISTED``
    for any other name."""
    for pattern, dim in TP_DIM_RULES:
        if pattern.search(hf_name):
            return dim
    return NOT_LISTED


def padded_vocab_rows(vocab: int) -> int:
    """Rows of vLLM's embedding and LM head: the vocab padded to a multiple of 64."""
    return -(-int(vocab) // VOCAB_PADDING) * VOCAB_PADDING


def vocab_rows_of_rank(vocab: int, tp_size: int, tp_rank: int) -> tuple[tuple[int, int], int]:
    """(real vocab rows ``[lo, hi)`` held by ``tp_rank``, rows of its local tensor); the
    local rows after ``hi - lo`` are padding (zero)."""
    chunk = padded_vocab_rows(vocab) // tp_size
    lo, hi = min(tp_rank * chunk, vocab), min((tp_rank + 1) * chunk, vocab)
    return (lo, hi), chunk


@dataclass(frozen=True)
class AttentionHeads:
    """Attention geometry: query heads, KV heads, head dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "AttentionHeads":
        """From the payload's ``wire.HFConfig`` (read by field); ``MissingEntryError`` (a
        ``KeyError``) naming a size it lacks."""
        def need(key: str) -> int:
            value = getattr(cfg, key)
            if value is None:
                raise MissingEntryError(key)
            return int(value)

        nh = need("num_attention_heads")
        nkv = int(cfg.num_key_value_heads or nh)
        hd = int(cfg.head_dim or need("hidden_size") // nh)
        return cls(nh, nkv, hd)

    def tp_problem(self, tp_size: int) -> Optional[str]:
        """Why vLLM cannot split this attention over ``tp_size`` ranks (None: it can)."""
        nh, nkv, t = self.num_heads, self.num_kv_heads, tp_size
        if nh % t:
            return f"{nh} query heads do not split over tp_size={t}"
        if t >= nkv and t % nkv:
            return f"tp_size={t} is not a multiple of {nkv} KV heads"
        if t < nkv and nkv % t:
            return f"{nkv} KV heads do not split over tp_size={t}"
        return None

    def kv_heads_of_rank(self, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """KV heads ``[start, stop)`` that ``tp_rank`` holds (one, replicated, when TP >= nkv)."""
        nkv = self.num_kv_heads
        if tp_size >= nkv:
            head = tp_rank // (tp_size // nkv)
            return head, head + 1
        return tp_rank * nkv // tp_size, (tp_rank + 1) * nkv // tp_size

    def hf_rows(self, which: str) -> int:
        """Rows of the HF ``q_proj`` / ``k_proj`` / ``v_proj`` tensor."""
        return (self.num_heads if which == "q" else self.num_kv_heads) * self.head_dim

    def qkv_proj_rows(self, tp_size: int) -> int:
        """Rows of ``qkv_proj`` on one rank: its q heads plus twice its KV heads."""
        kv = self.kv_heads_of_rank(tp_size, 0)
        return (self.num_heads // tp_size + 2 * (kv[1] - kv[0])) * self.head_dim

    def qkv_piece(self, which: str, tp_size: int, tp_rank: int
                  ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(rows of ``qkv_proj`` on ``tp_rank``, rows of the HF ``{which}_proj``) it receives."""
        hd = self.head_dim
        q_rows = self.num_heads // tp_size * hd
        k0, k1 = self.kv_heads_of_rank(tp_size, tp_rank)
        kv_rows = (k1 - k0) * hd
        if which == "q":
            return (0, q_rows), (tp_rank * q_rows, (tp_rank + 1) * q_rows)
        off = q_rows if which == "k" else q_rows + kv_rows
        return (off, off + kv_rows), (k0 * hd, k1 * hd)


def gate_up_rows(which: str, rows: int, tp_size: int, tp_rank: int
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows of ``gate_up_proj`` on ``tp_rank``, rows of the HF ``{which}_proj``) for an HF
    tensor of ``rows`` rows: the gate chunk first, then the up chunk."""
    part = rows // tp_size
    off = 0 if which == "gate" else part
    return (off, off + part), (tp_rank * part, (tp_rank + 1) * part)


def is_qkv_per_group(name: str, global_shape: Sequence[int]) -> bool:
    """Whether a refit entry is a q/k/v weight or bias in the per-KV-group form
    ``[nkv, rows per group, *rest]``: one dim more than the HF tensor; or a gated q_proj
    (attention output gate, rows ``[q_h; gate_h]`` per head) in the form ``[nkv, heads per
    group, 2, head_dim, *rest]``: three dims more."""
    m = QKV_PARAM_RE.search(name)
    tail = 1 if name.endswith(".weight") else 0
    return m is not None and (len(global_shape) == 2 + tail
                              or (".q_proj." in name and len(global_shape) == 4 + tail))


def per_group_as_hf_rows(shape: Sequence[int], region: Sequence) -> tuple[tuple, tuple]:
    """A q/k/v weight (bias) in the per-KV-group form ``[nkv, rows per group, *rest]`` (a
    row-major reshape of the HF tensor's rows) and a region of it, in HF rows:
    ``(hf_shape, hf_region)``. The one home of this conversion (receiver mapping, FP8
    planning and FP8 targets all use it). The region must be one contiguous block of HF
    rows, as the payload's per-group layouts give (``qkv_gen_layout``); ValueError else.
    The gated q form ``[nkv, heads, 2, head_dim, *rest]`` counts its dim 1 in heads of
    ``2 * head_dim`` rows (the region whole on dims 2 and 3)."""
    if len(shape) >= 4:  # the gated q form: heads of 2 * head_dim rows on dim 1
        unit = 2 * int(shape[3])
        if tuple(tuple(r) for r in region[2:4]) != ((0, 2), (0, int(shape[3]))):
            raise BadInputError(f"region {[list(r) for r in region]} of the gated per-group "
                                f"form {list(shape)} cuts a head")
        shape = (shape[0], int(shape[1]) * unit, *shape[4:])
        region = (region[0], (region[1][0] * unit, region[1][1] * unit), *region[4:])
    (g0, g1), (a, b), *rest = region
    per_group = int(shape[1])
    if g1 - g0 > 1 and (a, b) != (0, per_group):
        raise BadInputError(f"region {[list(r) for r in region]} of the per-group form "
                         f"{list(shape)} is not one block of HF rows")
    rows = (g0 * per_group + a, (g1 - 1) * per_group + b) if g1 > g0 else (0, 0)
    return ((int(shape[0]) * per_group, *(int(n) for n in shape[2:])),
            (rows, *(tuple(r) for r in rest)))


def qkv_gen_layout(mesh: MeshInfo, dims: Mapping[str, int], num_kv_heads: int, which: str
                   ) -> tuple[MeshInfo, list]:
    """Mesh and placements of vLLM's q/k/v rows in the per-KV-group form ``[nkv, rows, ...]``.

    TP <= nkv: each rank holds whole groups (Shard(0) over TP). TP > nkv: the TP axis is
    split into (group, part): the q rows of a group are split over the parts (Shard(1)),
    the k/v rows replicated over them (vLLM replicates a KV head over TP/nkv ranks).
    """
    tp_axis = dims.get("tp")
    if tp_axis is None:
        return mesh, [Replicate() for _ in range(mesh.ndim)]
    tp = mesh.shape[tp_axis]
    if tp <= num_kv_heads:
        placements: list = [Replicate() for _ in range(mesh.ndim)]
        placements[tp_axis] = Shard(0)
        return mesh, placements
    shape = list(mesh.shape)
    shape[tp_axis:tp_axis + 1] = [num_kv_heads, tp // num_kv_heads]
    split = MeshInfo(mesh.mesh.reshape(shape))
    placements = [Replicate() for _ in range(split.ndim)]
    placements[tp_axis] = Shard(0)
    if which == "q":
        placements[tp_axis + 1] = Shard(1)
    return split, placements
