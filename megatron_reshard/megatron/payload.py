"""The wire payload the train side hands to the generation side, and its msgpack codec.

Plain data only (the receiver decodes it in a process without Megatron; this module
imports msgspec, torch and ``megatron_reshard.wire.metadata`` — never ``megatron``).

Schema version 1 — a dict holding ``build_nccl_reshard_refit_info``'s keys in wire-safe
form (``layer_names``, ``per_layer_params``, ``train_world_size``, ``gen_world_size``,
``pp_size``, ``gen_tp_size``; meshes ``{"mesh": nested list}``, placements ``{"dim": d}`` /
``{}``; ``restore_refit_info_placements`` turns them back) plus:

- ``schema_version``: 1 (``wire.metadata.SCHEMA_VERSION``)
- ``train_layout``: ``{tp, pp, ep, etp, dp, cp, world_size}`` read from ``parallel_state``
- ``gen_layout``: ``{tp, ep, pp, world_size}``
- ``hf_config``: see ``megatron_reshard.megatron.source.HF_CONFIG_KEYS``
- ``other_params``: ``[{name, shape, dtype, pp_stage}]`` — every HF param outside the bulk
  path, in the order the misc path packs them (per stage, model order)
- ``train_stage_ranks``: per PP stage, the global train ranks in stage-local order (the
  refit group's train ranks ``0..T/pp-1`` are these)
- ``rank_order``: the Megatron rank order found (e.g. ``"tp-dp-pp"``), informational
"""

from __future__ import annotations

from typing import Any

import msgspec

from megatron_reshard.errors import BadInputError
from megatron_reshard.wire.metadata import SCHEMA_VERSION, make_nccl_reshard_refit_info_wire_safe
from megatron_reshard.wire.records import RefitPayload

EXTRA_KEYS = ("schema_version", "train_layout", "gen_layout", "hf_config", "other_params",
              "train_stage_ranks", "rank_order")


def build_payload(refit_info: Any, *, train_layout: dict, gen_layout: dict, hf_config: dict,
                  other_params: list, train_stage_ranks: list, rank_order: str) -> dict:
    """The plain-data payload: wire-safe refit info (records, ``wire.RefitPayload``, or the
    seed's dict form) plus the schema-1 extras."""
    payload = (refit_info.to_plain() if isinstance(refit_info, RefitPayload)
               else make_nccl_reshard_refit_info_wire_safe(refit_info))
    clash = sorted(set(payload) & set(EXTRA_KEYS))
    if clash:
        raise BadInputError(f"refit info already has payload keys {clash}")
    payload.update(
        schema_version=SCHEMA_VERSION,
        train_layout=dict(train_layout),
        gen_layout=dict(gen_layout),
        hf_config=dict(hf_config),
        other_params=[dict(p) for p in other_params],
        train_stage_ranks=[list(r) for r in train_stage_ranks],
        rank_order=rank_order,
    )
    return make_nccl_reshard_refit_info_wire_safe(payload)  # tuples → lists, rejects non-plain data


def encode_payload(payload: dict) -> bytes:
    """msgpack bytes of a payload from :func:`build_payload`."""
    return msgspec.msgpack.encode(payload)


def decode_payload(data: bytes) -> dict[str, Any]:
    """Plain dicts/lists back from :func:`encode_payload` bytes; checks the schema version."""
    try:
        payload = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:
        raise BadInputError(f"refit payload: not a valid msgpack message ({len(data)} bytes"
                         f"{', truncated or corrupted' if data else ''}): {exc}") from None
    if not isinstance(payload, dict):
        raise BadInputError(f"refit payload: expected a map, got {type(payload).__name__}")
    version = payload.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BadInputError(f"refit payload: schema_version {version!r} is not supported "
                         f"(this build reads version {SCHEMA_VERSION})")
    missing = [k for k in ("per_layer_params", "layer_names", *EXTRA_KEYS) if k not in payload]
    if missing:
        raise BadInputError(f"refit payload: missing keys {missing}")
    return payload
