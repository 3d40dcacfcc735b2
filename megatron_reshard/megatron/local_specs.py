"""This train rank's side of the exact path: live HF-named views of its Megatron tensors and
the ``LocalParamSpec`` of each param, checked against the refit info.

No Megatron import. Views: dense ``gate_proj``/``up_proj`` are the two row halves of the
rank's ``linear_fc1``; q/k/v are per KV group (``qkv.qkv_views``); vocab and direct params
are the local tensor itself. Grouped experts are given to the engine as the list of the
rank's expert tensors, or one strided view when they sit at a constant step in one storage
(``stacked_spec``).
"""

from __future__ import annotations

from typing import Collection, Mapping, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import rank_region
from megatron_reshard.wire.placement_rules import is_nccl_reshard_param
from megatron_reshard.megatron import gpt_oss, mamba, qwen3_next
from megatron_reshard.megatron.converters import Converted, ModelDims, local_views
from megatron_reshard.megatron.qkv import qkv_views
from megatron_reshard.wire.spec import LocalParamSpec
from megatron_reshard.wire.expert_names import PER_EXPERT_RE
from megatron_reshard.wire.records import RefitPayload


def expected_local_shape(global_shape: Sequence[int], mesh, placements: Sequence, rank: int) -> Optional[list[int]]:
    """Shape of ``rank``'s local tensor under the engine's geometry; None if not in the mesh."""
    got = rank_region(global_shape, mesh, placements, rank)
    return None if got is None else list(got[1])


def local_hf_views(converted: Sequence[tuple[Converted, torch.Tensor]], exact_extra: Collection[str],
                   dims: ModelDims, tp_rank: int) -> dict[str, torch.Tensor]:
    """``hf_name -> view`` of this rank's tensors for every param on the exact path: the bulk
    set and the extras named in ``exact_extra``."""
    views: dict[str, torch.Tensor] = {}
    for conv, tensor in converted:
        if conv.kind == "gdn_in_proj_flat" and dims.linear is not None:
            # Qwen3.5's streams: row blocks of the rank's in_proj (megatron.qwen3_next)
            views.update(qwen3_next.stream_views(conv.hf_names, tensor.detach(), dims.linear,
                                                 dims.tp_size))
            continue
        if conv.kind == "gdn_conv1d" and dims.linear is not None:  # q, k, v channels apart
            views.update(qwen3_next.conv1d_stream_views(conv.hf_names[0], tensor.detach(),
                                                        dims.linear, dims.tp_size))
            continue
        streams = mamba.stream_names(conv.hf_names[0]) if conv.kind in mamba.KINDS else None
        if streams and dims.mamba is not None and streams[0] in exact_extra:
            # Nemotron-H's in_proj / conv1d streams: row blocks of the rank's tensor (megatron.mamba)
            views.update(mamba.stream_views(conv.hf_names[0], tensor.detach(), dims.mamba, dims.tp_size))
            continue
        if len(conv.hf_names) == 1 and conv.hf_names[0] in exact_extra:
            # vocab: the padded local shard; direct params: the TP chunk or the replica
            views[conv.hf_names[0]] = tensor.detach()
            continue
        if conv.kind == "fc1" and all(n in exact_extra for n in conv.hf_names):
            # shared experts: gate and up are the row halves of the rank's linear_fc1
            views.update(local_views(conv, tensor.detach(), dims))
            continue
        if conv.kind == "gated_qkv" and conv.hf_names[0] in exact_extra:
            views.update(qwen3_next.gated_qkv_views(
                conv.hf_names, tensor.detach(), dims.num_attention_heads, dims.num_query_groups,
                dims.head_dim, dims.tp_size))
            continue
        if conv.kind == "qkv" and conv.hf_names[0] in exact_extra:
            views.update(qkv_views(conv.hf_names, tensor.detach(), dims, tp_rank))
            continue
        if all(n in exact_extra for n in conv.hf_names):
            views.update(local_views(conv, tensor.detach(), dims))  # shared-expert fc1
            continue
        if not any(is_nccl_reshard_param(n) for n in conv.hf_names):
            continue
        views.update(local_views(conv, tensor.detach(), dims))
    for name, members in gpt_oss.wire_members(converted, exact_extra).items():
        views[name] = stacked_spec(members).base  # gpt-oss's experts: a list, or one view
    return views


def local_param_specs(info: RefitPayload, views: Mapping[str, torch.Tensor], stage: int,
                      stage_local_rank: int, me: str) -> dict[str, LocalParamSpec]:
    """``hf_name -> LocalParamSpec`` for every param of the refit ``info`` (records) on PP
    ``stage``, each checked against the region the src mesh/placements assign to
    ``stage_local_rank`` (shape and dtype). ``me`` names this rank in the errors; every
    problem is listed in one ``ValueError``."""
    specs: dict[str, LocalParamSpec] = {}
    problems: list[str] = []
    experts: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}  # grouped once
    for n, v in views.items():
        if m := PER_EXPERT_RE.match(n):
            experts.setdefault((m["prefix"], m["proj"]), []).append((int(m["index"]), v))
    for p in info.params():
        if p.stage != stage:
            continue
        name = p.name
        proj = p.grouped_expert_proj
        if proj is None:
            view = views.get(name)
            if view is None:
                problems.append(f"{name}: {me} holds no local tensor for it")
                continue
            first = view[0] if isinstance(view, list) else view  # gpt-oss's experts: members
            shape = [len(view), *first.shape] if isinstance(view, list) else list(view.shape)
            spec, dtype = LocalParamSpec(base=view), first.dtype
        else:
            prefix = name[: -len(f".{proj}.weight")]
            members = sorted(experts.get((prefix, proj), ()), key=lambda iv: iv[0])
            if not members:
                problems.append(f"{name}: {me} holds no local expert for it")
                continue
            tensors = [v for _, v in members]
            spec = stacked_spec(tensors)
            shape, dtype = [len(tensors), *tensors[0].shape], tensors[0].dtype
        expected = expected_local_shape(p.global_shape, p.src_mesh_info, p.src_placements,
                                        stage_local_rank)
        if expected is None:
            problems.append(f"{name}: {me} is not in the src mesh {p.src_mesh_info}")
        elif expected != shape:
            problems.append(f"{name}: {me} holds local shape {shape} but the refit info assigns "
                            f"{expected} (global {list(p.global_shape)}, placements {list(p.src_placements)})")
        elif str(dtype) != p.dtype:
            problems.append(f"{name}: {me} holds dtype {dtype} but the refit info says {p.dtype}")
        else:
            specs[name] = spec
    if problems:
        raise BadInputError("local views do not match the refit info:\n  - " + "\n  - ".join(problems))
    return specs


def stacked_spec(tensors: list[torch.Tensor]) -> LocalParamSpec:
    """``[E_local, ...]`` of the rank's experts: one strided view when they sit at a constant
    step in one storage (legacy grouped GEMM, contiguous param buffers), else the list of
    expert tensors itself, which the engine reads member by member (engine/members.py):
    no ``pre`` hook, no stacking buffer."""
    first = tensors[0]
    if len(tensors) == 1:
        return LocalParamSpec(base=first.unsqueeze(0))
    same_layout = all(
        t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
        for t in tensors
    )
    if same_layout:
        offsets = [t.storage_offset() for t in tensors]
        step = offsets[1] - offsets[0]
        if step > 0 and all(b - a == step for a, b in zip(offsets, offsets[1:])):
            view = first.as_strided((len(tensors), *first.shape), (step, *first.stride()), offsets[0])
            return LocalParamSpec(base=view)
    return LocalParamSpec(base=list(tensors))
