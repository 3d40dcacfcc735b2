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

The names below are what a vLLM user needs: the worker extension, the session it drives
(for a launcher of one's own), and the two errors worth catching. Everything else is
imported from its submodule.
"""

from megatron_reshard.receiver.session import ReceiverSession
from megatron_reshard.receiver.state import InconsistentWeightsError
from megatron_reshard.receiver.targets import TargetError
from megatron_reshard.receiver.worker import MegatronReshardWorkerExtension

__all__ = ["InconsistentWeightsError", "MegatronReshardWorkerExtension", "ReceiverSession",
           "TargetError"]
