"""The refit payload on the wire: its plain-data form (schema 1) and its msgpack codec, the
one codec of the library (the train side encodes with it, a driver or the vLLM backend
decodes with it).

Torch + stdlib at import time: msgspec is imported inside ``encode_payload`` /
``decode_payload`` only, so the receiver (which imports ``wire``) never loads it.

Schema version 1: a dict holding ``build_nccl_reshard_refit_info``'s keys in wire-safe form
(``layer_names``, ``per_layer_params``, ``train_world_size``, ``gen_world_size``,
``pp_size``, ``gen_tp_size``; meshes ``{"mesh": nested list}``, placements ``{"dim": d}`` /
``{}``) plus ``EXTRA_KEYS``:

- ``schema_version``: ``wire.metadata.SCHEMA_VERSION``
- ``train_layout``: ``{tp, pp, ep, etp, dp, cp, world_size}`` (``wire.records.TrainLayout``)
- ``gen_layout``: ``{tp, ep, pp, world_size}`` (``wire.records.GenLayout``)
- ``hf_config``: the model's HF sizes (``wire.records.HFConfig``)
- ``other_params``: ``[{name, shape, dtype, pp_stage}]``: every HF param outside the bulk
  path, in the order the misc path packs them (per stage, model order)
- ``train_stage_ranks``: per PP stage, the global train ranks in stage-local order
- ``rank_order``: the Megatron rank order found (e.g. ``"tp-dp-pp"``), informational

Decoding gives plain dicts back and checks only that the bytes are a msgpack map; the
schema (version and keys) is checked once, where a payload is parsed into records
(``wire.check.check_schema``, run by ``RefitPayload.from_plain``). ``read_payload`` does
both.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from megatron_reshard.errors import BadInputError
from megatron_reshard.wire.check import EXTRA_KEYS
from megatron_reshard.wire.metadata import SCHEMA_VERSION, make_nccl_reshard_refit_info_wire_safe
from megatron_reshard.wire.records import RefitPayload


def _plain(value: Any) -> Any:
    """A record's plain form (``to_plain``), else the value as given."""
    return value.to_plain() if hasattr(value, "to_plain") else value


def build_payload(refit_info: Any, *, train_layout: Any, gen_layout: Any, hf_config: Any,
                  other_params: Sequence[Any], train_stage_ranks: Sequence[Sequence[int]],
                  rank_order: str) -> dict:
    """The plain-data payload: wire-safe refit info (records, ``RefitPayload``, or the
    seed's dict form) plus the schema-1 extras (records or plain maps)."""
    payload = (refit_info.to_plain() if isinstance(refit_info, RefitPayload)
               else make_nccl_reshard_refit_info_wire_safe(refit_info))
    clash = sorted(set(payload) & set(EXTRA_KEYS))
    if clash:
        raise BadInputError(f"refit info already has payload keys {clash}")
    payload.update(
        schema_version=SCHEMA_VERSION,
        train_layout=dict(_plain(train_layout)),
        gen_layout=dict(_plain(gen_layout)),
        hf_config=dict(_plain(hf_config)),
        other_params=[dict(_plain(p)) for p in other_params],
        train_stage_ranks=[list(r) for r in train_stage_ranks],
        rank_order=rank_order,
    )
    return make_nccl_reshard_refit_info_wire_safe(payload)  # tuples → lists, rejects non-plain data


def encode_payload(payload: Mapping[str, Any]) -> bytes:
    """msgpack bytes of a payload from :func:`build_payload` (or its ``RefitPayload``)."""
    import msgspec  # lazily: the receiver imports wire without msgspec

    if isinstance(payload, RefitPayload):
        payload = payload.to_plain()
    return msgspec.msgpack.encode(payload)


def decode_payload(data: bytes) -> dict[str, Any]:
    """Plain dicts/lists back from :func:`encode_payload` bytes (a msgpack map, else
    ``BadInputError`` saying "refit payload"); the schema is checked where it is parsed."""
    import msgspec  # lazily: the receiver imports wire without msgspec

    try:
        payload = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, TypeError) as exc:
        raise BadInputError(f"refit payload: not a valid msgpack message ({len(data)} bytes"
                            f"{', truncated or corrupted' if data else ''}): {exc}") from None
    if not isinstance(payload, dict):
        raise BadInputError(f"refit payload: expected a map, got {type(payload).__name__}")
    return payload


def read_payload(data: bytes, where: str = "this rank") -> RefitPayload:
    """Bytes to records: :func:`decode_payload`, then ``RefitPayload.from_plain`` (schema,
    whole-payload validation, parse)."""
    return RefitPayload.from_plain(decode_payload(data), where)


__all__ = ["EXTRA_KEYS", "SCHEMA_VERSION", "build_payload", "decode_payload", "encode_payload",
           "read_payload"]
