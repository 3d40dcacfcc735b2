"""The one engine that reads the Megatron-Core → HF name tables (``families``): names of
one rank's params, their global HF shapes, and the tensor rules of each kind.

No Megatron import: the engine works on names, shapes and plain tensors, so it is tested
at name level (Transformer-Engine specs cannot be built on CPU) as well as on live models.
``NameConverter`` turns a rank's Megatron names into HF names (``find_rule`` sorts names by
kind without converting); ``hf_global_shapes``, ``local_views`` and ``full_from_tp_chunks``
say what a kind (``families`` lists them) means for the tensors: global shapes from a
local one, this rank's views, full tensors from TP chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError, MissingEntryError
from megatron_reshard.megatron import gpt_oss, mamba, qwen3_next
from megatron_reshard.megatron.families import FAMILIES, Rule

TP_SHARDED_KINDS = {"column": 0, "row": 1, "vocab": 0, "qkv": 0, "fc1": 0, **qwen3_next.TP_DIMS,
                    **mamba.TP_DIMS}
EXPERT_KINDS = ("expert_fc1", "expert_fc2", "grouped_fc1", "grouped_fc2", *gpt_oss.KINDS)

_WRAPPER_PREFIX = re.compile(r"^(?:module\.)+")
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def strip_wrappers(name: str) -> str:
    """Drop the ``module.`` prefixes that Float16Module / DDP wrappers add."""
    return _WRAPPER_PREFIX.sub("", name)


def _first_match(rules: Sequence[Rule], name: str) -> Optional[tuple[Rule, re.Match]]:
    for rule in rules:
        hit = rule.match(name)
        if hit is not None:
            return rule, hit
    return None


def find_rule(family: str, name: str) -> Optional[tuple[Optional[int], Rule, re.Match]]:
    """The family's rule for a Megatron name: (local layer index, None for a top-level
    name; the rule; its match, whose group 1 is the local expert index for per-expert
    kinds), or None when no rule matches. For tools that sort Megatron params by kind
    without converting them to HF names (the refit benchmark's baseline)."""
    top, layer = FAMILIES[family]
    name = strip_wrappers(name)
    m = _LAYER_NAME.fullmatch(name)
    if m is None:
        found = _first_match(top, name)
        return None if found is None else (None, *found)
    found = _first_match(layer, m.group(2))
    return None if found is None else (int(m.group(1)), *found)


@dataclass(frozen=True)
class Converted:
    """One Megatron parameter and the HF parameters it holds (on this rank)."""

    megatron_name: str
    kind: str
    hf_names: tuple[str, ...]
    # grouped_fc*: hf_names is per local expert, flattened (gate_0, up_0, gate_1, ...)

    @property
    def is_expert(self) -> bool:
        return self.kind in EXPERT_KINDS

    @property
    def tp_dim(self) -> Optional[int]:
        return TP_SHARDED_KINDS.get(self.kind)


@dataclass
class NameConverter:
    """Megatron names → HF names for one rank.

    ``global_layer`` maps a local layer index (``decoder.layers.<i>``) to the global 0-based
    layer index; ``expert_offset`` is ``ep_rank · experts_per_rank``.
    """

    family: str
    global_layer: Mapping[int, int]
    expert_offset: int = 0
    num_local_experts: int = 0
    gated: bool = True
    tied_embeddings: bool = False
    mla_down_replicated: bool = False  # TE spec: MLA down projections duplicated over TP
    _top: tuple[Rule, ...] = field(init=False, repr=False)
    _layer: tuple[Rule, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise BadInputError(f"unknown model family {self.family!r}; known: {sorted(FAMILIES)}")
        self._top, self._layer = FAMILIES[self.family]

    def convert(self, name: str) -> Optional[Converted]:
        """The HF names of one Megatron param; None for skipped entries; KeyError if unknown."""
        name = strip_wrappers(name)
        if name.endswith("_extra_state"):
            return None
        if self.tied_embeddings and name == "output_layer.weight":
            return None  # tied: HF has no lm_head.weight, the embedding carries it
        m = _LAYER_NAME.fullmatch(name)
        if m is None:
            found = _first_match(self._top, name)
            if found is None:
                raise MissingEntryError(name)
            return Converted(name, found[0].kind, tuple(found[0].targets))
        local_layer, rest = int(m.group(1)), m.group(2)
        if local_layer not in self.global_layer:
            raise MissingEntryError(f"{name} (local layer {local_layer} has no global layer number)")
        layer = self.global_layer[local_layer]
        found = _first_match(self._layer, rest)
        if found is not None:
            rule, hit = found
            if rule.kind == "skip":
                return None
            if rule.kind == "mla_down":
                kind = "replicated" if self.mla_down_replicated else "column"
                return Converted(name, kind, tuple(t.format(layer=layer) for t in rule.targets))
            targets = rule.targets
            if rule.kind in ("fc1", "expert_fc1", "grouped_fc1") and not self.gated:
                targets = targets[1:]  # non-gated fc1 is up_proj alone
            if rule.kind in ("expert_fc1", "expert_fc2", *gpt_oss.KINDS):
                expert = self.expert_offset + int(hit.group(1))
                return Converted(name, rule.kind, tuple(t.format(layer=layer, expert=expert) for t in targets))
            if rule.kind in ("grouped_fc1", "grouped_fc2"):
                if self.num_local_experts < 1:
                    raise MissingEntryError(f"{name} (grouped experts need num_local_experts)")
                names = tuple(t.format(layer=layer, expert=self.expert_offset + e)
                              for e in range(self.num_local_experts) for t in targets)
                return Converted(name, rule.kind, names)
            return Converted(name, rule.kind, tuple(t.format(layer=layer) for t in targets))
        raise MissingEntryError(name)

    def convert_all(self, names: Sequence[str]) -> tuple[list[Converted], list[str]]:
        """Convert every name; return (conversions, unknown names) so callers report all at once."""
        out, unknown = [], []
        for name in names:
            try:
                conv = self.convert(name)
            except KeyError:
                unknown.append(name)
                continue
            if conv is not None:
                out.append(conv)
        return out, unknown


@dataclass(frozen=True)
class ModelDims:
    """What the shape arithmetic needs: TP size, attention geometry, real vocab size."""

    tp_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    gated: bool
    num_local_experts: int = 0
    linear: Optional[qwen3_next.LinearAttentionDims] = None  # Gated-DeltaNet layers (Qwen3-Next)
    mamba: Optional[mamba.MambaDims] = None  # Mamba-2 layers (Nemotron-H)


def hf_global_shapes(conv: Converted, local_shape: Sequence[int], dims: ModelDims) -> dict[str, list[int]]:
    """Global HF shapes of the params ``conv`` holds, from this rank's local Megatron shape."""
    shape = [int(s) for s in local_shape]
    t = dims.tp_size
    kind = conv.kind
    if kind == "replicated":
        return {conv.hf_names[0]: shape}
    if kind == "column":
        return {conv.hf_names[0]: [shape[0] * t, *shape[1:]]}
    if kind == "row":
        return {conv.hf_names[0]: [shape[0], shape[1] * t, *shape[2:]]}
    if kind == "vocab":
        return {conv.hf_names[0]: [dims.vocab_size, *shape[1:]]}
    if kind == "qkv":
        q = dims.num_attention_heads * dims.head_dim
        kv = dims.num_query_groups * dims.head_dim
        if shape[0] * t != q + 2 * kv:
            raise BadInputError(f"{conv.megatron_name}: {shape[0]}·{t} rows, expected (nh + 2·nkv)·hd = {q + 2 * kv}")
        return dict(zip(conv.hf_names, ([q, *shape[1:]], [kv, *shape[1:]], [kv, *shape[1:]])))
    if kind in ("fc1", "expert_fc1"):
        rows = shape[0] * (t if kind == "fc1" else 1)
        if dims.gated:
            return {n: [rows // 2, *shape[1:]] for n in conv.hf_names}
        return {conv.hf_names[0]: [rows, *shape[1:]]}
    if kind == "expert_fc2":
        return {conv.hf_names[0]: shape}
    if kind in gpt_oss.KINDS:
        return {conv.hf_names[0]: gpt_oss.hf_shape(kind, shape)}
    if kind in mamba.KINDS:
        return {conv.hf_names[0]: mamba.hf_shape(kind, shape, t, dims.mamba, conv.megatron_name)}
    if kind in qwen3_next.KINDS:
        return dict(zip(conv.hf_names, qwen3_next.hf_shapes(
            kind, shape, t, dims.linear, dims.num_attention_heads, dims.num_query_groups, dims.head_dim)))
    if kind == "grouped_fc1":  # weight1 [H, E_l * (2)I]
        per = shape[1] // dims.num_local_experts // (2 if dims.gated else 1)
        return {n: [per, shape[0]] for n in conv.hf_names}
    if kind == "grouped_fc2":  # weight2 [E_l * I, H]
        per = shape[0] // dims.num_local_experts
        return {n: [shape[1], per] for n in conv.hf_names}
    raise BadInputError(f"{conv.megatron_name}: no shape rule for kind {kind!r}")


def local_views(conv: Converted, tensor: torch.Tensor, dims: ModelDims) -> dict[str, torch.Tensor]:
    """This rank's part of each HF param of ``conv`` as views of ``tensor`` (no copy).

    Defined for every kind except ``qkv`` and ``vocab``, whose rank-local rows do not line
    up with one HF tensor's chunk (interleave, padding); those travel as full tensors.
    """
    kind = conv.kind
    if kind in ("replicated", "column", "row", "expert_fc2"):
        return {conv.hf_names[0]: tensor}
    if kind in ("fc1", "expert_fc1"):
        if not dims.gated:
            return {conv.hf_names[0]: tensor}
        half = tensor.shape[0] // 2
        return {conv.hf_names[0]: tensor[:half], conv.hf_names[1]: tensor[half:]}
    if kind == "grouped_fc1":
        e_l = dims.num_local_experts
        per_expert = tensor.view(e_l, tensor.shape[0], -1)  # [E_l, H, (2)I], as GroupedMLP.forward reads it
        names = iter(conv.hf_names)
        out = {}
        for e in range(e_l):
            w = per_expert[e].t()  # [(2)I, H]
            if dims.gated:
                half = w.shape[0] // 2
                out[next(names)] = w[:half]
                out[next(names)] = w[half:]
            else:
                out[next(names)] = w
        return out
    if kind == "grouped_fc2":
        e_l = dims.num_local_experts
        per_expert = tensor.view(e_l, -1, tensor.shape[1])  # [E_l, I, H]
        return {name: per_expert[e].t() for e, name in enumerate(conv.hf_names)}
    raise BadInputError(f"{conv.megatron_name}: kind {kind!r} has no rank-local HF view")


def full_from_tp_chunks(conv: Converted, chunks: Sequence[torch.Tensor], dims: ModelDims) -> dict[str, torch.Tensor]:
    """Full HF tensors of ``conv`` from its TP chunks (in TP rank order; one chunk if not sharded)."""
    kind = conv.kind
    if kind in ("replicated", "expert_fc2"):
        return {conv.hf_names[0]: chunks[0]}
    if kind == "column":
        return {conv.hf_names[0]: torch.cat(list(chunks), 0)}
    if kind == "row":
        return {conv.hf_names[0]: torch.cat(list(chunks), 1)}
    if kind == "vocab":
        return {conv.hf_names[0]: torch.cat(list(chunks), 0)[: dims.vocab_size]}
    if kind == "qkv":
        full = torch.cat(list(chunks), 0)
        groups = dims.num_query_groups
        per_group_q = dims.num_attention_heads // groups * dims.head_dim
        grouped = full.reshape(groups, per_group_q + 2 * dims.head_dim, *full.shape[1:])
        q, k, v = grouped.split([per_group_q, dims.head_dim, dims.head_dim], dim=1)
        return {
            conv.hf_names[0]: q.reshape(groups * per_group_q, *full.shape[1:]),
            conv.hf_names[1]: k.reshape(groups * dims.head_dim, *full.shape[1:]),
            conv.hf_names[2]: v.reshape(groups * dims.head_dim, *full.shape[1:]),
        }
    if kind in ("fc1", "expert_fc1"):
        if not dims.gated:
            return {conv.hf_names[0]: torch.cat(list(chunks), 0)}
        halves = [c.chunk(2, dim=0) for c in chunks]
        return {
            conv.hf_names[0]: torch.cat([h[0] for h in halves], 0),
            conv.hf_names[1]: torch.cat([h[1] for h in halves], 0),
        }
    if kind in ("grouped_fc1", "grouped_fc2"):
        return local_views(conv, chunks[0], dims)
    if kind in gpt_oss.KINDS:
        return {conv.hf_names[0]: gpt_oss.full_tensor(kind, chunks[0])}
    if kind in mamba.KINDS:
        return {conv.hf_names[0]: mamba.full_tensor(kind, chunks, dims.mamba, conv.megatron_name)}
    if kind == "gated_qkv":
        return dict(zip(conv.hf_names, qwen3_next.gated_qkv_full(
            chunks, dims.num_attention_heads, dims.num_query_groups, dims.head_dim)))
    if kind in qwen3_next.KINDS:
        if dims.linear is None:
            raise BadInputError(f"{conv.megatron_name}: a Gated-DeltaNet param, but the model "
                                f"dims carry no linear-attention geometry")
        if kind == "gdn_in_proj":
            return dict(zip(conv.hf_names, qwen3_next.in_proj_full(chunks, dims.linear)))
        if kind == "gdn_in_proj_flat":
            return dict(zip(conv.hf_names, qwen3_next.in_proj_flat_full(chunks, dims.linear)))
        if kind == "gdn_norm":
            return {conv.hf_names[0]: qwen3_next.out_norm_full(chunks[0], dims.linear)}
        return {conv.hf_names[0]: qwen3_next.conv1d_full(chunks, dims.linear)}
    raise BadInputError(f"{conv.megatron_name}: no full-tensor rule for kind {kind!r}")
