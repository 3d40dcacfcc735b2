"""Full Hugging Face tensors from the vLLM-layout shards of every generation rank (tests only).

Written from vLLM's layer definitions alone, independently of ``megatron_reshard`` (the
receiver's targets, the train-side converters and ``testing.vllm_like``'s oracle), so a
mistake shared by those cannot cancel out here. Facts used, per generation TP rank r of T:

- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocab is padded to a multiple of 64,
  rank r holds rows ``[r·P/T, (r+1)·P/T)`` of the padded matrix.
- ``QKVParallelLinear`` (``qkv_proj``): rank r holds ``[q_r; k_r; v_r]``; q heads are split
  evenly; when T > num_kv_heads each KV head is replicated on T/num_kv_heads consecutive
  ranks, else each rank holds num_kv_heads/T KV heads. The bias has the same rows.
- ``MergedColumnParallelLinear`` (``gate_up_proj``): rank r holds ``[gate_r; up_r]``.
- ``RowParallelLinear`` (``o_proj``, ``down_proj``): rank r holds input columns chunk r.
- ``FusedMoE``: ``w13_weight [E_local, 2·I_r, H]`` (gate rows then up rows of each expert)
  and ``w2_weight [E_local, H, I_r]``. Without EP every rank holds all experts with I split
  over TP; with EP (= TP here) rank r holds whole experts, contiguous, the first E mod EP
  ranks one more.
- MLA (DeepSeek-V3, ``deepseek_v2.py``): ``fused_qkv_a_proj`` (with q LoRA) is
  ``[q_a_proj; kv_a_proj_with_mqa]`` on every rank (``disable_tp``); ``q_b_proj`` /
  ``q_proj`` and ``kv_b_proj`` are ``ColumnParallelLinear`` (rank r holds output rows
  chunk r); ``o_proj`` is row parallel; ``kv_a_proj_with_mqa`` (without q LoRA) and the
  ``q_a_layernorm`` / ``kv_a_layernorm`` are replicated. DeepSeek's ``shared_experts`` are a
  plain MLP (``gate_up_proj`` / ``down_proj``, TP-sharded).
- Everything else (norms, router ``gate`` and its ``e_score_correction_bias``,
  ``shared_expert_gate``) is replicated.

Every replica is checked equal across ranks and every vLLM parameter must be consumed:
a refit that leaves a replica stale or writes an unexpected name fails here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True)
class Dims:
    """What the reassembly needs to know about the model (from the test's own spec)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0
    q_lora_rank: int = 0  # MLA with q LoRA: rows of q_a_proj inside fused_qkv_a_proj


def _check_replicas(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    for r, t in enumerate(shards[1:], start=1):
        if not torch.equal(t, shards[0]):
            raise AssertionError(f"{name}: gen rank {r} holds a different replica than gen rank 0 "
                                 f"(max abs diff {(t.float() - shards[0].float()).abs().max().item()})")
    return shards[0]


def _qkv(name: str, shards: Sequence[torch.Tensor], d: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = len(shards)
    q_rows = d.num_heads // T * d.head_dim
    kv_heads_per_rank = max(1, d.num_kv_heads // T)
    kv_rows = kv_heads_per_rank * d.head_dim
    parts = []
    for r, s in enumerate(shards):
        if s.shape[0] != q_rows + 2 * kv_rows:
            raise AssertionError(f"{name}: gen rank {r} holds {s.shape[0]} rows, expected "
                                 f"{q_rows} q + 2·{kv_rows} k/v rows")
        parts.append(s.split([q_rows, kv_rows, kv_rows]))
    q = torch.cat([p[0] for p in parts])
    if T > d.num_kv_heads:
        replicas = T // d.num_kv_heads
        k_heads, v_heads = [], []
        for g in range(d.num_kv_heads):
            ranks = range(g * replicas, (g + 1) * replicas)
            k_heads.append(_check_replicas(f"{name} (k head {g})", [parts[r][1] for r in ranks]))
            v_heads.append(_check_replicas(f"{name} (v head {g})", [parts[r][2] for r in ranks]))
        return q, torch.cat(k_heads), torch.cat(v_heads)
    return q, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def _experts_of_rank(num_experts: int, rank: int, ep: int) -> range:
    counts = [num_experts // ep + (1 if i < num_experts % ep else 0) for i in range(ep)]
    start = sum(counts[:rank])
    return range(start, start + counts[rank])


def _fused_moe(prefix: str, w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], d: Dims,
               ep: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if ep > 1:
        for r in range(len(w13)):
            ids = _experts_of_rank(d.num_experts, r % ep, ep)
            if w13[r].shape[0] != len(ids):
                raise AssertionError(f"{prefix}.w13_weight: gen rank {r} holds {w13[r].shape[0]} "
                                     f"experts, expected {len(ids)}")
            for local, e in enumerate(ids):
                gate, up = w13[r][local].chunk(2, dim=0)
                for key, t in ((f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up),
                               (f"{prefix}.{e}.down_proj.weight", w2[r][local])):
                    if key in out and not torch.equal(out[key], t):
                        raise AssertionError(f"{key}: gen rank {r} disagrees with another holder")
                    out[key] = t
        return out
    for e in range(d.num_experts):
        halves = [s[e].chunk(2, dim=0) for s in w13]
        out[f"{prefix}.{e}.gate_proj.weight"] = torch.cat([h[0] for h in halves])
        out[f"{prefix}.{e}.up_proj.weight"] = torch.cat([h[1] for h in halves])
        out[f"{prefix}.{e}.down_proj.weight"] = torch.cat([s[e] for s in w2], dim=1)
    return out


_QKV = re.compile(r"^(?P<p>.*)\.qkv_proj\.(?P<kind>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<p>.*)\.gate_up_proj\.weight$")
_EXPERTS = re.compile(r"^(?P<p>.*\.mlp\.experts)\.(?P<w>w13_weight|w2_weight)$")
_ROW = re.compile(r".*\.(o_proj|down_proj)\.weight$")
_MLA_COLUMN = re.compile(r".*\.self_attn\.(q_b_proj|kv_b_proj|q_proj)\.weight$")
_FUSED_A = re.compile(r"^(?P<p>.*)\.fused_qkv_a_proj\.weight$")


def hf_state_dict_from_vllm_shards(shards: Sequence[Mapping[str, torch.Tensor]], dims: Dims,
                                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Full HF tensors from ``shards[r]`` = gen TP rank r's ``{vLLM name: tensor}`` (one
    generation DP replica, ranks in TP order). ``ep_size``: vLLM's EP (1 or TP)."""
    names = set(shards[0])
    for r, s in enumerate(shards):
        if set(s) != names:
            raise AssertionError(f"gen rank {r} has params {sorted(set(s) ^ names)} that gen rank 0 "
                                 "does not (or the reverse)")
        for n, t in s.items():
            if t.is_floating_point() and torch.isnan(t).any():
                raise AssertionError(f"{n}: gen rank {r} still holds NaN (never written by the refit)")
    hf: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name in sorted(names):
        if name in done:
            continue
        per_rank = [s[name] for s in shards]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.cat(per_rank)
            padded = -(-dims.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            if full.shape[0] != padded:
                raise AssertionError(f"{name}: {full.shape[0]} rows over all ranks, expected the "
                                     f"vocab {dims.vocab_size} padded to {padded}")
            hf[name] = full[: dims.vocab_size]
        elif m := _QKV.match(name):
            q, k, v = _qkv(name, per_rank, dims)
            for proj, t in zip("qkv", (q, k, v)):
                hf[f"{m['p']}.{proj}_proj.{m['kind']}"] = t
        elif m := _GATE_UP.match(name):
            halves = [t.chunk(2, dim=0) for t in per_rank]
            hf[f"{m['p']}.gate_proj.weight"] = torch.cat([h[0] for h in halves])
            hf[f"{m['p']}.up_proj.weight"] = torch.cat([h[1] for h in halves])
        elif m := _EXPERTS.match(name):
            w13, w2 = f"{m['p']}.w13_weight", f"{m['p']}.w2_weight"
            hf.update(_fused_moe(m["p"], [s[w13] for s in shards], [s[w2] for s in shards], dims, ep_size))
            done.update((w13, w2))
        elif m := _FUSED_A.match(name):
            fused = _check_replicas(name, per_rank)
            hf[f"{m['p']}.q_a_proj.weight"] = fused[: dims.q_lora_rank]
            hf[f"{m['p']}.kv_a_proj_with_mqa.weight"] = fused[dims.q_lora_rank:]
        elif _MLA_COLUMN.match(name):
            hf[name] = torch.cat(per_rank)
        elif _ROW.match(name):
            hf[name] = torch.cat(per_rank, dim=1)
        else:
            hf[name] = _check_replicas(name, per_rank)
        done.add(name)
    return hf


# ---- gpt-oss (vLLM gpt_oss.py): embedding / attn renamed, attn.sinks split by head over TP,
# o_proj / router biases whole; FusedMoE w13 [E_l, 2·I_r, H] rows = the checkpoint's
# gate_up_proj columns (gate and up interleaved) of rank r's intermediate chunk, w13_bias the
# same; w2 [E_l, H, I_r]; w2_bias whole on TP rank 0, zero on the others (EP: every rank its
# experts' biases). HF (transformers) stacks the experts: gate_up_proj [E, H, 2I], down_proj
# [E, I, H] and their biases [E, 2I], [E, H].
_OSS_EXPERTS = re.compile(r"^(?P<p>.*\.mlp\.experts)(?:\.routed_experts)?\.(?P<w>w13|w2)_(?P<k>weight|bias)$")


def gpt_oss_state_dict_from_vllm_shards(shards: Sequence[Mapping[str, torch.Tensor]], dims: Dims,
                                        ep_size: int = 1) -> dict[str, torch.Tensor]:
    """``hf_state_dict_from_vllm_shards`` for gpt-oss."""
    T = len(shards)
    hf: dict[str, torch.Tensor] = {}
    rest = [dict(s) for s in shards]
    for name in sorted(shards[0]):
        m = _OSS_EXPERTS.match(name)
        if name.endswith(".attn.sinks"):
            hf[name.replace(".attn.", ".self_attn.")] = torch.cat([s[name] for s in shards])
        elif m:
            per_expert = []
            for e in range(dims.num_experts):
                if ep_size > 1:
                    r = next(r for r in range(T) if e in _experts_of_rank(dims.num_experts, r % ep_size, ep_size))
                    t = shards[r][name][e - _experts_of_rank(dims.num_experts, r % ep_size, ep_size).start]
                elif m["w"] == "w2" and m["k"] == "bias":
                    for r in range(1, T):
                        if shards[r][name][e].count_nonzero():
                            raise AssertionError(f"{name}: expert {e} bias is not zero on TP rank {r}")
                    t = shards[0][name][e]
                else:  # w13 rows / bias: chunks in rank order; w2: input columns
                    t = torch.cat([s[name][e] for s in shards], dim=1 if m["w"] == "w2" and m["k"] == "weight" else 0)
                per_expert.append(t.t() if m["k"] == "weight" else t)
            hf_leaf = ("gate_up_proj" if m["w"] == "w13" else "down_proj") + ("_bias" if m["k"] == "bias" else "")
            hf[f"{m['p']}.{hf_leaf}"] = torch.stack(per_expert)
        else:
            continue
        for s in rest:
            del s[name]
    renamed = [{n.replace("model.embedding.", "model.embed_tokens.").replace(".attn.", ".self_attn."): t
                for n, t in s.items()} for s in rest]
    hf.update(hf_state_dict_from_vllm_shards(renamed, dims, ep_size))
    return hf
# ---- end gpt-oss
