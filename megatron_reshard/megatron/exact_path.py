"""Train and generation layouts of the params the source moves shard to shard beyond the
seed's bulk set (the "exact extras"): vocab matrices as padded shards, q/k/v per KV group,
MLA params, and the direct params of ``vllm_layout.dense.TP_DIM_RULES``; gated q/k/v
(the attention output gate) per KV group too, q in ``qwen3_next.gated_q_group_shape``.

No Megatron import: it works on the refit info, the live stage meshes and ``ModelDims``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.placements import MeshInfo, PaddedShard
from megatron_reshard.megatron.converters import ModelDims
from megatron_reshard.megatron.parallel import StageMeshes
from megatron_reshard.megatron.qwen3_next import gated_q_group_shape
from megatron_reshard.megatron.qkv import heads_of, megatron_qkv_layout, qkv_group_shape, which_qkv
from megatron_reshard.vllm_layout import gpt_oss
from megatron_reshard.wire.metadata import extract_layer_name
from megatron_reshard.vllm_layout.dense import QKV_PARAM_RE, padded_vocab_rows, qkv_gen_layout, tp_dim_of
from megatron_reshard.wire.records import ParamRecord, RefitPayload

VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight", "backbone.embeddings.weight")  # last: Nemotron-H


def _tp_placements(mesh: MeshInfo, dims: dict, tp_dim) -> list:
    placements: list = [Replicate() for _ in range(mesh.ndim)]
    if tp_dim is not None and "tp" in dims:
        placements[dims["tp"]] = Shard(tp_dim)
    return placements


def _ep_placements(mesh: MeshInfo, dims: dict) -> list:
    """Megatron's experts (dim 0 of an ``[E, ...]`` tensor) in contiguous blocks over EP."""
    placements: list = [Replicate() for _ in range(mesh.ndim)]
    if "ep" in dims:
        placements[dims["ep"]] = Shard(0)
    return placements


def _padded_layout(mesh: MeshInfo, tp_axis: Optional[int], padded: int) -> tuple[MeshInfo, list]:
    """Mesh and placements of a vocab matrix padded to ``padded`` rows split over ``tp_axis``
    (without a TP axis, a size-1 axis is added so the whole padded vocab is one shard)."""
    if tp_axis is None:
        mesh, tp_axis = MeshInfo(mesh.mesh.unsqueeze(-1)), mesh.ndim
    placements: list = [Replicate() for _ in range(mesh.ndim)]
    placements[tp_axis] = PaddedShard(0, padded)
    return mesh, placements


def add_exact_extras(info: RefitPayload, extras: Mapping[str, dict], stage_of_key: Mapping[str, int],
                     stages: Sequence[StageMeshes], gen: tuple[MeshInfo, dict], *,
                     padded_train_vocab: int, dims: ModelDims, pp: int,
                     mla_tp_dims: Callable[[str], Optional[tuple[Optional[int], Optional[int]]]],
                     gen_expert: Optional[tuple[MeshInfo, dict]] = None) -> RefitPayload:
    """The refit info with the params beyond the seed's bulk set that the engine moves too
    appended (``extras``: name -> HF metadata, model order; the input is not changed).

    Vocab matrices: padded shards on both sides (Megatron's padded vocab split over TP;
    vLLM's vocab padded to 64 split over gen TP). q/k/v weights: per KV group
    (``qkv_gen_layout``). MLA params: the TP dims ``mla_tp_dims`` gives. Direct params
    (``tp_dim_of``): the same TP dim on both sides, or replicated. gpt-oss's experts in
    vLLM's wire form: the stage's live expert mesh (whole experts over EP) to vLLM's
    (``gen_expert`` with EP, else ``gen``; ``vllm_layout.gpt_oss.gen_placements``). Train
    meshes are the stage's live dense mesh (``stages``), gen ones ``gen`` (mesh, dims);
    embeddings go first in ``layer_names``, new layer keys after the rest.
    """
    gen_mesh, gen_dims = gen
    layer_names = list(info.layer_names)
    per_layer = {layer: list(ps) for layer, ps in info.per_layer_params.items()}
    for name, meta in extras.items():
        key = extract_layer_name(name)
        stage = stage_of_key[key]
        meshes = stages[stage]
        global_shape = tuple(meta["shape"])
        oss = gpt_oss.WIRE_RE.match(name)
        if oss:
            src_mesh, src_pl = meshes.expert, _ep_placements(meshes.expert, meshes.expert_dims)
            dst_mesh, dst_dims = gen_expert or gen
            dst_pl = gpt_oss.gen_placements(oss["leaf"], global_shape, dst_mesh.shape, dst_dims)
        elif name in VOCAB_PARAMS:
            vocab = int(meta["shape"][0])
            src_mesh, src_pl = _padded_layout(meshes.dense, meshes.dense_dims.get("tp"), padded_train_vocab)
            dst_mesh, dst_pl = _padded_layout(gen_mesh, gen_dims.get("tp"),
                                              padded_vocab_rows(vocab))
        elif mla_tp_dims(name) is not None:
            src_dim, dst_dim = mla_tp_dims(name)
            src_mesh, src_pl = meshes.dense, _tp_placements(meshes.dense, meshes.dense_dims, src_dim)
            dst_mesh, dst_pl = gen_mesh, _tp_placements(gen_mesh, gen_dims, dst_dim)
        elif QKV_PARAM_RE.search(name):
            which = which_qkv(name)
            if which == "q" and meta["shape"][0] == 2 * dims.num_attention_heads * dims.head_dim:
                # the attention output gate: q_proj rows [q_h; gate_h] per head (qwen3_next)
                global_shape = gated_q_group_shape(dims.num_query_groups, dims.head_dim, meta["shape"])
            else:
                global_shape = qkv_group_shape(dims.num_query_groups, meta["shape"])
            src_mesh, src_pl = megatron_qkv_layout(meshes.dense, meshes.dense_dims,
                                                    heads_of(dims), which)
            dst_mesh, dst_pl = qkv_gen_layout(gen_mesh, gen_dims, dims.num_query_groups,
                                              which)
        else:
            tp_dim = tp_dim_of(name)
            src_mesh, src_pl = meshes.dense, _tp_placements(meshes.dense, meshes.dense_dims, tp_dim)
            dst_mesh, dst_pl = gen_mesh, _tp_placements(gen_mesh, gen_dims, tp_dim)
        record = ParamRecord(name=name, global_shape=tuple(int(s) for s in global_shape),
                             dtype=str(meta["dtype"]), src_mesh_info=src_mesh,
                             src_placements=tuple(src_pl), dst_mesh_info=dst_mesh,
                             dst_placements=tuple(dst_pl), pp_stage=stage if pp > 1 else None)
        per_layer.setdefault(key, []).append(record)
        if key not in layer_names:
            if name.startswith(("model.embed_tokens", "backbone.embeddings")):
                layer_names.insert(0, key)
            else:
                layer_names.append(key)
    return info.with_params(layer_names, per_layer)
