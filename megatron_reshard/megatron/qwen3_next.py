"""Qwen3-Next's Gated-DeltaNet and gated-attention tensors: Megatron-Core's layout to the HF
checkpoint's, from the TP chunks of one parameter.

No Megatron import. Facts, megatron-core 0.16.1 (``ssm/gated_delta_net.py``,
``transformer/attention.py``) against the Qwen3-Next checkpoint (as vLLM 0.33's
``QwenGatedDeltaNetAttention.fix_query_key_value_ordering`` reads it):

- GDN ``in_proj`` (ColumnParallelLinear): TP rank r holds ``[q_r, k_r, v_r, z_r, b_r, a_r]``
  (its key heads' q and k, its value heads' v, z, b, a; ``GatedDeltaNet.forward`` splits
  it so). The checkpoint's ``in_proj_qkvz`` holds, per key head g, ``[q_g, k_g, v_g, z_g]``
  (v and z of the value heads of g), and ``in_proj_ba`` per key head ``[b_g, a_g]``.
- Qwen3.5's checkpoint names the same projections apart and flat (no per-key-head
  interleave): ``in_proj_qkv`` ``[q; k; v]``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
  over all heads (vLLM 0.33 ``models/qwen3_5.py``, ``gqa_interleaved_layout=False``):
  kind ``gdn_in_proj_flat``.
- GDN ``conv1d.weight [C/T, 1, K]``: channels ``[q_r, k_r, v_r]``; the checkpoint's are
  ``[q, k, v]`` over all heads.
- ``linear_qkv`` with ``attention_output_gate``: per KV group ``[q heads, gate heads, k, v]``
  (``Attention.get_query_key_value_tensors``); the checkpoint's ``q_proj`` holds per query
  head ``[q_h ; gate_h]``, ``k_proj`` / ``v_proj`` as usual.

- The gated norm (``out_norm``): built like every norm of the model, so with
  ``layernorm_zero_centered_gamma`` (how Qwen3-Next is trained: its other norms are
  zero-centred in the checkpoint too) Megatron computes ``x·(1+w)``, while the checkpoint's
  (and vLLM's ``RMSNormGated``) computes ``x·w``: the HF weight is Megatron's plus one.

Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` and the gated norm are no view of the
Megatron tensor (interleaves across the TP chunks, the +1): those travel as full tensors
(the packed path). The conv1d channels' segments are each split over TP on both sides:
sent apart (``conv1d_q`` / ``_k`` / ``_v``) they travel shard to shard. So do the gated
q/k/v per KV group where each train rank holds whole groups (``gated_qkv_views``). Qwen3.5's flat streams are: each of q, k,
v, z, b, a is a contiguous row block of every rank's ``in_proj`` (``stream_views``), split
over TP on its rows on both sides, so they take the exact path, in_proj_qkv as its three
segments apart (``stream_metadata``: wire names ``in_proj_q`` / ``_k`` / ``_v``; the
receiver's targets: ``vllm_layout.gated_delta_net``). A_log, dt_bias (per value head) and
out_proj (row parallel) are split alike on both sides too (``vllm_layout.dense``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError

KINDS = ("gdn_in_proj", "gdn_conv1d", "gated_qkv", "gdn_norm", "gdn_in_proj_flat")
TP_DIMS = {kind: 0 for kind in KINDS if kind != "gdn_norm"}  # gdn_norm: replicated


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated-DeltaNet geometry (HF ``linear_*`` keys; Megatron's config fields of the same name)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    out_norm_offset: float = 0.0  # 1.0 when Megatron's norms are zero-centred (see above)

    @classmethod
    def from_config(cls, config: Any) -> Optional["LinearAttentionDims"]:
        """From a ``TransformerConfig``; None without Gated-DeltaNet layers."""
        if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
            return None
        return cls(int(config.linear_num_key_heads), int(config.linear_num_value_heads),
                   int(config.linear_key_head_dim), int(config.linear_value_head_dim),
                   1.0 if getattr(config, "layernorm_zero_centered_gamma", False) else 0.0)

    @property
    def per_key_head(self) -> int:
        """Value heads per key head."""
        return self.num_value_heads // self.num_key_heads

    def segments(self, tp: int) -> list[int]:
        """Rows of one TP rank's ``in_proj``: q, k, v, z, b, a."""
        kd = self.num_key_heads * self.key_head_dim // tp
        vd = self.num_value_heads * self.value_head_dim // tp
        nv = self.num_value_heads // tp
        return [kd, kd, vd, vd, nv, nv]


