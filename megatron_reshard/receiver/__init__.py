"""Generation side of megatron_reshard: receive training weights into vLLM-layout storage.

Imports only torch and the standard library (it runs inside vLLM workers, where Megatron,
Transformer Engine and msgspec may be absent); the payload arrives already decoded to
plain data.

- ``targets``: where each HF param lands in vLLM's per-rank storage (``VllmTargets``)
  and the bulk receive recipes; ``full_weights``: full HF tensors into that storage
  (``load_full_weights``, the misc path).
- ``incoming``: the payload checked and parsed once into ``wire.RefitPayload`` records
  (``restore_payload``), the generation EP size it implies (``gen_ep_size``).
- ``param_map``: the rank's ``hf_name -> LocalParamSpec`` map of the bulk params
  (``build_receiver_param_map``); ``misc_transport``: the default packed receive of the
  other params (``receive_misc_packed``).
- ``session``: ``ReceiverSession`` — the lifecycle: prepare, verify, refit, commit, report.
- ``worker``: ``MegatronReshardWorkerExtension`` for vLLM's ``collective_rpc``.
"""

from megatron_reshard.wire.metadata import SUPPORTED_SCHEMA_VERSIONS
from megatron_reshard.receiver.incoming import gen_ep_size, restore_payload
from megatron_reshard.receiver.misc_transport import receive_misc_packed
from megatron_reshard.receiver.param_map import build_receiver_param_map
from megatron_reshard.receiver.session import ReceiverSession
from megatron_reshard.receiver.full_weights import (
    apply_full_weights,
    coverage_gaps,
    load_full_weights,
    plan_full_weights,
)
from megatron_reshard.receiver.targets import (
    Piece,
    TargetError,
    TargetPlan,
    VllmTargets,
    bulk_receive_plan,
    expert_block,
    receive_spec,
)
from megatron_reshard.receiver.worker import MegatronReshardWorkerExtension

__all__ = [
    "MegatronReshardWorkerExtension", "Piece", "ReceiverSession", "SUPPORTED_SCHEMA_VERSIONS",
    "TargetError", "TargetPlan", "VllmTargets", "apply_full_weights", "build_receiver_param_map",
    "bulk_receive_plan", "coverage_gaps", "expert_block", "gen_ep_size", "load_full_weights",
    "plan_full_weights", "receive_misc_packed", "receive_spec", "restore_payload",
]
