"""What the plan tool plans, on paper: every parameter with the layouts the engine would
see on both sides (a layout key per param, per training PP stage), for a layout checked by
``plan_layout`` (``RefitParallelism``, ``parallelism_problems``: no torch there).

Ranks follow the refit's own conventions (``build_nccl_reshard_refit_info``): one refit
group per training PP stage, its training ranks first (stage-local ``0..S-1``, Megatron's
order ``tp-cp-ep-dp-pp``, so a stage's ranks are contiguous), then every generation rank.

Bulk params (``is_nccl_reshard_param``: dense FFN and routed experts) get their layout
from ``build_nccl_reshard_refit_info`` itself, so the simulation plans what the refit
plans. The other params (attention, norms, router, shared experts, embeddings) get, with
``others="sharded"`` (what the refit does), the placements Megatron-Core and vLLM hold them
in, moved shard to shard by the engine (see docs/SCALE.md for the rules, MLA included);
``others="broadcast"`` models the refit's packed-broadcast option instead: one packed
broadcast per stage from the stage's first training rank.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.geometry import REPLICATE
from megatron_reshard.engine.param_plan import LayoutKey
from megatron_reshard.engine.plan import layout_key
from megatron_reshard.layout.placements import MeshInfo, build_mesh_info
from megatron_reshard.wire.placement_rules import is_nccl_reshard_param
from megatron_reshard.megatron import gpt_oss
from megatron_reshard.megatron.qkv import megatron_qkv_layout
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info, extract_layer_name
from megatron_reshard.wire.records import RefitPayload
from megatron_reshard.vllm_layout import gpt_oss as vllm_gpt_oss
from megatron_reshard.vllm_layout.dense import (QKV_PARAM_RE, AttentionHeads, padded_vocab_rows,
                                                qkv_gen_layout)

from .plan_layout import RefitParallelism, parallelism_problems, stage_layer_counts
from .presets import attention_heads, hf_params, is_mla, travels_packed

# Gated-DeltaNet params split on their rows on both sides: Qwen3.5's in_proj streams (the
# refit sends in_proj_qkv as its q, k, v segments, each split over TP: per rank, the same
# bytes as one split of the whole), the conv1d channels likewise, A_log and dt_bias (per
# value head)
GDN_ROWS = re.compile(r"\.linear_attn\.(?:in_proj_(?:qkv|z|b|a)\.weight|conv1d\.weight|A_log|dt_bias)$")
REPLICATE_PLACEMENT = Replicate()

# RefitParallelism and parallelism_problems live in plan_layout (no torch); importable here too
__all__ = ["RefitParallelism", "SimParam", "StagePlanInput", "count_params", "parallelism_problems",
           "stage_inputs", "stage_of_layers"]

OTHERS_MODES = ("broadcast", "sharded")
WIRE_DTYPES = ("bf16", "fp8")
# Block FP8 on the wire (DeepSeek's format: e4m3 bytes, one fp32 scale per 128x128 block)
FP8_BYTES_PER_ELEMENT = 1 + 4 / (128 * 128)
MEGATRON_VOCAB_DIVISOR = 128  # make_vocab_size_divisible_by's default


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def stage_of_layers(lay: RefitParallelism, layers: int) -> dict[str, int]:
    """Layer key -> training PP stage (embeddings first, final norm and LM head last)."""
    counts = stage_layer_counts(lay, layers)
    out, layer = {"model.embed_tokens": 0}, 0
    for stage, n in enumerate(counts):
        for _ in range(n):
            out[f"model.layers.{layer}"] = stage
            layer += 1
    out["model.norm"] = out["lm_head"] = lay.train_pp - 1
    return out


class SimParam(NamedTuple):
    """One HF param of one stage: how it moves (``key`` is None for the packed broadcast)."""

    name: str
    shape: tuple
    itemsize: float  # bytes per element on the wire (FP8 adds its block scales)
    key: Optional[LayoutKey]
    bulk: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return round(self.numel * self.itemsize)


@dataclass
class StagePlanInput:
    """A stage's params in payload order (bulk, then the others) and per-key counts."""

    params: list = field(default_factory=list)

    def key_counts(self) -> Counter:
        return Counter((p.key, p.itemsize) for p in self.params if p.key is not None)


_ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}


def _wire_itemsize(name: str, dtype: str, wire: str) -> float:
    """Bytes per element on the wire: with ``wire="fp8"`` the linear weights (attention and
    MLP projections, experts) travel as block FP8, as DeepSeek-V3 / Kimi-K2 FP8 checkpoints
    hold them; embeddings, LM head, router and norms stay as they are."""
    if wire == "fp8" and name.endswith(("proj.weight", "proj_with_mqa.weight")):
        return FP8_BYTES_PER_ELEMENT
    return _ITEMSIZE[dtype]


