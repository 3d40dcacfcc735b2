"""Refit metadata: expert grouping, layer keys, the per-layer refit info and its wire form.

Torch + stdlib only (the receiver imports this module).

Decisions this module takes (the rest of the contract is in docs/DESIGN.md: "Refit groups
and rank numbering", "What takes the exact path, and what does not", and "Layer order and
PP stages" under "Decisions taken while building"):

- ``build_nccl_reshard_refit_info`` describes exactly the params it is given. Callers pass
  only bulk params (filter with ``is_nccl_reshard_param``); anything else given to it is
  described with the same placement rules (replicated unless a TP/EP rule applies).
- ``layer_names`` is in first-appearance order of the layer keys in the *input*
  ``state_dict_metadata`` (before expert grouping), so it is stable for a given input.
  Within a layer, params follow the grouped metadata's order (pass-through entries, then
  grouped experts).
- A param outside ``layers.N`` (embeddings, final norm, lm_head) is filed under its
  ``extract_layer_name`` key, e.g. ``model.embed_tokens`` or ``lm_head``.
- With training PP > 1, every layer key of the given params, non-layer keys included, must
  be in ``layer_to_pp_stage``; there is no implicit rule (the train side knows from the
  model where embeddings and the output layer live). A missing key is a ``KeyError``
  naming it. With PP == 1 the map is not needed and params carry no ``pp_stage``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.errors import BadInputError, BadInputTypeError, MissingEntryError
from megatron_reshard.vllm_layout.moe import expert_gen_placement
from megatron_reshard.layout.placements import (
    BlockShard,
    MeshInfo,
    PaddedShard,
    build_mesh_info,
    placements_to_plain,
    restore_placement,
)
from megatron_reshard.wire.expert_names import PER_EXPERT_RE
from megatron_reshard.wire.placement_rules import get_placements, is_expert_param

# The refit payload's schema version, the one statement of it: the train side writes it
# (wire.codec.build_payload), the receiver checks it once (wire.check.check_schema, run by
# wire.RefitPayload.from_plain). Here because both sides import this torch-only module.
SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (SCHEMA_VERSION,)  # what the receiver reads

# dtype strings as they appear in metadata ("torch.bfloat16" or "bfloat16") -> torch dtype.
_DTYPE_NAMES = (
    "float64", "double", "float32", "float", "float16", "half", "bfloat16",
    "complex64", "complex128",
    "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)
# Built once at import from the names above (the ones this torch build has), never added to
# afterwards: a constant table of the process's torch, so process lifetime is right and its
# size is fixed (two spellings per name)
_STR_TO_DTYPE: dict[str, torch.dtype] = {}
for _name in _DTYPE_NAMES:
    _dtype = getattr(torch, _name, None)
    if isinstance(_dtype, torch.dtype):
        _STR_TO_DTYPE[_name] = _dtype
        _STR_TO_DTYPE[f"torch.{_name}"] = _dtype
del _name, _dtype

# Pre-grouped exports: <P>.experts.gate_up_proj [E, 2I, H] and <P>.experts.down_proj [E, H, I].
_PREGROUPED_EXPERT_RE = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<proj>gate_up_proj|down_proj)$")
# "<prefix>.layers.<N>" or a bare "layers.<N>"; ``layers`` must be a whole dotted component.
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*?\.)??)layers\.(?P<index>\d+)(?=\.|$)")
# Non-layer params under model.<word>. / backbone.<word>. (embeddings, final norm).
_MODEL_PREFIX_RE = re.compile(r"^(?P<prefix>(?:model|backbone)\.[^.]+)\.")

_GROUPED_TAG = "grouped_expert_proj"


def dtype_from_str(dtype: Any) -> torch.dtype:
    """A torch dtype from ``"torch.bfloat16"`` / ``"bfloat16"`` / a dtype; ValueError if unknown."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _STR_TO_DTYPE[dtype]
    except (KeyError, TypeError):
        raise BadInputError(
            f"unknown dtype {dtype!r}: expected one of {sorted(k for k in _STR_TO_DTYPE if k.startswith('torch.'))}"
        ) from None


