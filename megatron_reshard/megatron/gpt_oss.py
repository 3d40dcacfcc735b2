"""gpt-oss's expert tensors: Megatron-Core's layout to the HF checkpoint's, per expert.

No Megatron import. Megatron's expert ``linear_fc1`` holds ``[gate ; up]`` rows (``[2I, H]``,
its GLU splits the output in two halves, ``mlp.MLP.forward``); the gpt-oss checkpoint
holds ``gate_up_proj [H, 2I]`` with gate and up interleaved along the columns (gate at the
even, up at the odd ones), its bias ``[2I]`` interleaved the same way. ``down_proj`` is
``[I, H]``, the transpose of Megatron's ``linear_fc2 [H, I]``. Experts are never TP-sharded
in Megatron here (expert-TP > 1 is refused), so every kind is one whole expert.

None of these is a view of the Megatron tensor (an interleave or a transpose): as
checkpoint tensors the ``oss_*`` params travel only in full (the packed path, when
``packed_params`` asks for it; ``full_tensor`` makes them). The exact path sends them in
vLLM's wire form instead (``vllm_layout.gpt_oss``: one tensor per layer and projection over
all experts), of which every Megatron expert tensor is a view (``wire_view``):
``linear_fc1 [2I, H]`` seen as ``[2, I, H]`` with its first two dims swapped is ``[I, 2, H]``,
the rows of ``w13`` (gate and up of row i side by side), its bias likewise; ``linear_fc2
[H, I]`` is ``w2`` itself and its bias ``w2_bias``. ``wire_metadata`` groups the per-expert
entries into those records, ``wire_members`` gives a rank's views of them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.vllm_layout.gpt_oss import EXPERT_RE, LEAF_OF, wire_shape

KINDS = ("oss_fc1", "oss_fc1_bias", "oss_fc2", "oss_fc2_bias")


def interleave_gate_up(fc1: torch.Tensor) -> torch.Tensor:
    """``[gate ; up]`` rows (or a bias) -> rows ``gate_0, up_0, gate_1, up_1, ...``."""
    rows = fc1.shape[0] // 2
    return fc1.reshape(2, rows, *fc1.shape[1:]).transpose(0, 1).reshape(fc1.shape)


def hf_shape(kind: str, local_shape: Sequence[int]) -> list[int]:
    """The HF shape of one expert's tensor from Megatron's (whole expert) shape."""
    shape = [int(s) for s in local_shape]
    if kind in ("oss_fc1", "oss_fc2"):
        return shape[::-1]  # [2I, H] -> [H, 2I]; [H, I] -> [I, H]
    return shape


def full_tensor(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """The HF tensor of one expert's Megatron tensor (a new, contiguous tensor)."""
    if kind == "oss_fc1":
        return interleave_gate_up(tensor).t().contiguous()
    if kind == "oss_fc1_bias":
        return interleave_gate_up(tensor).contiguous()
    if kind == "oss_fc2":
        return tensor.t().contiguous()
    return tensor


# ---- the exact path (the wire form: vllm_layout.gpt_oss)
_KIND_LEAF = {"oss_fc1": "w13_weight", "oss_fc1_bias": "w13_bias", "oss_fc2": "w2_weight",
              "oss_fc2_bias": "w2_bias"}


def wire_view(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """One expert's Megatron tensor as its slice of the wire tensor (a view, no copy)."""
    if kind in ("oss_fc1", "oss_fc1_bias"):
        rows = tensor.shape[0] // 2
        return tensor.view(2, rows, *tensor.shape[1:]).transpose(0, 1)  # [I, 2(, H)]
    return tensor


def wire_metadata(metadata: Mapping[str, dict], keep_packed: Callable[[str], bool]
                  ) -> dict[str, dict]:
    """``metadata`` with each layer's per-expert gpt-oss entries replaced by the wire
    record of their projection (``[E, ...]``), in the place of its first expert; a
    projection any of whose expert names ``keep_packed`` matches stays per expert."""
    groups: dict = defaultdict(dict)  # (prefix, leaf) -> {expert: (name, meta)}
    for name, meta in metadata.items():
        m = EXPERT_RE.match(name)
        if m:
            groups[m["prefix"], LEAF_OF[m["proj"], bool(m["bias"])]][int(m["index"])] = (name, meta)
    wire: dict = {}  # first expert's name -> (wire name, meta)
    consumed: set = set()
    for (prefix, leaf), experts in groups.items():
        names = [n for n, _ in experts.values()]
        if any(keep_packed(n) for n in names):
            continue
        first_name, first = experts[min(experts)]
        if sorted(experts) != list(range(len(experts))) or any(
                list(m["shape"]) != list(first["shape"]) or m["dtype"] != first["dtype"]
                for _, m in experts.values()):
            raise BadInputError(f"{prefix}.<e>.{leaf}: gpt-oss experts 0..{len(experts) - 1} "
                                f"of one shape and dtype expected, found {sorted(experts)} with "
                                f"shapes {sorted({tuple(m['shape']) for _, m in experts.values()})}")
        shape = wire_shape(leaf, len(experts), first["shape"])
        wire[first_name] = (f"{prefix}.{leaf}", {**first, "shape": list(shape)})
        consumed.update(names)
    out: dict = {}
    for name, meta in metadata.items():
        if name in wire:
            out[wire[name][0]] = wire[name][1]
        elif name not in consumed:
            out[name] = meta
    return out


def wire_members(converted: Sequence[tuple[Any, torch.Tensor]], wanted: Mapping[str, Any]
                 ) -> dict[str, list[torch.Tensor]]:
    """This rank's views of each wire tensor in ``wanted``: one per local expert, in expert
    order (``converted``: (``converters.Converted``, live tensor) pairs)."""
    found: dict = defaultdict(list)  # wire name -> [(global expert, view)]
    for conv, tensor in converted:
        if conv.kind not in _KIND_LEAF:
            continue
        m = EXPERT_RE.match(conv.hf_names[0])
        name = f"{m['prefix']}.{_KIND_LEAF[conv.kind]}" if m else None
        if name in wanted:
            found[name].append((int(m["index"]), wire_view(conv.kind, tensor.detach())))
    return {name: [v for _, v in sorted(views, key=lambda x: x[0])] for name, views in found.items()}
