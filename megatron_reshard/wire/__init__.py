"""The wire contract: what crosses from the training job to the generation workers.

Torch + stdlib only (the receiver imports it inside vLLM workers). The seed's placement
rules by HF name (``placement_rules``; the mesh and placement types they speak in are
``megatron_reshard.layout.placements``, re-exported here); the per-layer refit info and its plain
wire form (``metadata``); the payload's msgpack codec, the one of the library (``codec``;
msgspec loaded only when a payload is encoded or decoded); the payload parsed once into
frozen typed records (``records``; its plain maps ``hf_config`` / ``gen_layout`` /
``train_layout`` as ``extras``), after the schema check and whole-payload validation
(``check``); HF names of expert weights (``expert_names``); and the backend contracts a
side describes its parameters with (``spec``).
"""

from megatron_reshard.layout.placements import BlockShard, MeshInfo, MeshSizeError, PaddedShard
from megatron_reshard.wire.metadata import SCHEMA_VERSION
from megatron_reshard.wire.check import RefitPayloadError, check_schema, validate_payload
from megatron_reshard.wire.codec import build_payload, decode_payload, encode_payload, read_payload
from megatron_reshard.wire.extras import GenLayout, HFConfig, TrainLayout
from megatron_reshard.wire.records import MiscRecord, ParamRecord, RefitPayload
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx

__all__ = ["BlockShard", "GenLayout", "HFConfig", "HFToLocalParamMap", "LocalParamSpec",
           "MeshInfo", "MeshSizeError", "MiscRecord", "PaddedShard", "ParamRecord", "RefitCtx",
           "RefitPayload", "RefitPayloadError", "SCHEMA_VERSION", "TrainLayout", "build_payload",
           "check_schema", "decode_payload", "encode_payload", "read_payload", "validate_payload"]
