"""The refit payload as frozen typed records, parsed once where a payload enters.

Torch + stdlib only (the receiver imports it). On the wire (msgpack, ``megatron/payload.py``)
the payload stays plain data: dicts, lists, strings, numbers. Everything in the library
past the point where a payload enters works on the records here instead:

- ``ParamRecord``: one bulk param of ``per_layer_params`` (name, global shape, wire dtype,
  the train (src) and generation (dst) meshes and placements, PP stage, FP8 decision);
- ``MiscRecord``: one param outside the bulk path (``other_params``);
- ``RefitPayload``: the whole payload (or the train side's refit info before the payload
  extras are added): sizes, layer order, records, and the extras carried as plain data.

Where a payload enters: ``RefitPayload.from_plain(payload, where)`` on a generation rank
(whole-payload validation, ``wire.check``, then the schema version, then the records);
``RefitPayload.of(info)`` where the library trusts its input (the train side's own refit
info, tests): the same parse without the refit-group checks. Records are frozen: a step
that changes entries (FP8 planning, live train meshes) makes new ones with
``dataclasses.replace``, so nobody holds a payload that changed under them.

The seed's dict form (``metadata.build_nccl_reshard_refit_info`` /
``restore_refit_info_placements``) is read here and written by ``to_refit_info``; both
directions go through ``metadata``'s seed functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError, BadInputTypeError
from megatron_reshard.layout.placements import MeshInfo, placements_to_plain, restore_placement
from megatron_reshard.wire.metadata import (
    SUPPORTED_SCHEMA_VERSIONS,
    _restore_mesh,
    dtype_from_str,
    restore_refit_info_placements,
)
from megatron_reshard.wire.check import validate_payload

SIDES = ("src", "dst")
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value)


def _frozen(value: Any) -> Any:
    """A read-only view of plain data (maps become mappingproxies; lists stay lists)."""
    return MappingProxyType(dict(value)) if isinstance(value, Mapping) else value


def _thawed(value: Any) -> Any:
    """Plain data back from ``_frozen`` (deep: the wire takes dicts and lists only)."""
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thawed(v) for v in value]
    return value


# per-param keys with a field of their own; any other key is kept in ``extra`` as it came
_PARAM_OPTIONAL = ("pp_stage", "gen_quant", "wire_weight_dtype", "scale_of", "weight_shape",
                   "grouped_expert_proj")
_PARAM_KEYS = ("name", "global_shape", "dtype", "src_mesh_info", "src_placements",
               "dst_mesh_info", "dst_placements") + _PARAM_OPTIONAL


@dataclass(frozen=True)
class ParamRecord:
    """One bulk param: what both sides derive the transfer of it from.

    ``dtype`` is the wire dtype string (``"torch.bfloat16"``; ``torch_dtype`` the dtype).
    ``pp_stage`` None: the entry had none (PP 1; ``stage`` is then 0). ``gen_quant`` (FP8
    generation, ``fp8.plan``): ``"sender"``, ``"train_fp8"``, ``"receiver"`` or ``"scale"``
    (a block-scale entry: ``scale_of`` names its weight, ``weight_shape`` the weight's
    shape); ``wire_weight_dtype``: the dtype a sender-quantized weight is quantized from.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    src_mesh_info: MeshInfo
    src_placements: tuple
    dst_mesh_info: MeshInfo
    dst_placements: tuple
    pp_stage: Optional[int] = None
    gen_quant: Optional[str] = None
    wire_weight_dtype: Optional[str] = None
    scale_of: Optional[str] = None
    weight_shape: Optional[tuple[int, ...]] = None
    grouped_expert_proj: Optional[str] = None
    extra: tuple[tuple[str, Any], ...] = ()  # keys beyond these, kept for the round trip

    @property
    def stage(self) -> int:
        return 0 if self.pp_stage is None else int(self.pp_stage)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)

    def mesh(self, side: str) -> MeshInfo:
        return self.src_mesh_info if side == "src" else self.dst_mesh_info

    def placements(self, side: str) -> tuple:
        return self.src_placements if side == "src" else self.dst_placements

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> "ParamRecord":
        """A record from a payload entry in wire form or the seed's restored form."""
        optional = {k: entry[k] for k in _PARAM_OPTIONAL if entry.get(k) is not None}
        if "pp_stage" in optional:
            optional["pp_stage"] = int(optional["pp_stage"])
        if "weight_shape" in optional:
            optional["weight_shape"] = _shape(optional["weight_shape"])
        return cls(
            name=entry["name"], global_shape=_shape(entry["global_shape"]),
            dtype=str(entry["dtype"]),
            src_mesh_info=_restore_mesh(entry["src_mesh_info"]),
            src_placements=tuple(restore_placement(p) for p in entry["src_placements"]),
            dst_mesh_info=_restore_mesh(entry["dst_mesh_info"]),
            dst_placements=tuple(restore_placement(p) for p in entry["dst_placements"]),
            extra=tuple((k, _frozen(v)) for k, v in entry.items() if k not in _PARAM_KEYS),
            **optional)

    def to_plain(self) -> dict[str, Any]:
        """The wire form of the entry (plain data only)."""
        out: dict[str, Any] = {
            "name": self.name, "global_shape": list(self.global_shape), "dtype": self.dtype,
            "src_mesh_info": {"mesh": self.src_mesh_info.mesh.tolist()},
            "src_placements": placements_to_plain(self.src_placements),
            "dst_mesh_info": {"mesh": self.dst_mesh_info.mesh.tolist()},
            "dst_placements": placements_to_plain(self.dst_placements),
        }
        for key in _PARAM_OPTIONAL:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        out.update((k, _thawed(v)) for k, v in self.extra)
        return out


