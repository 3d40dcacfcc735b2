"""gpt-oss's expert tensors: Megatron-Core's layout to the HF checkpoint's, per expert.

No Megatron import. Megatron's expert ``linear_fc1`` holds ``[gate ; up]`` rows (``[2I, H]``,
its GLU splits the output in two halves, ``mlp.MLP.forward``); the gpt-oss checkpoint
holds ``gate_up_proj [H, 2I]`` with gate and up interleaved along the columns (gate at the
even, up at the odd ones), its bias ``[2I]`` interleaved the same way. ``down_proj`` is
``[I, H]``, the transpose of Megatron's ``linear_fc2 [H, I]``. Experts are never TP-sharded
in Megatron here (expert-TP > 1 is refused), so every kind is one whole expert.

None of these is a view of the Megatron tensor (an interleave or a transpose), so the
``oss_*`` params travel as full tensors (the packed path); ``full_tensors`` makes them.
"""

from __future__ import annotations

from typing import Sequence

import torch

KINDS = ("oss_fc1", "oss_fc1_bias", "oss_fc2", "oss_fc2_bias")


def interleave_gate_up(fc1: torch.Tensor) -> torch.Tensor:
    """``[gate ; up]`` rows (or a bias) -> rows ``gate_0, up_0, gate_1, up_1, ...``."""
    rows = fc1.shape[0] // 2
    return fc1.reshape(2, rows, *fc1.shape[1:]).transpose(0, 1).reshape(fc1.shape)


def hf_shape(kind: str, local_shape: Sequence[int]) -> list[int]:
    """The HF shape of one expert's tensor from Megatron's (whole expert) shape."""
    shape = [int(s) for s in local_shape]
    if kind in ("oss_fc1", "oss_fc2"):
        return shape[::-1]  # [2I, H] -> [H, 2I]; [H, I] -> [I, H]
    return shape


def full_tensor(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """The HF tensor of one expert's Megatron tensor (a new, contiguous tensor)."""
    if kind == "oss_fc1":
        return interleave_gate_up(tensor).t().contiguous()
    if kind == "oss_fc1_bias":
        return interleave_gate_up(tensor).contiguous()
    if kind == "oss_fc2":
        return tensor.t().contiguous()
    return tensor
