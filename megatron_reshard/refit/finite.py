"""The opt-in check that training weights are finite (``RefitSender(check_finite=True)``).

Torch + stdlib only. NaN or Inf in a training weight is refit like any other value unless
asked. With ``check_finite`` the training side checks twice:

- **before the version vote** (``nonfinite``): every model tensor its sender reads (the
  shards, bulk and packed alike) and, where weights are held in blockwise FP8, their FP8
  bytes (no NaN pattern) and scales (finite and > 0). A rank that finds one refuses the
  refit in the vote (``version.NonFiniteRefused`` on every rank, naming the param and the
  rank): no byte moves, the generation side keeps version N, consistent. Float tensors
  are reduced per batch by one multi-tensor max-abs on CUDA (``torch._foreach_norm``, ord
  inf: NaN and Inf propagate through it; a float64 sum per tensor on the CPU), all batches
  read with one host sync.
- **in the transfer** (``all_finite``, ``FiniteCheck``): every buffer it sends (where the
  end-to-end checksums run, in the same pass over each chunk, ``integrity.box_checksum``;
  the packed other params before their broadcast), which covers what is computed for the
  wire after the vote (concatenations, FP8 quantized on send); a finding there fails the
  commit on every rank (``commit.Findings``): the weights are then inconsistent.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_reshard.layout.permuted_rows import PermutedRows
from megatron_reshard.refit.version import Refusal

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# FP8 bit patterns that are not finite: e4m3fn has NaN only (S.1111.111), e5m2 Inf and NaN
# (exponent all ones)
_FP8_NOT_FINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}
BATCH = 256  # tensors per multi-tensor reduction


def all_finite(buf: Any) -> Optional[torch.Tensor]:
    """A bool scalar tensor (no host sync): every element of ``buf`` (a tensor, a list of
    per-index tensors, or a kernel's permuted rows) is finite; None for dtypes not looked
    at (integers)."""
    if isinstance(buf, PermutedRows):
        buf = buf.read()
    parts = list(buf) if isinstance(buf, (list, tuple)) else [buf]
    if not parts:
        return None
    if parts[0].dtype in _FP8_NOT_FINITE:
        flags = [_fp8_finite(p) for p in parts]
    elif parts[0].dtype in FLOATS:
        flags = [torch.isfinite(p).all() for p in parts]
    else:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def _fp8_finite(t: torch.Tensor) -> torch.Tensor:
    mask, pattern = _FP8_NOT_FINITE[t.dtype]
    return ~((t.view(torch.uint8) & mask) == pattern).any()


def _scale_ok(t: torch.Tensor) -> torch.Tensor:
    """FP8 scales: finite and > 0 (a zero or negative scale is no weight either)."""
    if not t.numel():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return (t.amin() > 0) & torch.isfinite(t.amax())


def _float_flags(tensors: Sequence[torch.Tensor], fused: Optional[bool]) -> list[torch.Tensor]:
    """One bool per tensor. On CUDA one fused multi-tensor max-abs per batch of ``BATCH``
    (``_foreach_norm``, ord inf); on the CPU, where that runs tensor by tensor at several
    times a copy's cost, a float64 sum per tensor (NaN and Inf propagate; finite values
    of 32 bits or fewer cannot overflow it): ``scripts/bench_finite_kernels.py``.
    ``fused``: which of the two (None: by the device)."""
    flags = []
    for lo in range(0, len(tensors), BATCH):
        batch = list(tensors[lo:lo + BATCH])
        if batch[0].is_cuda if fused is None else fused:
            norms = torch.stack([n.float() for n in torch._foreach_norm(batch, float("inf"))])
        else:
            norms = torch.stack([t.sum(dtype=torch.float64) if t.dtype != torch.float64
                                 else t.abs().amax() for t in batch])
        flags.extend(torch.isfinite(norms).unbind())
    return flags


def nonfinite(weights: Iterable[torch.Tensor], fp8: Iterable[tuple[torch.Tensor, torch.Tensor]] = (),
              fused: Optional[bool] = None) -> tuple[list[int], list[int]]:
    """Which ``weights`` hold NaN or Inf, and which FP8-held ``(data, scales)`` pairs hold a
    NaN byte or a scale not finite and > 0: (indexes into each), one host sync for all.
    Tensors of other dtypes (integers) are not looked at. ``fused``: ``_float_flags``."""
    weights, fp8 = list(weights), list(fp8)
    floats = [i for i, t in enumerate(weights) if t.dtype in FLOATS and t.numel()]
    flags = _float_flags([weights[i] for i in floats], fused)
    owners = list(floats)
    for i, t in enumerate(weights):
        if t.dtype in _FP8_NOT_FINITE and t.numel():
            flags.append(_fp8_finite(t))
            owners.append(i)
    fp8_at = len(flags)
    for data, scales in fp8:
        flags.append(_fp8_finite(data) & _scale_ok(scales.float()))
    if not flags:
        return [], []
    device = flags[0].device
    ok = torch.stack([f.to(device) for f in flags]).tolist()
    bad_weights = sorted({owners[k] for k in range(fp8_at) if not ok[k]})
    bad_fp8 = [k - fp8_at for k in range(fp8_at, len(ok)) if not ok[k]]
    return bad_weights, bad_fp8


def nonfinite_refusal(converted: Sequence[tuple[Any, torch.Tensor]], fp8_views: Any,
                      names: Sequence[str], where: str) -> Optional[Refusal]:
    """The training side's check before the vote (module doc): None when every tensor its
    sender reads is finite, else its refusal naming the params. ``converted``: (converter,
    model tensor) pairs (``megatron_name``, ``hf_names``); ``fp8_views``: HF name ->
    (FP8 data, scales) of the weights held in blockwise FP8; ``names``: the stage's params
    in payload order (a stage index names a param on every rank)."""
    fp8 = list(fp8_views.items())
    bad, bad_fp8 = nonfinite([t for _, t in converted], [pair for _, pair in fp8])
    if not bad and not bad_fp8:
        return None
    found = [f"{converted[i][0].megatron_name} ({', '.join(converted[i][0].hf_names)})"
             for i in bad]
    found += [f"{fp8[i][0]} (held in FP8: a NaN byte, or a scale not finite and > 0)"
              for i in bad_fp8]
    hf = {n for i in bad for n in converted[i][0].hf_names} | {fp8[i][0] for i in bad_fp8}
    index = next((i for i, n in enumerate(names) if n in hf), -1)
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return Refusal(f"refit refused before any byte moved: NaN or Inf in the weights on "
                   f"{where} (check_finite): {shown}. The generation side keeps the weights "
                   f"it holds", index, "nonfinite")


class FiniteCheck:
    """The finite flags of one stage's params in one run, read once at its end."""

    def __init__(self) -> None:
        self._indexes: list[int] = []
        self._flags: list[torch.Tensor] = []

    def add(self, index: int, flag: Optional[torch.Tensor]) -> None:
        """Param ``index``'s flag (``all_finite``; None: not looked at)."""
        if flag is not None:
            self._indexes.append(index)
            self._flags.append(flag)

    def bad(self) -> list[int]:
        """The indexes whose buffer held NaN or Inf (one host sync)."""
        if not self._flags:
            return []
        ok = torch.stack([f.to(self._flags[0].device) for f in self._flags]).tolist()
        return [i for i, good in zip(self._indexes, ok) if not good]


__all__ = ["BATCH", "FLOATS", "FiniteCheck", "all_finite", "nonfinite", "nonfinite_refusal"]
