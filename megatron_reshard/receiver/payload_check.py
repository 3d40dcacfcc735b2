"""Whole-payload validation; lives in ``megatron_reshard.wire.check`` next to the typed
records it guards (``wire.RefitPayload.from_plain`` runs it). Kept as a name for callers."""

from megatron_reshard.wire.check import RefitPayloadError, validate_payload

__all__ = ["RefitPayloadError", "validate_payload"]