@dataclass(frozen=True)
class MiscRecord:
    """One param outside the bulk path (payload ``other_params``): a packed broadcast moves it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pp_stage: Optional[int] = None

    def to_plain(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.pp_stage is not None:
            out["pp_stage"] = self.pp_stage
        return out


def _misc_records(other: Any, pp_size: int) -> tuple[MiscRecord, ...]:
    """``other_params`` as records: a list of ``{"name", "shape", "dtype", "pp_stage"}`` (the
    train side's form) or a map ``{name: {"shape", "dtype", "pp_stage"}}``. ``pp_stage`` is
    required when ``pp_size`` is above 1 (no stage is guessed for a param)."""
    other = other or []
    entries = ([(name, entry) for name, entry in other.items()] if isinstance(other, Mapping)
               else [(entry.get("name"), entry) for entry in other])
    out, seen = [], set()
    for name, entry in entries:
        if not isinstance(name, str) or name in seen:
            raise BadInputError(f"other_params: entry {entry!r} has a missing or repeated name")
        seen.add(name)
        stage = entry.get("pp_stage")
        if stage is None and pp_size > 1:
            raise BadInputError(f"other_params[{name!r}] has no 'pp_stage' but the payload has "
                             f"pp_size={pp_size}")
        if stage is not None and not 0 <= int(stage) < pp_size:
            raise BadInputError(f"other_params[{name!r}]: pp_stage={stage} is not in 0..{pp_size - 1}")
        dtype_from_str(entry["dtype"])  # an unknown dtype is refused here, not mid-refit
        out.append(MiscRecord(name, _shape(entry["shape"]), str(entry["dtype"]),
                              None if stage is None else int(stage)))
    return tuple(out)


# payload keys with a field of their own; the rest (train_layout, train_stage_ranks,
# rank_order, ...) travel in ``extra`` as plain data
_PAYLOAD_KEYS = ("layer_names", "per_layer_params", "train_world_size", "gen_world_size",
                 "pp_size", "gen_tp_size", "schema_version", "gen_quant", "hf_config",
                 "gen_layout", "other_params")


@dataclass(frozen=True)
class RefitPayload:
    """The whole payload as records (see module docstring).

    ``per_layer_params``: layer key -> its records, read-only, in the order the entries
    came; ``layer_names`` gives the transfer order. ``other_params`` None: the key was
    absent. Sizes a bare refit info lacks (tests build such) are None.
    """

    layer_names: tuple[str, ...]
    per_layer_params: Mapping[str, tuple[ParamRecord, ...]]
    train_world_size: Optional[int] = None
    gen_world_size: Optional[int] = None
    pp_size: int = 1
    gen_tp_size: Optional[int] = None
    schema_version: Optional[int] = None
    gen_quant: Optional[Mapping[str, Any]] = None  # {"format", "block"} of an FP8 generation
    hf_config: Optional[Mapping[str, Any]] = None
    gen_layout: Optional[Mapping[str, Any]] = None
    other_params: Optional[tuple[MiscRecord, ...]] = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)

    # -- entering ------------------------------------------------------------------

    @classmethod
    def of(cls, info: Any) -> "RefitPayload":
        """``info`` itself if already records, else parsed from its wire or seed dict form
        (no refit-group checks: for input the library built itself)."""
        if isinstance(info, cls):
            return info
        if not isinstance(info, Mapping):
            raise BadInputTypeError(f"refit info is a {type(info).__name__}, expected a map")
        pp = int(info.get("pp_size", 1))
        per_layer = info.get("per_layer_params", {})
        listed = list(info.get("layer_names", []))
        unlisted = [layer for layer, ps in per_layer.items() if ps and layer not in set(listed)]
        if unlisted:
            raise BadInputError(f"refit payload: per_layer_params has layers missing from "
                             f"layer_names: {unlisted}")
        records = {layer: tuple(ParamRecord.from_entry(p) for p in ps)
                   for layer, ps in per_layer.items()}

        def size(key: str) -> Optional[int]:
            return None if info.get(key) is None else int(info[key])

        return cls(
            layer_names=tuple(listed), per_layer_params=MappingProxyType(records),
            train_world_size=size("train_world_size"), gen_world_size=size("gen_world_size"),
            pp_size=pp, gen_tp_size=size("gen_tp_size"),
            schema_version=info.get("schema_version"),
            gen_quant=None if info.get("gen_quant") is None else _frozen(info["gen_quant"]),
            hf_config=None if info.get("hf_config") is None else _frozen(info["hf_config"]),
            gen_layout=None if info.get("gen_layout") is None else _frozen(info["gen_layout"]),
            other_params=(None if "other_params" not in info
                          else _misc_records(info["other_params"], pp)),
            extra=MappingProxyType({k: v for k, v in info.items() if k not in _PAYLOAD_KEYS}))

    @classmethod
    def from_plain(cls, payload: Any, where: str = "this rank") -> "RefitPayload":
        """A payload received by a generation rank: the whole payload checked against the
        refit group (``wire.check.validate_payload``, ``RefitPayloadError``), its schema
        version checked, then parsed. The input is not changed."""
        validate_payload(payload, where)
        version = payload.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise BadInputError(f"refit payload on {where}: unsupported schema_version {version!r} "
                             f"(this receiver reads {list(SUPPORTED_SCHEMA_VERSIONS)})")
        return cls.of(payload)

    # -- reading -------------------------------------------------------------------

    def params(self) -> Iterator[ParamRecord]:
        """Every bulk record in transfer order (``layer_names``, then each layer's order)."""
        for layer in self.layer_names:
            yield from self.per_layer_params.get(layer, ())

    def stage_params(self) -> dict[int, list[ParamRecord]]:
        """Bulk records grouped by PP stage, in transfer order."""
        out: dict[int, list[ParamRecord]] = {}
        for p in self.params():
            out.setdefault(p.stage, []).append(p)
        return out

    # -- changing (new records) ----------------------------------------------------

    def with_params(self, layer_names: Sequence[str],
                    per_layer_params: Mapping[str, Sequence[ParamRecord]],
                    **changes: Any) -> "RefitPayload":
        """A copy with new layer order and records (and any other field in ``changes``)."""
        return dataclasses.replace(
            self, layer_names=tuple(layer_names),
            per_layer_params=MappingProxyType({k: tuple(v) for k, v in per_layer_params.items()}),
            **changes)

    def map_params(self, fn) -> "RefitPayload":
        """A copy with ``fn(record)`` in place of every bulk record."""
        return self.with_params(self.layer_names, {layer: [fn(p) for p in ps]
                                                   for layer, ps in self.per_layer_params.items()})

    # -- leaving -------------------------------------------------------------------

    def to_plain(self) -> dict[str, Any]:
        """The wire form: plain data only, the keys that were present."""
        out: dict[str, Any] = {
            "layer_names": list(self.layer_names),
            "per_layer_params": {layer: [p.to_plain() for p in ps]
                                 for layer, ps in self.per_layer_params.items()},
        }
        for key in ("train_world_size", "gen_world_size"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["pp_size"] = self.pp_size
        if self.gen_tp_size is not None:
            out["gen_tp_size"] = self.gen_tp_size
        if self.gen_quant is not None:
            out["gen_quant"] = _thawed(self.gen_quant)
        if self.schema_version is not None:
            out["schema_version"] = self.schema_version
        for key, value in self.extra.items():
            out[key] = _thawed(value)
        if self.gen_layout is not None:
            out["gen_layout"] = _thawed(self.gen_layout)
        if self.hf_config is not None:
            out["hf_config"] = _thawed(self.hf_config)
        if self.other_params is not None:
            out["other_params"] = [m.to_plain() for m in self.other_params]
        return out

    def to_refit_info(self) -> dict[str, Any]:
        """The seed's dict form (meshes and placements restored; for callers of the
        NeMo-RL-compatible API and of ``MegatronRefitSource.refit_info``)."""
        return restore_refit_info_placements(self.to_plain())


__all__ = ["MiscRecord", "ParamRecord", "RefitPayload", "SIDES"]
