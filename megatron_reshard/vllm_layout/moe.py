"""vLLM's per-rank layout of the routed experts (FusedMoE).

Facts (vLLM ``model_executor/layers/fused_moe/layer.py``):

- ``w13_weight [E_local, 2*I_p, H]`` holds each expert's gate rows then its up rows
  (``[E_local, I_p, H]``, up only, for non-gated experts); ``w2_weight [E_local, H, I_p]``.
  Newer vLLM nests them under ``experts.routed_experts``.
- Without EP every rank holds every expert, TP-sharded on the intermediate dim
  (``I_p = I/T``). With EP experts are whole (``I_p = I``) and each EP rank holds one
  contiguous block: ``determine_expert_map`` (placement strategy "linear", the default)
  gives rank r ``E // ep`` experts, one more for the first ``E % ep`` ranks, starting at
  ``r * (E // ep) + min(r, E % ep)``. (The "round_robin" strategy, only for grouped
  top-k models on DeepEP low-latency kernels, is not supported.)
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from megatron_reshard.layout.placements import BlockShard

W13 = "w13_weight"
W2 = "w2_weight"


def expert_block(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """vLLM's contiguous expert block ``[start, stop)`` of ``ep_rank``: remainder to the first ranks."""
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + base + (1 if ep_rank < rem else 0)


def expert_block_sizes(num_experts: int, ep_size: int) -> tuple[int, ...]:
    """Experts per EP rank, in EP rank order."""
    return tuple(b - a for a, b in (expert_block(num_experts, r, ep_size) for r in range(ep_size)))


def expert_gen_placement(num_experts: int, ep_size: int):
    """Placement of the expert dim (0) of a grouped ``[E, ...]`` tensor on vLLM's EP axis:
    ``Shard(0)`` when the experts split evenly (the same blocks), else the uneven blocks."""
    if num_experts % ep_size == 0:
        return Shard(0)
    return BlockShard(0, expert_block_sizes(num_experts, ep_size))


def expert_tp_split(ep_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(parts, index) of the intermediate dim a rank holds: whole experts with EP, the TP
    chunk without."""
    return (1, 0) if ep_size > 1 else (tp_size, tp_rank)


def expert_target_candidates(prefix: str, proj: str) -> list[str]:
    """vLLM param names that hold ``<prefix>.<i>.<proj>.weight`` (flat, then nested)."""
    leaf = W2 if proj == "down_proj" else W13
    return [f"{prefix}.{leaf}", f"{prefix}.routed_experts.{leaf}"]


def w13_offset(proj: str, inter_per_rank: int) -> int:
    """First row of ``proj`` inside an expert's w13 rows (gate first, then up)."""
    return 0 if proj == "gate_proj" else inter_per_rank
