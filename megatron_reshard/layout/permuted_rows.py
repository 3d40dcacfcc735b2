"""A destination box in a GPU kernel's permuted-row order, and the box of one that cuts
its runs: where each checkpoint-order element lies in the storage, and the torch path that
reads and writes them (an ``index_copy_`` of integer views: bits, NaN payloads included).

Built by ``vllm_layout.kernel_order.KernelOrder.permuted_rows``; written in one pass by
the engine's copy kernel (``engine.kernel_copies.PermutedTable``) on CUDA, through
``write`` elsewhere. Torch + stdlib only (the receiver imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from megatron_reshard.errors import BadInputError

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size


@dataclass(frozen=True, eq=False)
class PermutedRows:
    """A destination box of ``storage`` in a permuted-row order: element ``(o, i, c)`` of
    the ``[len(outer), len(inner), cols]`` box lies ``first + outer[o] + inner[i] +
    (c // width) * apart + c % width`` elements after ``storage``'s first element
    (``outer`` / ``inner``: int64 offset tables on the storage's device). Built by
    ``vllm_layout.kernel_order.KernelOrder.permuted_rows``."""

    storage: torch.Tensor
    first: int
    outer: torch.Tensor
    inner: torch.Tensor
    width: int
    apart: int
    cols: int

    @property
    def shape(self) -> tuple:
        return (int(self.outer.numel()), int(self.inner.numel()), self.cols)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.cols

    def sub(self, box) -> Optional["PermutedRows"]:
        """The sub-box ``((o0, o1), (i0, i1), (c0, c1))`` (relative), or None where its
        columns do not start and end on whole runs."""
        (o0, o1), (i0, i1), (c0, c1) = box
        if c0 % self.width or (c1 - c0) % self.width:
            return None
        return replace(self, first=self.first + (c0 // self.width) * self.apart,
                       outer=self.outer[o0:o1], inner=self.inner[i0:i1], cols=c1 - c0)

    def offsets(self) -> torch.Tensor:
        """Every element's storage offset, box-shaped (the torch path; the kernel needs none)."""
        c = torch.arange(self.cols, dtype=torch.int64, device=self.outer.device)
        cols = (c // self.width) * self.apart + c % self.width
        return (self.first + self.outer.view(-1, 1, 1) + self.inner.view(1, -1, 1)
                + cols.view(1, 1, -1))

    def write(self, values: torch.Tensor) -> None:
        """``values`` (the box, checkpoint order) into the storage with torch ops: where the
        kernel does not run (CPU tensors, no Triton); as integers where the dtypes agree
        (bits, NaN payloads included)."""
        _index_write(self.storage, self.offsets().view(-1), values)

    def read(self) -> torch.Tensor:
        """The box's elements in checkpoint order (a gather: checksums, tests)."""
        return self.storage.view(-1)[self.offsets().view(-1)].view(self.shape)

    def key(self) -> tuple:
        """What a kept copy batch compares between calls, as a tensor's ``data_ptr``: the
        storage, the first element and the term tables (by address) with the geometry."""
        return (self.storage.data_ptr(), self.first, self.outer.data_ptr(), self.outer.numel(),
                self.inner.data_ptr(), self.inner.numel(), self.width, self.apart, self.cols)

    def box(self, index: tuple) -> "PermutedRows | ScatteredRows":
        """The elements ``index`` (three slices) selects: a ``PermutedRows`` where they
        form a box whose columns start and end on whole runs, else their offsets."""
        if all(sl.step in (None, 1) for sl in index):
            got = self.sub([(sl.start, sl.stop) for sl in index])
            if got is not None:
                return got
        return ScatteredRows(self.storage, self.offsets()[index])

    def unbind(self, dim: int = 0) -> list:
        """One box per index of the outer dim (a stacked destination read from members)."""
        if dim != 0:
            raise BadInputError(f"PermutedRows unbinds along dim 0 only, not {dim}")
        return [replace(self, outer=self.outer[o:o + 1]) for o in range(self.shape[0])]


@dataclass(frozen=True, eq=False)
class ScatteredRows:
    """A box of a ``PermutedRows`` that cuts its runs: each element's storage offset
    (box-shaped), written with torch ops (a process-group piece that splits a run; rare)."""

    storage: torch.Tensor
    index: torch.Tensor

    @property
    def shape(self) -> tuple:
        return tuple(self.index.shape)

    def numel(self) -> int:
        return self.index.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def write(self, values: torch.Tensor) -> None:
        _index_write(self.storage, self.index.reshape(-1), values)

    def read(self) -> torch.Tensor:
        return self.storage.view(-1)[self.index.reshape(-1)].view(self.shape)

    def unbind(self, dim: int = 0) -> list:
        """One box per index of dim 0 (filled from members, as ``PermutedRows.unbind``)."""
        if dim != 0:
            raise BadInputError(f"ScatteredRows unbinds along dim 0 only, not {dim}")
        return [ScatteredRows(self.storage, self.index[o:o + 1]) for o in range(self.shape[0])]


def _index_write(storage: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    flat = storage.view(-1)
    if values.dtype == flat.dtype and flat.element_size() in INTS:
        ints = INTS[flat.element_size()]
        flat.view(ints).index_copy_(0, index, values.reshape(-1).view(ints))
        return
    flat.index_copy_(0, index, values.reshape(-1).to(flat.dtype))


__all__ = ["INTS", "PermutedRows", "ScatteredRows"]