def _split_chunks(chunks: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    """Each TP chunk split into ``sizes`` rows; the parts of one kind joined over TP."""
    parts = [c.split(list(sizes), dim=0) for c in chunks]
    return [torch.cat([p[i] for p in parts], 0) for i in range(len(sizes))]


def in_proj_full(chunks: Sequence[torch.Tensor], d: LinearAttentionDims) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``(in_proj_qkvz, in_proj_ba)`` from the TP chunks of Megatron's ``in_proj``."""
    q, k, v, z, b, a = _split_chunks(chunks, d.segments(len(chunks)))
    nk, r, rest = d.num_key_heads, d.per_key_head, q.shape[1:]
    by_key_head = lambda t: t.reshape(nk, -1, *rest)  # noqa: E731 (rows of one key head together)
    qkvz = torch.cat([by_key_head(t) for t in (q, k, v, z)], 1).reshape(-1, *rest)
    ba = torch.cat([b.reshape(nk, r, *rest), a.reshape(nk, r, *rest)], 1).reshape(-1, *rest)
    return qkvz, ba


def in_proj_flat_full(chunks: Sequence[torch.Tensor], d: LinearAttentionDims
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3.5's ``(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)`` from the TP chunks of
    Megatron's ``in_proj``: each stream joined over TP, q, k, v stacked."""
    q, k, v, z, b, a = _split_chunks(chunks, d.segments(len(chunks)))
    return torch.cat([q, k, v], 0), z, b, a


_FLAT_QKV = re.compile(r"^(?P<prefix>.*\.linear_attn\.in_proj_)qkv\.weight$")
_CONV1D = re.compile(r"^(?P<prefix>.*\.linear_attn\.conv1d)\.weight$")


def stream_metadata(metadata: Mapping[str, dict], d: LinearAttentionDims,
                    keep_packed: Callable[[str], bool]) -> dict[str, dict]:
    """``metadata`` with each Qwen3.5 ``in_proj_qkv`` entry, and each ``conv1d`` entry (both
    families), replaced by its q, k and v segments (``in_proj_q`` / ``_k`` / ``_v``,
    ``conv1d_q`` / ...; in its place), unless ``keep_packed`` matches it."""
    out: dict = {}
    kd, vd = d.num_key_heads * d.key_head_dim, d.num_value_heads * d.value_head_dim
    for name, meta in metadata.items():
        m = _FLAT_QKV.match(name)
        c = _CONV1D.match(name)
        if (m is None and c is None) or keep_packed(name):
            out[name] = meta
            continue
        rest = list(meta["shape"][1:])
        prefix = m["prefix"] if m else f"{c['prefix']}_"
        for which, rows in (("q", kd), ("k", kd), ("v", vd)):
            out[f"{prefix}{which}.weight"] = {**meta, "shape": [rows, *rest]}
    return out


def conv1d_stream_views(hf_name: str, tensor: torch.Tensor, d: LinearAttentionDims, tp: int
                        ) -> dict[str, torch.Tensor]:
    """This rank's q, k, v channels of Megatron's ``conv1d`` (views), under the exact path's
    names (``conv1d_q`` / ``_k`` / ``_v``)."""
    prefix = _CONV1D.match(hf_name)["prefix"]
    return dict(zip((f"{prefix}_{w}.weight" for w in "qkv"), tensor.split(d.segments(tp)[:3], dim=0)))


def stream_views(hf_names: Sequence[str], tensor: torch.Tensor, d: LinearAttentionDims, tp: int
                 ) -> dict[str, torch.Tensor]:
    """This rank's q, k, v, z, b, a rows of Megatron's ``in_proj`` (views), under the exact
    path's names (``hf_names``: the converter's in_proj_qkv, _z, _b, _a)."""
    qkv, z, b, a = hf_names
    prefix = _FLAT_QKV.match(qkv)["prefix"]
    names = [f"{prefix}q.weight", f"{prefix}k.weight", f"{prefix}v.weight", z, b, a]
    return dict(zip(names, tensor.split(d.segments(tp), dim=0)))


def conv1d_full(chunks: Sequence[torch.Tensor], d: LinearAttentionDims) -> torch.Tensor:
    """HF ``conv1d.weight`` ``[q; k; v]`` channels from Megatron's per-rank ``[q_r; k_r; v_r]``."""
    return torch.cat(_split_chunks(chunks, d.segments(len(chunks))[:3]), 0)


def out_norm_full(weight: torch.Tensor, d: LinearAttentionDims) -> torch.Tensor:
    """HF ``linear_attn.norm.weight`` from Megatron's ``out_norm.weight`` (``x·w`` in the
    checkpoint; plus one when Megatron's norms are zero-centred), in float32 arithmetic."""
    if not d.out_norm_offset:
        return weight
    return (weight.float() + d.out_norm_offset).to(weight.dtype)


def gated_qkv_full(chunks: Sequence[torch.Tensor], num_heads: int, num_groups: int, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF ``(q_proj, k_proj, v_proj)`` of a gated ``linear_qkv``: q_proj rows ``[q_h; gate_h]``
    per query head."""
    full = torch.cat(list(chunks), 0)
    rest = full.shape[1:]
    p = num_heads // num_groups
    grouped = full.reshape(num_groups, 2 * p + 2, head_dim, *rest)
    q, gate, k, v = grouped.split([p, p, 1, 1], dim=1)
    q_gate = torch.stack([q, gate], 2)  # [groups, p, 2, hd, ...]: per head q then its gate
    return (q_gate.reshape(num_heads * 2 * head_dim, *rest), k.reshape(num_groups * head_dim, *rest),
            v.reshape(num_groups * head_dim, *rest))


def gated_q_group_shape(num_groups: int, head_dim: int, hf_shape: Sequence[int]
                        ) -> tuple[int, ...]:
    """A gated ``q_proj`` (rows ``[q_h; gate_h]`` per head) per KV group: ``[nkv, heads per
    group, 2, head_dim, *rest]``, a row-major reshape of the HF tensor, the form in which
    Megatron's ``[q heads | gate heads]`` rows of a group are a view."""
    rows, rest = int(hf_shape[0]), [int(n) for n in hf_shape[1:]]
    return (num_groups, rows // num_groups // (2 * head_dim), 2, head_dim, *rest)


def gated_qkv_views(hf_names: Sequence[str], tensor: torch.Tensor, num_heads: int, num_groups: int,
                    head_dim: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's q (gated form, ``gated_q_group_shape``), k and v (``[groups, head_dim,
    ...]``) of a gated ``linear_qkv`` holding whole KV groups (TP <= nkv), as views: a group's
    rows are ``[q heads | gate heads | k | v]``."""
    p, rest = num_heads // num_groups, tuple(tensor.shape[1:])
    grouped = tensor.view(num_groups // tp, 2 * p + 2, head_dim, *rest)
    q_gate = grouped[:, :2 * p].unflatten(1, (2, p)).transpose(1, 2)  # [g, p, 2, hd, ...]
    q_name, k_name, v_name = hf_names
    return {q_name: q_gate, k_name: grouped[:, 2 * p], v_name: grouped[:, 2 * p + 1]}


def hf_shapes(kind: str, local_shape: Sequence[int], tp: int, d: Optional[LinearAttentionDims],
              num_heads: int, num_groups: int, head_dim: int) -> list[list[int]]:
    """Global HF shapes (in target order) of one rank's Megatron tensor of ``kind``."""
    rest = [int(s) for s in local_shape[1:]]
    if kind == "gated_qkv":
        return [[2 * num_heads * head_dim, *rest], [num_groups * head_dim, *rest],
                [num_groups * head_dim, *rest]]
    if kind == "gdn_norm":
        return [[int(local_shape[0]), *rest]]
    if d is None:
        raise BadInputError(f"{kind}: the model config has no Gated-DeltaNet dims")
    kd, vd = d.num_key_heads * d.key_head_dim, d.num_value_heads * d.value_head_dim
    if kind == "gdn_in_proj":
        return [[2 * kd + 2 * vd, *rest], [2 * d.num_value_heads, *rest]]
    if kind == "gdn_in_proj_flat":
        return [[2 * kd + vd, *rest], [vd, *rest], [d.num_value_heads, *rest], [d.num_value_heads, *rest]]
    return [[2 * kd + vd, *rest]]  # gdn_conv1d


def hf_config_keys(config: Any) -> dict:
    """The HF Qwen3-Next / Qwen3.5 keys the receiver reads (conv1d segments, gated q rows); {} for a
    model without Gated-DeltaNet layers or the attention output gate."""
    out: dict = {}
    d = LinearAttentionDims.from_config(config)
    if d is not None:
        freq = config.linear_attention_freq  # megatron-core's get_linear_attention_pattern
        linear = ([bool(x) for x in freq] if isinstance(freq, list)
                  else [(i + 1) % int(freq) != 0 for i in range(int(config.num_layers))])
        out.update(layer_types=["linear_attention" if x else "full_attention" for x in linear],
                   linear_num_key_heads=d.num_key_heads, linear_num_value_heads=d.num_value_heads,
                   linear_key_head_dim=d.key_head_dim, linear_value_head_dim=d.value_head_dim,
                   linear_conv_kernel_dim=int(config.linear_conv_kernel_dim))
    if getattr(config, "attention_output_gate", False):
        out.update(attn_output_gate=True)
    return out
