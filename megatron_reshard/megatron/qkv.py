"""Megatron-Core's q/k/v rows per TP rank, in the per-KV-group form the refit sends.

Torch only (no Megatron import: the ``plan`` tool reads it too). ``linear_qkv`` holds the
rows ``[q heads of group g | k_g | v_g]`` for each KV group g, split contiguously over TP.
Seen per KV group (``[nkv, rows per group, ...]`` for each of q, k, v, a row-major reshape
of the HF tensor), a rank holds whole groups when TP <= nkv; when TP > nkv the TP/nkv
ranks of a group each hold a contiguous slice of its rows, which may cut through the q
rows or hold k/v rows only (``megatron_qkv_blocks``). ``qkv_views`` gives a rank's
``linear_qkv`` in that form, as views.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.placements import BlockShard, MeshInfo
from megatron_reshard.vllm_layout.dense import AttentionHeads


def megatron_qkv_blocks(heads: AttentionHeads, tp: int, which: str) -> tuple[int, ...]:
    """Rows of ``which`` (q, k or v) of one KV group that each of the group's TP ranks holds,
    when Megatron's TP exceeds the KV heads: ``linear_qkv``'s interleaved rows ``[q heads of
    the group | k | v]`` are split contiguously over the TP/nkv ranks of the group, so a rank
    holds a slice of the q rows, the k rows or the v rows (possibly of several, or none)."""
    parts = tp // heads.num_kv_heads
    hd = heads.head_dim
    q = heads.num_heads // heads.num_kv_heads * hd
    start, stop = {"q": (0, q), "k": (q, q + hd), "v": (q + hd, q + 2 * hd)}[which]
    per_part = (q + 2 * hd) // parts
    return tuple(max(0, min(stop, (p + 1) * per_part) - max(start, p * per_part))
                 for p in range(parts))


def megatron_qkv_layout(mesh: MeshInfo, dims: dict, heads: AttentionHeads,
                         which: str) -> tuple[MeshInfo, list]:
    """Megatron's q/k/v rows per train rank in the per-KV-group form ``[nkv, rows, ...]``:
    whole groups over TP (TP <= nkv); else the TP axis split into (group, part), the
    group's rows in the parts' blocks (``megatron_qkv_blocks``)."""
    tp_axis = dims.get("tp")
    tp = 1 if tp_axis is None else mesh.shape[tp_axis]
    if tp <= heads.num_kv_heads:
        placements: list = [Replicate() for _ in range(mesh.ndim)]
        if tp_axis is not None:
            placements[tp_axis] = Shard(0)
        return mesh, placements
    nkv = heads.num_kv_heads
    shape = list(mesh.shape)
    shape[tp_axis:tp_axis + 1] = [nkv, tp // nkv]
    split = MeshInfo(mesh.mesh.reshape(shape))
    placements = [Replicate() for _ in range(split.ndim)]
    placements[tp_axis] = Shard(0)
    placements[tp_axis + 1] = BlockShard(1, megatron_qkv_blocks(heads, tp, which))
    return split, placements


def heads_of(dims: Any) -> AttentionHeads:
    """The attention heads of a ``converters.ModelDims``."""
    return AttentionHeads(dims.num_attention_heads, dims.num_query_groups, dims.head_dim)


def which_qkv(name: str) -> str:
    return name.rsplit(".", 2)[-2][0]  # "...self_attn.k_proj.weight" -> "k"


def qkv_groups_fit(dims: Any, train_tp: int, gen_tp: int) -> bool:
    """Whether q/k/v weights and biases can travel per KV group: Megatron's TP divides
    the KV heads or is a multiple of them (it always is: Megatron needs it), and vLLM
    can split the heads over its TP (``AttentionHeads.tp_problem``). Otherwise they go in
    the packed broadcast, where the receiver names the problem."""
    nkv, nh = dims.num_query_groups, dims.num_attention_heads
    if nh % nkv or (nkv % train_tp if train_tp <= nkv else train_tp % nkv):
        return False
    return heads_of(dims).tp_problem(gen_tp) is None


def qkv_group_shape(num_kv_heads: int, hf_shape: Sequence[int]) -> tuple[int, ...]:
    """q/k/v weights (biases) seen per KV group: ``[nkv, rows per group, hidden]``
    (``[nkv, rows per group]``), a row-major reshape of the HF tensor, the form in which
    Megatron's interleaved rows are views."""
    nkv = num_kv_heads
    return (nkv, int(hf_shape[0]) // nkv, *(int(n) for n in hf_shape[1:]))


def qkv_views(hf_names: Sequence[str], tensor: torch.Tensor, dims: Any, tp_rank: int
              ) -> dict[str, torch.Tensor]:
    """q, k, v of ``linear_qkv`` (weight or bias; ``hf_names`` its q, k, v names) in the
    per-KV-group form, as strided views: ``[groups, rows, ...]`` of this rank's whole KV
    groups (TP <= nkv; rows of a group: its q heads, then k, then v), or ``[1, rows, ...]``
    of the slice of one group a rank holds when TP > nkv (``megatron_qkv_blocks``;
    possibly 0 rows)."""
    nkv, nh, hd = dims.num_query_groups, dims.num_attention_heads, dims.head_dim
    q_rows = nh // nkv * hd
    tp, rest = dims.tp_size, tuple(tensor.shape[1:])
    q_name, k_name, v_name = hf_names
    if tp <= nkv:
        grouped = tensor.view(nkv // tp, q_rows + 2 * hd, *rest)
        return {q_name: grouped[:, :q_rows], k_name: grouped[:, q_rows:q_rows + hd],
                v_name: grouped[:, q_rows + hd:]}
    part = tp_rank % (tp // nkv)
    out, offset = {}, 0
    for name, which in ((q_name, "q"), (k_name, "k"), (v_name, "v")):
        rows = megatron_qkv_blocks(heads_of(dims), tp, which)[part]
        out[name] = tensor[offset:offset + rows].unsqueeze(0)
        offset += rows
    return out
