"""What one HF param writes on one generation rank: the plan records of ``receiver.targets``.

Torch + stdlib only. ``Piece``: a box of a target param receives a box of the HF tensor;
``TargetPlan``: every piece, zero-fill and kept box of one HF param on this rank;
``TargetError``: the mapping cannot be made (raised before any communication).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import Box


class TargetError(BadInputError):
    """An HF param cannot be mapped onto this rank's vLLM storage (raised before any communication)."""


@dataclass(frozen=True)
class Piece:
    """``target[target_region]`` receives ``hf[hf_region]`` (same number of elements)."""

    target: str
    target_region: Box
    hf_region: Box
    # the HF box holds the target box transposed (its last two dims; gpt-oss's experts):
    # full-tensor path only
    transposed: bool = False
    # the target seen in this shape (a row-major reshape) before the box is taken
    # (gpt-oss's w13 as [E_local, I_p, 2, H]: vllm_layout.gpt_oss.wire_piece)
    target_shape: Optional[tuple] = None
    # a function of the HF values is written, not the values (``vllm_layout.mamba.TRANSFORMS``:
    # Nemotron-H's A = -exp(A_log)); only from full tensors (the packed path)
    transform: Optional[str] = None


@dataclass
class TargetPlan:
    """Everything one HF param writes on this rank."""

    hf_name: str
    hf_shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    zero: list[tuple[str, Box]] = field(default_factory=list)  # target boxes to zero-fill
    note: str = ""  # why there is nothing to write (e.g. tied lm_head, experts of another rank)
    # block-FP8 targets (receiver.fp8_targets): piece index -> its box of the scale param
    scales: dict[int, Piece] = field(default_factory=dict)
    # target boxes a kernel's padding fills, kept as vLLM holds them (never written)
    kept: list[tuple[str, Box]] = field(default_factory=list)


def full_region(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


__all__ = ["Piece", "TargetError", "TargetPlan", "full_region"]
