"""Whole-payload validation, run once where a payload enters (``wire.RefitPayload.from_plain``).

Torch + stdlib only. A payload crosses a process boundary as plain data, so anything can
arrive: a truncated message, a list where a map belongs, a mesh naming a rank outside the
refit group. ``validate_payload`` checks the structure of every entry and that every mesh
rank is where the payload's own sizes put it in a refit group (a stage's training ranks
``0..T-1``, the generation ranks ``T..T+G-1``; the receiver checks separately that its
groups have ``T + G`` ranks); each error is a ``RefitPayloadError`` that says "refit
payload", the entry and what was expected and found. It accepts the plain form and the
restored one (``MeshInfo``, placement objects).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megatron_reshard.errors import BadInputError
from megatron_reshard.wire.metadata import dtype_from_str


class RefitPayloadError(BadInputError):
    """The refit payload is malformed or does not fit this refit group."""


def _fail(where: str, what: str) -> RefitPayloadError:
    return RefitPayloadError(f"refit payload on {where}: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(payload: Mapping, key: str, where: str, default: Optional[int] = None) -> int:
    value = payload.get(key, default)
    if not _is_int(value) or value < 1:
        raise _fail(where, f"{key!r} must be an integer >= 1, found {value!r}")
    return value


def _mesh_ranks(mesh: Any, what: str, where: str) -> tuple[list[int], int]:
    """(ranks in row-major order, number of axes) of a plain or restored mesh."""
    if hasattr(mesh, "ranks") and hasattr(mesh, "ndim"):
        return list(mesh.ranks()), int(mesh.ndim)
    if not isinstance(mesh, Mapping) or "mesh" not in mesh:
        raise _fail(where, f"{what} must be a map with a 'mesh' list, found {mesh!r:.80}")
    ranks: list[int] = []

    def walk(node: Any, depth: int) -> tuple:
        if _is_int(node):
            ranks.append(node)
            return ()
        if not isinstance(node, list) or not node:
            raise _fail(where, f"{what}: a mesh is a non-empty nested list of ranks, found "
                               f"{node!r:.80}")
        shapes = {walk(child, depth + 1) for child in node}
        if len(shapes) != 1:
            raise _fail(where, f"{what}: the mesh is not rectangular")
        return (len(node), *shapes.pop())

    shape = walk(mesh["mesh"], 0)
    return ranks, max(1, len(shape))


def _check_mesh(ranks: list[int], what: str, where: str, lo: int, hi: int, side: str) -> None:
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise _fail(where, f"{what}: ranks {dup} appear more than once in {ranks}")
    bad = [r for r in ranks if r < 0]
    if bad:
        raise _fail(where, f"{what}: negative ranks {bad} in {ranks}")
    if any(not lo <= r < hi for r in ranks):
        raise _fail(where, f"{what}: the {side} ranks of this refit group are {lo}..{hi - 1}, "
                           f"found {[r for r in ranks if not lo <= r < hi]} in {ranks}")


def _shard_dim(placement: Any, what: str, where: str) -> Optional[int]:
    if isinstance(placement, Mapping):
        for key in ("dim", "padded"):
            if key in placement and not (_is_int(placement[key]) and placement[key] >= 0):
                raise _fail(where, f"{what}: a placement's {key!r} must be an integer >= 0, "
                                   f"found {placement[key]!r}")
        blocks = placement.get("blocks")
        if blocks is not None and not (isinstance(blocks, list) and blocks
                                       and all(_is_int(b) and b >= 0 for b in blocks)):
            raise _fail(where, f"{what}: a placement's 'blocks' must be a non-empty list of "
                               f"integers >= 0, found {blocks!r:.60}")
        return placement.get("dim")
    return getattr(placement, "dim", None)


def validate_payload(payload: Any, where: str = "this rank") -> None:
    """Raise ``RefitPayloadError`` on the first problem of ``payload`` (see module doc)."""
    if not isinstance(payload, Mapping):
        raise _fail(where, f"expected a map, found {type(payload).__name__}")
    for key in ("layer_names", "per_layer_params", "train_world_size", "gen_world_size",
                "gen_tp_size"):
        if key not in payload:
            raise _fail(where, f"missing key {key!r}")
    train_world = _positive(payload, "train_world_size", where)
    gen_world = _positive(payload, "gen_world_size", where)
    gen_tp = _positive(payload, "gen_tp_size", where)
    pp = _positive(payload, "pp_size", where, default=1)
    if train_world % pp:
        raise _fail(where, f"train_world_size {train_world} is not a multiple of pp_size {pp}")
    train_ranks = train_world // pp  # per stage group: training ranks first, then generation
    group_size = train_ranks + gen_world
    if gen_world % gen_tp:
        raise _fail(where, f"gen_world_size {gen_world} is not a multiple of gen_tp_size {gen_tp}")
    _check_hf_config(payload.get("hf_config", {}), where)
    layout = payload.get("gen_layout")
    if layout is not None and not isinstance(layout, Mapping):
        raise _fail(where, f"'gen_layout' must be a map, found {type(layout).__name__}")
    for key, value in (layout or {}).items():
        if value and not (_is_int(value) and value >= 1):
            raise _fail(where, f"gen_layout[{key!r}] must be an integer >= 1, found {value!r:.40}")
    layers = payload["layer_names"]
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise _fail(where, f"'layer_names' must be a list of strings, found {layers!r:.80}")
    per_layer = payload["per_layer_params"]
    if not isinstance(per_layer, Mapping):
        raise _fail(where, f"'per_layer_params' must be a map layer -> list of params, found "
                           f"{type(per_layer).__name__}")
    seen: set = set()
    for layer, params in per_layer.items():
        if not isinstance(params, list):
            raise _fail(where, f"per_layer_params[{layer!r}] must be a list, found "
                               f"{type(params).__name__}")
        for param in params:
            _check_param(param, f"per_layer_params[{layer!r}]", where, pp, seen,
                         group_size, train_ranks)
    other = payload.get("other_params", [])
    if isinstance(other, Mapping):
        entries = [dict(v, name=k) if isinstance(v, Mapping) else v for k, v in other.items()]
    else:
        entries = other
    if not isinstance(entries, list):
        raise _fail(where, f"'other_params' must be a list or a map, found {type(other).__name__}")
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise _fail(where, f"other_params entry {entry!r:.80} needs a 'name' string")
        what = f"other_params entry {entry['name']!r}"
        if entry["name"] in seen:
            raise _fail(where, f"{what} appears twice")
        seen.add(entry["name"])
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
            raise _fail(where, f"{what}: 'shape' must be a list of sizes >= 0, found {shape!r:.80}")
        _dtype(entry.get("dtype"), what, where)
        stage = entry.get("pp_stage", None if pp > 1 else 0)
        if not _is_int(stage) or not 0 <= stage < pp:
            raise _fail(where, f"{what}: pp_stage must be in 0..{pp - 1}, found {stage!r}")


# hf_config keys the receiver computes layouts from: sizes (int >= 0 or absent/None), flags
_HF_SIZES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "moe_intermediate_size", "num_experts", "num_hidden_layers",
             "vocab_size", "num_experts_per_tok", "shared_expert_intermediate_size")
_HF_FLAGS = ("tie_word_embeddings", "gated", "qk_norm", "attention_bias")


def _check_hf_config(cfg: Any, where: str) -> None:
    if cfg is None:
        return
    if not isinstance(cfg, Mapping):
        raise _fail(where, f"'hf_config' must be a map, found {type(cfg).__name__}")
    for key in _HF_SIZES:
        value = cfg.get(key)
        if value is not None and not (_is_int(value) and value >= 0):
            raise _fail(where, f"hf_config[{key!r}] must be an integer >= 0, found {value!r:.40}")
    for key in _HF_FLAGS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            raise _fail(where, f"hf_config[{key!r}] must be true or false, found {value!r:.40}")


def _dtype(value: Any, what: str, where: str) -> None:
    try:
        dtype_from_str(value)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise _fail(where, f"{what}: unknown dtype {value!r} ({exc})") from None


def _check_param(param: Any, what: str, where: str, pp: int, seen: set,
                 group_size: int, train_ranks: int) -> None:
    if not isinstance(param, Mapping) or not isinstance(param.get("name"), str):
        raise _fail(where, f"{what}: each param must be a map with a 'name', found {param!r:.80}")
    name = param["name"]
    what = f"param {name!r}"
    if name in seen:
        raise _fail(where, f"{what} appears twice")
    seen.add(name)
    for key in ("global_shape", "dtype", "src_mesh_info", "src_placements", "dst_mesh_info",
                "dst_placements"):
        if key not in param:
            raise _fail(where, f"{what}: missing key {key!r}")
    shape = param["global_shape"]
    if not isinstance(shape, (list, tuple)) or not all(_is_int(n) and n >= 0 for n in shape):
        raise _fail(where, f"{what}: global_shape must be a list of sizes >= 0, found {shape!r:.80}")
    _dtype(param["dtype"], what, where)
    stage = param.get("pp_stage", 0)
    if not _is_int(stage) or not 0 <= stage < pp:
        raise _fail(where, f"{what}: pp_stage must be in 0..{pp - 1}, found {stage!r}")
    for side, lo, hi in (("src", 0, train_ranks),
                         ("dst", train_ranks, group_size)):
        ranks, ndim = _mesh_ranks(param[f"{side}_mesh_info"], f"{what}: {side}_mesh_info", where)
        _check_mesh(ranks, f"{what}: {side}_mesh_info", where, lo, hi,
                    "training" if side == "src" else "generation")
        placements = param[f"{side}_placements"]
        if not isinstance(placements, (list, tuple)) or len(placements) != ndim:
            raise _fail(where, f"{what}: {side}_placements must be a list of {ndim} placements "
                               f"(one per mesh axis), found {placements!r:.80}")
        for pl in placements:
            dim = _shard_dim(pl, f"{what}: {side}_placements", where)
            if dim is not None and not 0 <= dim < len(shape):
                raise _fail(where, f"{what}: {side}_placements shard dim {dim} of a "
                                   f"{len(shape)}-D tensor")


__all__ = ["RefitPayloadError", "validate_payload"]
