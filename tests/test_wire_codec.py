"""The wire payload: plain data, versioned, both layouts, decodes back to the same dict; one
codec (``wire.codec``), one schema check, the test fixtures built through the same code."""

import dataclasses

import msgspec
import pytest

from megatron_reshard.wire.check import RefitPayloadError
from megatron_reshard.wire.codec import (
    SCHEMA_VERSION,
    build_payload,
    decode_payload,
    encode_payload,
    read_payload,
)
from megatron_reshard.wire.extras import GenLayout, HFConfig, TrainLayout
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info, restore_refit_info_placements
from megatron_reshard.wire.records import RefitPayload


def _payload():
    meta = {"model.layers.0.mlp.gate_proj.weight": {"shape": [8, 4], "dtype": "torch.bfloat16"},
            "model.layers.0.mlp.experts.0.down_proj.weight": {"shape": [4, 2], "dtype": "torch.bfloat16"},
            "model.layers.0.mlp.experts.1.down_proj.weight": {"shape": [4, 2], "dtype": "torch.bfloat16"}}
    info = build_nccl_reshard_refit_info(meta, {"tp_size": 2, "ep_size": 2}, {"tp_size": 2}, 2, 2)
    return build_payload(info, train_layout={"tp": 2, "pp": 1, "ep": 2, "etp": 1, "dp": 1, "cp": 1, "world_size": 2},
                         gen_layout={"tp": 2, "ep": 1, "pp": 1, "world_size": 2},
                         hf_config={"vocab_size": 10, "moe_layers": [0], "q_lora_rank": None,
                                    "a_key_of_a_new_family": {"x": [1, 2]}},
                         other_params=[{"name": "model.norm.weight", "shape": (4,), "dtype": "torch.float32",
                                        "pp_stage": 0}],
                         train_stage_ranks=[(0, 1)], rank_order="tp-ep")


def test_payload_round_trips_and_restores_placements():
    payload = _payload()
    decoded = decode_payload(encode_payload(payload))
    assert decoded == payload
    assert decoded["schema_version"] == SCHEMA_VERSION
    assert decoded["other_params"][0]["shape"] == [4]
    restored = restore_refit_info_placements(decoded)
    grouped = restored["per_layer_params"]["model.layers.0"][1]
    assert grouped["name"] == "model.layers.0.mlp.experts.down_proj.weight"
    assert grouped["global_shape"] == (2, 4, 2)
    assert grouped["src_mesh_info"].mesh.tolist() == [0, 1]


def test_the_plain_maps_are_records_read_by_field_and_round_trip_unchanged():
    payload = _payload()
    records = read_payload(encode_payload(payload), "gen rank 0")
    assert isinstance(records.hf_config, HFConfig) and records.hf_config.vocab_size == 10
    assert records.hf_config.moe_layers == (0,) and records.hf_config.num_experts is None
    assert records.hf_config.value("a_key_of_a_new_family")["x"] == (1, 2)  # kept, read-only
    assert isinstance(records.gen_layout, GenLayout) and records.gen_layout.tp == 2
    assert isinstance(records.train_layout, TrainLayout) and records.train_layout.etp == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        records.hf_config.vocab_size = 11
    assert records.to_plain() == payload  # every key back, None values and unknown keys too
    assert decode_payload(encode_payload(records)) == payload


def test_payload_with_another_schema_version_is_refused_where_it_is_parsed():
    payload = dict(_payload(), schema_version=2)
    decoded = decode_payload(msgspec.msgpack.encode(payload))  # decoding checks no schema
    with pytest.raises(RefitPayloadError, match=r"refit payload on gen rank 1: unsupported "
                                                r"schema_version 2 \(this receiver reads \[1\]\)"):
        RefitPayload.from_plain(decoded, "gen rank 1")


def test_payload_missing_a_key_is_refused():
    payload = _payload()
    del payload["hf_config"]
    with pytest.raises(RefitPayloadError, match=r"missing keys \['hf_config'\]"):
        read_payload(msgspec.msgpack.encode(payload))


def test_bytes_that_are_not_a_payload_say_refit_payload():
    data = encode_payload(_payload())
    with pytest.raises(ValueError, match=r"refit payload: not a valid msgpack message"):
        decode_payload(data[:50])
    with pytest.raises(ValueError, match=r"refit payload: expected a map"):
        decode_payload(msgspec.msgpack.encode([1, 2]))


def test_a_layout_that_is_not_a_map_of_sizes_is_refused():
    for bad in (3, {"tp": "two"}):
        payload = dict(_payload(), train_layout=bad)
        with pytest.raises(RefitPayloadError, match=r"train_layout"):
            RefitPayload.from_plain(payload, "gen rank 0")


def test_one_schema_version_is_written_read_and_built_by_the_fixtures():
    import torch

    from megatron_reshard.wire import metadata
    from megatron_reshard.wire.check import EXTRA_KEYS, SUPPORTED_SCHEMA_VERSIONS
    from megatron_reshard.testing.vllm_like import build_plain_payload
    from megatron_reshard.tools.presets import demo_config

    assert SCHEMA_VERSION is metadata.SCHEMA_VERSION
    assert SUPPORTED_SCHEMA_VERSIONS is metadata.SUPPORTED_SCHEMA_VERSIONS
    assert SCHEMA_VERSION in SUPPORTED_SCHEMA_VERSIONS
    full = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8),
            "model.norm.weight": torch.zeros(4)}
    plain = build_plain_payload(demo_config("dense"), full, {"tp_size": 1, "pp_size": 1},
                                {"tp_size": 1}, 1, 1)
    assert plain["schema_version"] == SCHEMA_VERSION
    assert set(EXTRA_KEYS) <= set(plain)  # the fixture builds every key the schema has
    assert RefitPayload.from_plain(plain).to_plain() == plain


def test_the_source_hf_config_keys_are_fields_of_the_record():
    from megatron_reshard.megatron.model_info import HF_CONFIG_KEYS

    assert set(HF_CONFIG_KEYS) <= set(HFConfig.field_names()), \
        f"hf_config keys without a field of wire.HFConfig: {set(HF_CONFIG_KEYS) - set(HFConfig.field_names())}"
