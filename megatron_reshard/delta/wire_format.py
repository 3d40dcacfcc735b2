"""A delta region on the wire: the encodings' codes and names, the header's size, and the
error for a delta that does not fit. What each encoding holds: ``delta.encoding``.

Torch-free (the kernels, the encoding and the mover import it).
"""

from __future__ import annotations

from megatron_reshard.groups.faults import RefitError

NONE, POSITIONS, BITMASK, DENSE, GAPS = 0, 1, 2, 3, 4
DIFF8 = 8  # flag: values are int8 differences of the bits (new - old)
KINDS = {NONE: "none", POSITIONS: "positions", BITMASK: "bitmask", DENSE: "dense", GAPS: "gaps"}
HEADER_WORDS = 2
HEADER_BYTES = HEADER_WORDS * 8  # per region
GAP_SKIP = 255  # a 0 byte in GAPS: advance this far, no value


class DeltaTransportError(RefitError):
    """A delta message that does not fit the receiver's view (bad or mismatched delta)."""


def encoding_name(enc: int) -> str:
    name = KINDS.get(enc & 7, f"unknown {enc}")
    return name + "+diff8" if enc & DIFF8 and enc & 7 not in (NONE, DENSE) else name


__all__ = ["BITMASK", "DENSE", "DIFF8", "DeltaTransportError", "GAPS", "GAP_SKIP", "HEADER_BYTES",
           "HEADER_WORDS", "KINDS", "NONE", "POSITIONS", "encoding_name"]