def stage_inputs(lay: RefitParallelism, cfg: Mapping[str, Any], others: str = "sharded",
                 wire: str = "bf16") -> dict[int, StagePlanInput]:
    """Every parameter of every training PP stage with the layout the engine would plan."""
    if others not in OTHERS_MODES:
        raise ValueError(f"others={others!r}: expected one of {OTHERS_MODES}")
    if wire not in WIRE_DTYPES:
        raise ValueError(f"wire={wire!r}: expected one of {WIRE_DTYPES}")
    params = hf_params(cfg)
    stage_map = stage_of_layers(lay, int(cfg["num_hidden_layers"]))
    bulk_meta = {p.name: {"shape": list(p.shape), "dtype": p.dtype} for p in params
                 if is_nccl_reshard_param(p.name)}
    info = RefitPayload.of(build_nccl_reshard_refit_info(
        bulk_meta, {"tp_size": lay.train_tp, "ep_size": lay.train_ep, "pp_size": lay.train_pp},
        {"tp_size": lay.gen_tp, "ep_size": lay.gen_ep, "pp_size": 1},
        lay.train_world, lay.gen_world, stage_map if lay.train_pp > 1 else None))
    out = {s: StagePlanInput() for s in range(lay.train_pp)}
    keys: dict = {}
    for p in info.params():
        light = (p.global_shape, p.src_mesh_info.key(), tuple(map(repr, p.src_placements)),
                 p.dst_mesh_info.key(), tuple(map(repr, p.dst_placements)))
        key = keys.get(light)
        if key is None:
            key = keys[light] = layout_key(p.global_shape, p.src_mesh_info, p.src_placements,
                                           p.dst_mesh_info, p.dst_placements, p.name)
        out[p.stage].params.append(
            SimParam(p.name, p.global_shape, _wire_itemsize(p.name, p.dtype, wire), key, True))
    rules = _OtherRules(lay, cfg)
    oss = _gpt_oss_experts(lay, params, wire) if others == "sharded" else {}
    for name, sim in oss.get("wire", {}).items():
        out[stage_map[extract_layer_name(name)]].params.append(sim)
    for p in params:
        if is_nccl_reshard_param(p.name) or p.name in oss.get("consumed", ()):
            continue
        stage = stage_map[extract_layer_name(p.name)]
        sharded = others == "sharded" and not travels_packed(cfg, p.name, lay.train_tp)
        key = rules.key(p.name, p.shape) if sharded else None
        out[stage].params.append(
            SimParam(p.name, p.shape, _wire_itemsize(p.name, p.dtype, wire), key, False))
    return out


def _gpt_oss_experts(lay: RefitParallelism, params: Sequence, wire: str) -> dict:
    """gpt-oss's experts as the refit sends them: vLLM's wire form (``megatron.gpt_oss``),
    whole experts over Megatron's EP to vLLM's (``vllm_layout.gpt_oss.gen_placements``).
    ``{"wire": {name: SimParam}, "consumed": per-expert HF names}`` ({} for other models)."""
    meta = {p.name: {"shape": list(p.shape), "dtype": p.dtype} for p in params}
    grouped = gpt_oss.wire_metadata(meta, lambda n: False)
    names = [n for n in grouped if vllm_gpt_oss.WIRE_RE.match(n)]
    if not names:
        return {}
    sw = lay.stage_world
    src_mesh, src_dims = build_mesh_info(sw, 0, ep_size=lay.train_ep)
    src_pl = [REPLICATE_PLACEMENT] * src_mesh.ndim
    if "ep" in src_dims:
        src_pl[src_dims["ep"]] = Shard(0)
    dst_mesh, dst_dims = (build_mesh_info(lay.gen_world, sw, ep_size=lay.gen_ep) if lay.gen_ep > 1
                          else build_mesh_info(lay.gen_world, sw, tp_size=lay.gen_tp))
    out = {}
    for name in names:
        shape, dtype = tuple(grouped[name]["shape"]), grouped[name]["dtype"]
        dst_pl = vllm_gpt_oss.gen_placements(vllm_gpt_oss.WIRE_RE.match(name)["leaf"], shape,
                                             dst_mesh.shape, dst_dims)
        key = layout_key(shape, src_mesh, src_pl, dst_mesh, dst_pl, name)
        # the weights are projections (block FP8 with --wire fp8), the biases stay as they are
        itemsize = _wire_itemsize(name.replace("_weight", "_proj.weight"), dtype, wire)
        out[name] = SimParam(name, shape, itemsize, key, True)
    return {"wire": out, "consumed": set(meta) - set(grouped)}


