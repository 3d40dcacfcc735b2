"""vLLM's per-rank layout of Qwen3-Next's Gated-DeltaNet and gated-attention weights.

Facts (vLLM 0.33, ``layers/mamba/gdn/qwen_gdn_linear_attn.py`` with
``gqa_interleaved_layout=True``, and ``models/qwen3_next.py``):

- ``in_proj_qkvz`` / ``in_proj_ba`` are MergedColumnParallelLinear with ONE output shard
  each, so rank r holds the r-th row chunk of the checkpoint tensor (whole key-head groups,
  the checkpoint's per-group interleave kept): the plain dim-0 split.
- ``conv1d.weight [C/T, 1, K]`` is loaded by ``mamba_v2_sharded_weight_loader`` with the
  three segments (q: key_dim, k: key_dim, v: value_dim) of the checkpoint's channels, each
  split over TP: rank r holds ``[q_r; k_r; v_r]``.
- Qwen3.5 (``models/qwen3_5.py``, ``gqa_interleaved_layout=False``): ``in_proj_qkvz`` is a
  MergedColumnParallelLinear of four output shards (key_dim, key_dim, value_dim,
  value_dim) and ``in_proj_ba`` of two (nv, nv); the checkpoint's flat ``in_proj_qkv``
  fills shards 0-2 (its q, k, v segments each split over TP), ``in_proj_z`` shard 3,
  ``in_proj_b`` / ``in_proj_a`` shards 0 / 1: rank r holds ``[q_r; k_r; v_r; z_r]`` and
  ``[b_r; a_r]``. Each stream (in_proj_qkv's q, k and v segments apart: the exact path's
  wire names ``in_proj_q`` / ``_k`` / ``_v``) is thus split over TP on its rows, as
  Megatron's ``in_proj`` splits it (``megatron.qwen3_next``): shard to shard at any pair
  of TP sizes that split the key heads.
- ``A_log [nv/T]`` (float32 whatever the model dtype) and ``dt_bias [nv/T]``: dim-0 split;
  ``norm.weight`` (one head's channels) replicated; ``out_proj`` row parallel.
- Gated full attention: ``qkv_proj`` is a QKVParallelLinear over ``2 * num_heads`` "heads"
  (``total_num_heads * (1 + attn_output_gate)``), so the checkpoint's ``q_proj`` rows
  ``[q_h; gate_h]`` per head split like the q rows of twice as many heads.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Optional

from megatron_reshard.vllm_layout.dense import AttentionHeads

CONV1D_RE = re.compile(r"\.linear_attn\.conv1d\.weight$")


def conv1d_pieces(hf_config: Any, tp_size: int, tp_rank: int
                  ) -> Optional[list[tuple[tuple[int, int], tuple[int, int]]]]:
    """(target rows, checkpoint rows) of each segment of rank ``tp_rank``'s conv1d; None
    when ``hf_config`` lacks the linear-attention dims or a segment does not split."""
    try:
        key_dim = int(hf_config.linear_num_key_heads) * int(hf_config.linear_key_head_dim)
        value_dim = int(hf_config.linear_num_value_heads) * int(hf_config.linear_value_head_dim)
    except TypeError:  # a size the payload lacks (None)
        return None
    out, at = [], 0
    for lo, size in ((0, key_dim), (key_dim, key_dim), (2 * key_dim, value_dim)):
        if size % tp_size:
            return None
        part = size // tp_size
        out.append(((at, at + part), (lo + tp_rank * part, lo + (tp_rank + 1) * part)))
        at += part
    return out


# the checkpoint's streams, and the exact path's wire names of in_proj_qkv's segments (q, k, v)
# the exact path's wire names of the conv1d channels' three segments (q, k, v)
CONV1D_STREAM_RE = re.compile(r"^(?P<prefix>.*\.linear_attn)\.conv1d_(?P<which>q|k|v)\.weight$")


def conv1d_stream_piece(hf_name: str, hf_config: Any, tp_size: int, tp_rank: int
                        ) -> Optional[tuple[str, tuple[int, int], tuple[int, int]]]:
    """A conv1d segment sent apart (``conv1d_q`` / ``_k`` / ``_v``: all channels of that
    segment): (vLLM's ``conv1d.weight``, its rows on this rank, the rows of the segment it
    receives); None for any other name, or where ``conv1d_pieces`` has none."""
    m = CONV1D_STREAM_RE.match(hf_name)
    pieces = conv1d_pieces(hf_config, tp_size, tp_rank) if m else None
    if pieces is None:
        return None
    segment = "qkv".index(m["which"])
    t_rows, (lo, hi) = pieces[segment]
    start = pieces[segment][1][0] - tp_rank * (hi - lo)  # the segment's first checkpoint row
    return f"{m['prefix']}.conv1d.weight", t_rows, (lo - start, hi - start)


FLAT_IN_PROJ_RE = re.compile(r"^(?P<prefix>.*\.linear_attn)\.in_proj_(?P<which>qkv|z|b|a|q|k|v)\.weight$")
_SHARDS_OF = {"qkv": [0, 1, 2], "q": [0], "k": [1], "v": [2], "z": [3], "b": [0], "a": [1]}


def flat_in_proj_pieces(hf_name: str, hf_config: Any, tp_size: int, tp_rank: int
                        ) -> Optional[tuple[str, int, list[tuple[tuple[int, int], tuple[int, int]]]]]:
    """Qwen3.5's flat ``in_proj_{qkv,z,b,a}``: (vLLM target, its rows on this rank,
    [(target rows, checkpoint rows)]); None for any other name, or when hf_config lacks the
    linear-attention dims or a segment does not split over ``tp_size``."""
    m = FLAT_IN_PROJ_RE.match(hf_name)
    if m is None:
        return None
    try:
        key_dim = int(hf_config.linear_num_key_heads) * int(hf_config.linear_key_head_dim)
        value_dim = int(hf_config.linear_num_value_heads) * int(hf_config.linear_value_head_dim)
        nv = int(hf_config.linear_num_value_heads)
    except TypeError:
        return None
    which = _SHARDS_OF[m["which"]]
    if m["which"] in ("b", "a"):
        target, shards = f"{m['prefix']}.in_proj_ba.weight", [nv, nv]
    else:
        target, shards = f"{m['prefix']}.in_proj_qkvz.weight", [key_dim, key_dim, value_dim, value_dim]
    if any(n % tp_size for n in shards):
        return None
    pieces, hf_at = [], 0
    for i in which:  # the checkpoint tensor holds shards ``which`` whole, in order
        part = shards[i] // tp_size
        at = sum(n // tp_size for n in shards[:i])
        pieces.append(((at, at + part), (hf_at + tp_rank * part, hf_at + (tp_rank + 1) * part)))
        hf_at += shards[i]
    return target, sum(shards) // tp_size, pieces


def attention_heads(hf_config: Any) -> AttentionHeads:
    """The q/k/v geometry of ``qkv_proj``: with ``attn_output_gate`` the q rows hold each
    head's gate too, laid out as twice as many heads."""
    heads = AttentionHeads.from_hf_config(hf_config)
    if hf_config.attn_output_gate:
        return replace(heads, num_heads=2 * heads.num_heads)
    return heads


_GDN_RE = re.compile(r"\.linear_attn\.")


def split_problem(hf_name: str, hf_config: Any, tp_size: int) -> Optional[str]:
    """Why vLLM cannot hold a Gated-DeltaNet param over ``tp_size`` ranks (None: it can):
    each rank takes whole key-head groups (``fix_query_key_value_ordering`` reads
    ``num_k_heads // tp_size`` of them)."""
    if not _GDN_RE.search(hf_name):
        return None
    nk = hf_config.linear_num_key_heads
    if nk and int(nk) % tp_size:
        return f"its {nk} Gated-DeltaNet key heads do not split over tp_size={tp_size}"
    return None
