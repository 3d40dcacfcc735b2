"""The wire payload: plain data, versioned, both layouts, decodes back to the same dict."""

import msgspec
import pytest

from megatron_reshard.megatron.payload import SCHEMA_VERSION, build_payload, decode_payload, encode_payload
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info, restore_refit_info_placements


def _payload():
    meta = {"model.layers.0.mlp.gate_proj.weight": {"shape": [8, 4], "dtype": "torch.bfloat16"},
            "model.layers.0.mlp.experts.0.down_proj.weight": {"shape": [4, 2], "dtype": "torch.bfloat16"},
            "model.layers.0.mlp.experts.1.down_proj.weight": {"shape": [4, 2], "dtype": "torch.bfloat16"}}
    info = build_nccl_reshard_refit_info(meta, {"tp_size": 2, "ep_size": 2}, {"tp_size": 2}, 2, 2)
    return build_payload(info, train_layout={"tp": 2, "pp": 1, "ep": 2, "etp": 1, "dp": 1, "cp": 1, "world_size": 2},
                         gen_layout={"tp": 2, "ep": 1, "pp": 1, "world_size": 2}, hf_config={"vocab_size": 10},
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


def test_payload_with_another_schema_version_is_refused():
    payload = dict(_payload(), schema_version=2)
    with pytest.raises(ValueError, match="schema_version 2 is not supported"):
        decode_payload(msgspec.msgpack.encode(payload))


def test_payload_missing_a_key_is_refused():
    payload = _payload()
    del payload["hf_config"]
    with pytest.raises(ValueError, match=r"missing keys \['hf_config'\]"):
        decode_payload(msgspec.msgpack.encode(payload))


def test_one_schema_version_is_written_read_and_built_by_the_fixtures():
    import torch

    from megatron_reshard.wire import metadata
    from megatron_reshard.wire.records import SUPPORTED_SCHEMA_VERSIONS  # what a receiver reads
    from megatron_reshard.testing.vllm_like import build_plain_payload
    from megatron_reshard.tools.presets import demo_config

    assert SCHEMA_VERSION is metadata.SCHEMA_VERSION
    assert SUPPORTED_SCHEMA_VERSIONS is metadata.SUPPORTED_SCHEMA_VERSIONS
    assert SCHEMA_VERSION in SUPPORTED_SCHEMA_VERSIONS
    full = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 8)}
    plain = build_plain_payload(demo_config("dense"), full, {"tp_size": 1}, {"tp_size": 1}, 1, 1)
    assert plain["schema_version"] == SCHEMA_VERSION
