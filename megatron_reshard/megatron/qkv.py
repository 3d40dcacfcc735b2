"""Megatron-Core's q/k/v rows per TP rank, in the per-KV-group form the refit sends.

Torch only (no Megatron import: the ``plan`` tool reads it too). ``linear_qkv`` holds the
rows ``[q heads of group g | k_g | v_g]`` for each KV group g, split contiguously over TP.
Seen per KV group (``[nkv, rows per group, ...]`` for each of q, k, v, a row-major reshape
of the HF tensor), a rank holds whole groups when TP <= nkv; when TP > nkv the TP/nkv
ranks of a group each hold a contiguous slice of its rows, which may cut through the q
rows or hold k/v rows only (``megatron_qkv_blocks``).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout import BlockShard, MeshInfo
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
