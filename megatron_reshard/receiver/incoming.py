"""A payload entering a generation rank: checked and parsed once, and what it says of the
generation layout beyond its records.

Torch + stdlib only. ``restore_payload`` is the receiver's boundary: the plain payload
(decoded msgpack or the training side's dict) becomes a frozen ``wire.RefitPayload``
(whole-payload validation and the schema version included); nothing after it reads the
payload as a dict.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.distributed.tensor import Shard

from megatron_reshard.layout.placements import BlockShard
from megatron_reshard.vllm_layout import padded_vocab_rows
from megatron_reshard.wire.check import RefitPayloadError
from megatron_reshard.wire.placement_rules import is_expert_param
from megatron_reshard.wire.records import RefitPayload


def restore_payload(payload: Any, where: str = "this rank") -> RefitPayload:
    """The payload as records: validated (``RefitPayloadError``), its schema version checked
    (``ValueError``), meshes and placements restored. The input is not changed; records
    pass through as they are."""
    if isinstance(payload, RefitPayload):
        return payload
    return RefitPayload.from_plain(payload, where)


def gen_ep_size(payload: RefitPayload) -> int:
    """Generation EP size: ``gen_layout["ep"]`` (or ``"ep_size"``) if given, else read off the
    expert placements (the mesh axis that splits the experts' dim 0)."""
    layout = payload.gen_layout or {}
    for key in ("ep", "ep_size"):
        if layout.get(key):
            return int(layout[key])
    for p in payload.params():
        if is_expert_param(p.name):
            for axis, pl in enumerate(p.dst_placements):
                if isinstance(pl, (Shard, BlockShard)) and pl.dim == 0:
                    return int(p.dst_mesh_info.shape[axis])
            return 1
    return 1


def check_gen_tp(payload: RefitPayload, params: Mapping[str, torch.Tensor],
                 vllm_tp: Optional[tuple[int, int]], where: str) -> None:
    """The payload's generation TP against the TP this worker runs, before any param is
    mapped (else the first mismatch would surface as one param's shape): vLLM's TP size
    where the worker reports it, else the one its input embedding's rows imply (vLLM
    splits the vocab padded to 64 evenly over TP)."""
    tp = payload.gen_tp_size
    fix = "build the payload for the generation side's layout (gen_parallelism tp_size)"
    if vllm_tp is not None and int(vllm_tp[1]) != tp:
        raise RefitPayloadError(f"{where}: payload built for gen TP {tp}, this worker runs TP "
                                f"{vllm_tp[1]} (vLLM's tensor parallel size); {fix}")
    vocab = (payload.hf_config or {}).get("vocab_size")
    embed = [n for n in params if n.endswith("embed_tokens.weight")]
    if not vocab or len(embed) != 1 or params[embed[0]].dim() != 2:
        return
    rows, padded = int(params[embed[0]].shape[0]), padded_vocab_rows(vocab)
    if rows * tp != padded and rows and padded % rows == 0:
        raise RefitPayloadError(f"{where}: payload built for gen TP {tp}, this worker runs TP "
                                f"{padded // rows} (its {embed[0]} holds {rows} of the {padded} "
                                f"padded vocab rows); {fix}")


__all__ = ["check_gen_tp", "gen_ep_size", "restore_payload"]