def group_expert_params_in_metadata(
    state_dict_metadata: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Replace per-expert (and pre-grouped) MoE entries by one grouped entry per projection.

    ``<P>.experts.<i>.<proj>.weight`` entries become ``<P>.experts.<proj>.weight`` of shape
    ``[E, *per_expert_shape]``; ``<P>.experts.gate_up_proj [E, 2I, H]`` becomes
    ``gate_proj.weight`` and ``up_proj.weight`` of ``[E, I, H]``; ``<P>.experts.down_proj``
    becomes ``down_proj.weight``. Grouped entries carry ``grouped_expert_proj`` and follow
    the pass-through entries. With no expert entry the input object is returned as is.
    """
    passthrough: dict[str, dict[str, Any]] = {}
    # (prefix, proj) -> {expert index: (name, entry)}, in first-appearance order.
    per_expert: "OrderedDict[tuple[str, str], dict[int, tuple[str, dict]]]" = OrderedDict()
    grouped: dict[str, dict[str, Any]] = {}

    def add_grouped(name: str, entry: dict[str, Any], source: str) -> None:
        if name in grouped:
            raise BadInputError(f"grouped expert entry {name!r} produced twice (second time from {source!r})")
        grouped[name] = entry

    for name, meta in state_dict_metadata.items():
        m = PER_EXPERT_RE.match(name)
        if m:
            key = (m["prefix"], m["proj"])
            per_expert.setdefault(key, {})[int(m["index"])] = (name, meta)
            continue
        m = _PREGROUPED_EXPERT_RE.match(name)
        if m:
            prefix, shape = m["prefix"], list(meta["shape"])
            if m["proj"] == "down_proj":
                add_grouped(f"{prefix}.down_proj.weight", {**meta, "shape": shape, _GROUPED_TAG: "down_proj"}, name)
                continue
            if len(shape) != 3 or shape[1] % 2:
                raise BadInputError(
                    f"{name}: pre-grouped gate_up_proj must be [E, 2*I, H] with an even middle dim, got {shape}"
                )
            half = [shape[0], shape[1] // 2, shape[2]]
            for proj in ("gate_proj", "up_proj"):
                add_grouped(f"{prefix}.{proj}.weight", {**meta, "shape": list(half), _GROUPED_TAG: proj}, name)
            continue
        passthrough[name] = meta

    if not per_expert and not grouped:
        return state_dict_metadata

    for (prefix, proj), experts in per_expert.items():
        indices = sorted(experts)
        if indices != list(range(len(indices))):
            missing = sorted(set(range(indices[-1] + 1)) - set(indices))
            raise BadInputError(f"{prefix}.<i>.{proj}.weight: experts {missing} are missing (have {indices})")
        first_name, first = experts[0]
        shape, dtype = list(first["shape"]), first.get("dtype")
        for idx in indices:
            name, meta = experts[idx]
            if list(meta["shape"]) != shape or meta.get("dtype") != dtype:
                raise BadInputError(
                    f"{name}: every expert of {prefix}.<i>.{proj}.weight must match {first_name} "
                    f"(shape {shape}, dtype {dtype}); got shape {list(meta['shape'])}, dtype {meta.get('dtype')}"
                )
        add_grouped(
            f"{prefix}.{proj}.weight",
            {**first, "shape": [len(indices), *shape], _GROUPED_TAG: proj},
            first_name,
        )

    clash = sorted(set(grouped) & set(passthrough))
    if clash:
        raise BadInputError(f"grouped expert entries clash with existing params: {clash}")
    return {**passthrough, **grouped}


def _extract_layer_prefix(param_name: str) -> Optional[str]:
    """Module path before ``layers.N`` ("" for a bare ``layers.N``), None without ``layers.N``."""
    m = _LAYER_RE.match(param_name)
    if m is None:
        return None
    return m["prefix"][:-1] if m["prefix"] else ""


def extract_layer_name(param_name: str) -> str:
    """Per-layer group key: ``<prefix>.layers.<N>``, else ``model.<word>`` / ``backbone.<word>``,
    else the first dotted component (``lm_head``)."""
    m = _LAYER_RE.match(param_name)
    if m is not None:
        return f"{m['prefix']}layers.{m['index']}"
    m = _MODEL_PREFIX_RE.match(param_name)
    if m is not None:
        return m["prefix"]
    return param_name.split(".", 1)[0]


def _parallel_size(parallelism: dict[str, int], key: str, side: str) -> int:
    value = parallelism.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"{side}_parallelism[{key!r}] must be a positive int, got {value!r}")
    return value


def build_nccl_reshard_refit_info(
    state_dict_metadata: dict[str, dict[str, Any]],
    train_parallelism: dict[str, int],
    gen_parallelism: dict[str, int],
    train_world_size: int,
    gen_world_size: int,
    layer_to_pp_stage: Optional[dict[str, int]] = None,
) -> dict[str, Any]:
    """Per-layer refit info for the given params (global view) on train and gen meshes.

    Group ranks: the training ranks of one PP stage first (stage-local ``0..T/pp-1``), then
    the generation ranks. Grouped experts on a generation EP axis take vLLM's expert blocks
    (``vllm_layout.moe.expert_gen_placement``: ``Shard(0)`` when they split evenly). Train params use a non-expert mesh (tp) or an expert mesh (ep);
    generation params a non-expert mesh (gen tp) or, with gen ep > 1, an expert mesh.
    """
    for what, size in (("train_world_size", train_world_size), ("gen_world_size", gen_world_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise BadInputError(f"{what} must be a positive int, got {size!r}")
    tp = _parallel_size(train_parallelism, "tp_size", "train")
    ep = _parallel_size(train_parallelism, "ep_size", "train")
    pp = _parallel_size(train_parallelism, "pp_size", "train")
    gen_tp = _parallel_size(gen_parallelism, "tp_size", "gen")
    gen_ep = _parallel_size(gen_parallelism, "ep_size", "gen")
    gen_pp = _parallel_size(gen_parallelism, "pp_size", "gen")
    if gen_pp != 1:
        raise BadInputError(f"gen_parallelism['pp_size'] must be 1 (generation pipeline parallelism is not supported), got {gen_pp}")
    if train_world_size % pp:
        raise BadInputError(f"train_world_size={train_world_size} is not divisible by train pp_size={pp}")
    stage_world = train_world_size // pp

    def sized(fn, what):
        try:
            return fn()
        except ValueError as err:
            raise BadInputError(f"{what}: {err}") from None

    src_dense, src_dense_map = sized(lambda: build_mesh_info(stage_world, 0, tp_size=tp), "train non-expert mesh")
    src_expert, src_expert_map = sized(lambda: build_mesh_info(stage_world, 0, ep_size=ep), "train expert mesh")
    dst_dense, dst_dense_map = sized(
        lambda: build_mesh_info(gen_world_size, stage_world, tp_size=gen_tp), "gen non-expert mesh"
    )
    if gen_ep > 1:
        dst_expert, dst_expert_map = sized(
            lambda: build_mesh_info(gen_world_size, stage_world, ep_size=gen_ep), "gen expert mesh"
        )
    else:
        dst_expert, dst_expert_map = dst_dense, dst_dense_map

    if pp > 1:
        if layer_to_pp_stage is None:
            raise BadInputError(f"train pp_size={pp} > 1 needs layer_to_pp_stage (layer name -> PP stage)")
        for layer, stage in layer_to_pp_stage.items():
            if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
                raise BadInputError(f"layer_to_pp_stage[{layer!r}] = {stage!r} is not a stage in 0..{pp - 1}")

    layer_names: list[str] = []
    for name in state_dict_metadata:
        layer = extract_layer_name(name)
        if layer not in layer_names:
            layer_names.append(layer)
    per_layer_params: dict[str, list[dict[str, Any]]] = {layer: [] for layer in layer_names}

    for name, meta in group_expert_params_in_metadata(state_dict_metadata).items():
        layer = extract_layer_name(name)
        shape = tuple(int(s) for s in meta["shape"])
        try:
            dtype = str(dtype_from_str(meta["dtype"]))
        except ValueError as err:
            raise BadInputError(f"{name}: {err}") from None
        expert = is_expert_param(name)
        src_mesh, src_map = (src_expert, src_expert_map) if expert else (src_dense, src_dense_map)
        dst_mesh, dst_map = (dst_expert, dst_expert_map) if expert else (dst_dense, dst_dense_map)
        info: dict[str, Any] = {
            "name": name,
            "global_shape": shape,
            "dtype": dtype,
            "src_mesh_info": src_mesh,
            "src_placements": get_placements(name, src_map, len(shape)),
            "dst_mesh_info": dst_mesh,
            "dst_placements": get_placements(name, dst_map, len(shape)),
        }
        if expert and gen_ep > 1 and len(shape) == 3:
            # vLLM's expert blocks, which torch.chunk rules miss when E % ep != 0
            info["dst_placements"][dst_map["ep"]] = expert_gen_placement(shape[0], gen_ep)
        if pp > 1:
            if layer not in layer_to_pp_stage:
                raise MissingEntryError(
                    f"layer {layer!r} (param {name!r}) is missing from layer_to_pp_stage; "
                    f"every layer key of the given params needs a PP stage"
                )
            info["pp_stage"] = layer_to_pp_stage[layer]
        if _GROUPED_TAG in meta:
            info[_GROUPED_TAG] = meta[_GROUPED_TAG]
        per_layer_params.setdefault(layer, []).append(info)
        if layer not in layer_names:  # only reachable if grouping renamed a layer; keep it listed
            layer_names.append(layer)

    return {
        "layer_names": layer_names,
        "per_layer_params": per_layer_params,
        "train_world_size": train_world_size,
        "gen_world_size": gen_world_size,
        "pp_size": pp,
        "gen_tp_size": gen_tp,
    }


def _to_wire(value: Any, path: str) -> Any:
    if isinstance(value, MeshInfo):
        return {"mesh": value.mesh.tolist()}
    if isinstance(value, (Shard, Replicate, PaddedShard, BlockShard)):
        return placements_to_plain([value])[0]
    if isinstance(value, dict):
        return {k: _to_wire(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # torch.Size is a tuple
        return [_to_wire(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise BadInputTypeError(f"refit_info{path}: {type(value).__name__} cannot go on the wire (plain data only)")


def make_nccl_reshard_refit_info_wire_safe(refit_info: dict) -> dict:
    """A plain-data copy: meshes → ``{"mesh": nested list}``, placements → ``{"dim": d}`` / ``{}``,
    tuples → lists. The input is not modified; anything not plain data is a TypeError."""
    return _to_wire(refit_info, "")


def _restore_mesh(mesh: Any) -> Any:
    if isinstance(mesh, MeshInfo):
        return mesh
    if isinstance(mesh, dict) and "mesh" in mesh:
        return MeshInfo(torch.tensor(mesh["mesh"], dtype=torch.int64))
    if isinstance(mesh, dict) and "_mesh" in mesh:
        return MeshInfo(torch.tensor(mesh["_mesh"], dtype=torch.int64))
    raise BadInputTypeError(f"cannot restore a mesh from {mesh!r}: expected MeshInfo or {{'mesh': nested list}}")


def restore_refit_info_placements(refit_info: dict) -> dict:
    """Turn wire-form meshes/placements back into ``MeshInfo`` / ``Shard`` / ``Replicate`` in place.

    Also makes ``global_shape`` a tuple again. Idempotent; returns ``refit_info``.
    """
    for params in refit_info.get("per_layer_params", {}).values():
        for info in params:
            for key in ("src_mesh_info", "dst_mesh_info"):
                if key in info:
                    info[key] = _restore_mesh(info[key])
            for key in ("src_placements", "dst_placements"):
                if key in info:
                    info[key] = [restore_placement(p) for p in info[key]]
            if "global_shape" in info:
                info["global_shape"] = tuple(int(s) for s in info["global_shape"])
    return refit_info