class _OtherRules:
    """Placements of the non-bulk params on both sides, as the two frameworks hold them.

    Training (Megatron-Core, Transformer-Engine spec): column-parallel rows (MLA q_b/kv_b,
    shared-expert gate/up) and row-parallel columns (o_proj, shared down) split over TP;
    MLA down-projections (q_a, kv_a) duplicated on every TP rank; vocab rows padded to
    128·TP and split evenly. Generation (vLLM, ``vllm_layout``): the same splits over its
    TP, vocab padded to 64 and split evenly; norms, router and routing bias replicated on
    both sides. GQA q/k/v travel per KV group as the refit sends them (``megatron.qkv``
    and ``vllm_layout.dense.qkv_gen_layout``: KV heads replicated over TP/nkv gen ranks).
    """

    def __init__(self, lay: RefitParallelism, cfg: Mapping[str, Any]) -> None:
        self.cfg, self.lay = cfg, lay
        self.nh, self.nkv = attention_heads(cfg)
        sw = lay.stage_world
        self.src = _mesh(sw, 0, lay.train_tp)
        self.dst = _mesh(lay.gen_world, sw, lay.gen_tp)
        self.vocab = int(cfg["vocab_size"])

    def key(self, name: str, shape: tuple) -> LayoutKey:
        src_dim = dst_dim = None  # None: replicated; an int: split over TP; ("pad", n): vocab
        if QKV_PARAM_RE.search(name) and not is_mla(self.cfg):
            return self._qkv_key(name, shape)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tp = self.lay.train_tp
            src_dim = (0, _round_up(self.vocab, MEGATRON_VOCAB_DIVISOR * tp))
            dst_dim = (0, padded_vocab_rows(self.vocab))
        elif len(shape) == 2 and name.endswith(("q_proj.weight", "q_b_proj.weight",
                                                "kv_b_proj.weight", "gate_proj.weight",
                                                "up_proj.weight")):
            src_dim = dst_dim = 0
        elif len(shape) == 2 and name.endswith(("o_proj.weight", "down_proj.weight",
                                                  "linear_attn.out_proj.weight")):
            src_dim = dst_dim = 1
        elif GDN_ROWS.search(name):  # rows split alike on both sides (vllm_layout.dense)
            src_dim = dst_dim = 0
        # q_a_proj, kv_a_proj_with_mqa, norms, router weight and bias: replicated
        src = _placed(self.src, src_dim)
        dst = _placed(self.dst, dst_dim)
        return LayoutKey(tuple(shape), *src, *dst)

    def _qkv_key(self, name: str, shape: tuple) -> LayoutKey:
        """q/k/v weight or bias in the per-KV-group form ``[nkv, rows per group, ...]``."""
        heads = AttentionHeads(self.nh, self.nkv, shape[0] // (self.nh if ".q_proj." in name
                                                               else self.nkv))
        which = name.rsplit(".", 2)[-2][0]
        grouped = (self.nkv, shape[0] // self.nkv, *shape[1:])
        sides = []
        for (mshape, ranks, tp_axis), layout in ((self.src, megatron_qkv_layout),
                                                 (self.dst, qkv_gen_layout)):
            mesh = MeshInfo(torch.tensor(ranks).reshape(mshape))
            dims = {} if tp_axis is None else {"tp": tp_axis}
            arg = heads if layout is megatron_qkv_layout else self.nkv
            sides.append(layout(mesh, dims, arg, which))
        (s_mesh, s_pl), (d_mesh, d_pl) = sides
        return layout_key(grouped, s_mesh, s_pl, d_mesh, d_pl, name)


def _mesh(world: int, offset: int, tp: int) -> tuple:
    """(mesh shape, ranks, axis of tp or None) of a TP×DP mesh, as build_mesh_info lays it."""
    mesh, dim_map = build_mesh_info(world, offset, tp_size=tp)
    shape, ranks = mesh.key()
    return shape, ranks, dim_map.get("tp")


def _placed(mesh: tuple, dim) -> tuple:
    shape, ranks, tp_axis = mesh
    dims = [REPLICATE] * len(shape)
    if dim is not None and tp_axis is not None:
        dims[tp_axis] = dim
    return shape, ranks, tuple(dims)


def count_params(stages: Mapping[int, StagePlanInput]) -> dict[str, int]:
    """HF tensors and bytes the refit moves, split by path (bulk engine / others)."""
    out = {"bulk_params": 0, "other_params": 0, "bulk_bytes": 0, "other_bytes": 0,
           "hf_tensors": 0, "elements": 0}
    for st in stages.values():
        for p in st.params:
            kind = "bulk" if p.bulk else "other"
            out[f"{kind}_params"] += 1
            out[f"{kind}_bytes"] += p.nbytes
            out["elements"] += p.numel
            # a grouped expert entry stands for one HF tensor per expert
            out["hf_tensors"] += p.shape[0] if p.bulk and ".experts." in p.name else 1
    return out


def gen_group_ranks(lay: RefitParallelism) -> Sequence[int]:
    return range(lay.stage_world, lay.stage_world + lay.gen_world)
