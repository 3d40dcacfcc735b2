"""The wire contract: what crosses from the training job to the generation workers.

Torch + stdlib only (the receiver imports it inside vLLM workers). The seed's placement
rules by HF name (``placement_rules``; the mesh and placement types they speak in are
``megatron_reshard.layout.placements``, re-exported here); the per-layer refit info and its plain
wire form (``metadata``); the payload parsed once into frozen typed records (``records``), after
whole-payload validation (``check``); and the backend contracts a side describes its
parameters with (``spec``).
"""

from megatron_reshard.layout.placements import BlockShard, MeshInfo, MeshSizeError, PaddedShard
from megatron_reshard.wire.metadata import SCHEMA_VERSION
from megatron_reshard.wire.check import RefitPayloadError, validate_payload
from megatron_reshard.wire.records import MiscRecord, ParamRecord, RefitPayload
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitCtx

__all__ = ["BlockShard", "HFToLocalParamMap", "LocalParamSpec", "MeshInfo", "MeshSizeError",
           "MiscRecord", "PaddedShard", "ParamRecord", "RefitCtx", "RefitPayload",
           "RefitPayloadError", "SCHEMA_VERSION", "validate_payload"]
