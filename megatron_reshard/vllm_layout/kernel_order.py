"""Where a param's checkpoint-order elements lie once vLLM's post-load step reordered them.

Several vLLM GPU backends keep a weight in its checkpoint shape but not in checkpoint
order: the FlashInfer CUTLASS unquantized MoE stores each expert's ``w13`` as [up; gate];
FlashInfer TRTLLM pads the per-rank intermediate size to 128 and moves rows and 64-element
column blocks into its block layout. Both are value-independent and *separable*: the
storage offset of checkpoint element ``(i0, i1, ..., ik)`` is ``terms[0][i0] + ... +
terms[k][ik]``, one vector per dim (``receiver.kernel_layouts`` learns the vectors from
vLLM's own conversion code).

A box of checkpoint elements whose terms are arithmetic progressions is a strided view of
the storage (``view``: the engine writes it in place, as for checkpoint order: the
CUTLASS swap is only other row offsets). Any other box whose last dim is stored in runs of
contiguous elements a fixed distance apart (TRTLLM: 64-element blocks, its rows permuted)
is a permutation of rows: ``permuted_rows`` describes it for the copy kernels
(``layout.permuted_rows.PermutedRows``), which write each row's runs straight from the
source in checkpoint order, one pass like a plain copy; ``scatter`` puts a received box in
place through the same kernel on CUDA (torch's ``index_copy_`` elsewhere). A term of -1
marks padding vLLM keeps (zero): never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_reshard.layout.permuted_rows import PermutedRows

Box = Sequence[tuple[int, int]]
PADDING = -1
_SCATTER_ELEMENTS = 1 << 22  # indices built per scatter step (32 MiB of int64)
_RUN_MOST = 64  # elements per run a contiguous last dim is cut into (bf16: 128 bytes)


@dataclass(frozen=True)
class KernelOrder:
    """The storage order of one param (see module docstring); ``terms`` are int64 offsets
    in elements from the param's first element, one vector per dim of its shape."""

    backend: str
    terms: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(t.numel()) for t in self.terms)

    def to(self, device: torch.device) -> "KernelOrder":
        return KernelOrder(self.backend, tuple(t.to(device) for t in self.terms))

    def padding_problem(self, box: Box) -> str:
        """Why ``box`` cannot be written ('' if it can): it reaches padding."""
        for d, (t, (a, b)) in enumerate(zip(self.terms, box)):
            if b > a and bool((t[a:b] == PADDING).any()):
                return f"dim {d} range {a}..{b} reaches padding that {self.backend} keeps"
        return ""

    def view(self, storage: torch.Tensor, box: Box) -> Optional[torch.Tensor]:
        """``box`` as a strided view of ``storage`` (contiguous, this order's shape), or None
        where some dim's offsets are not an arithmetic progression."""
        size, stride, first = [], [], 0
        for t, (a, b) in zip(self.terms, box):
            part = t[a:b]
            first += int(part[0]) if b > a else 0
            step = int(part[1] - part[0]) if b - a > 1 else 1
            if b - a > 2 and not bool((part[1:] - part[:-1] == step).all()):
                return None
            size.append(b - a)
            stride.append(step)
        if any(s < 0 for s in stride):
            return None
        return storage.as_strided(size, stride, storage.storage_offset() + first)

    def column_runs(self, box: Box) -> Optional[tuple[int, int, int]]:
        """``(first, width, apart)``: the box's last-dim offsets as runs of ``width``
        contiguous elements (a power of two), ``apart`` from run to run, the first at
        ``first``; None where they are not so (or reach padding)."""
        a, b = box[-1]
        n = b - a
        if n <= 0:
            return None
        cols = self.terms[-1][a:b]
        first = int(cols[0])
        if first < 0:
            return None
        jumps = torch.nonzero(cols[1:] - cols[:-1] != 1).view(-1)
        if not jumps.numel():  # one run: cut it at the widest power of two dividing it
            width = min(n & -n, _RUN_MOST)
            return first, width, width
        width = int(jumps[0]) + 1
        if width & (width - 1) or n % width:
            return None
        apart = int(cols[width]) - first
        i = torch.arange(n, device=cols.device)
        if apart < width or not torch.equal(cols, first + (i // width) * apart + i % width):
            return None
        return first, width, apart

    def permuted_rows(self, storage: torch.Tensor, box: Box):
        """``box`` (2 or 3 dims) as a ``layout.permuted_rows.PermutedRows`` of ``storage``
        (3 dims: ``[1, rows, cols]`` for a 2-dim box), or None where its last dim is not
        stored in runs or a leading dim reaches padding. Index math on the host, once per
        box (a few device reads); the copies then need none."""
        if len(box) != len(self.terms) or len(box) not in (2, 3):
            return None
        runs = self.column_runs(box)
        if runs is None:
            return None
        lead = [t[a:b] for t, (a, b) in zip(self.terms[:-1], box[:-1])]
        if any(bool((t < 0).any()) for t in lead):
            return None
        if len(lead) == 1:
            lead.insert(0, torch.zeros(1, dtype=torch.int64, device=lead[0].device))
        first, width, apart = runs
        return PermutedRows(storage, first, lead[0], lead[1], width, apart,
                            box[-1][1] - box[-1][0])

    def scatter(self, storage: torch.Tensor, box: Box, values: torch.Tensor) -> None:
        """Write ``values`` (the box's shape, checkpoint order) into ``storage``."""
        if storage.is_cuda and self._scatter_by_kernel(storage, box, values):
            return
        if self._scatter_rows_of_blocks(storage, box, values):
            return
        flat = storage.view(-1)
        parts = [t[a:b] for t, (a, b) in zip(self.terms, box)]
        inner = torch.zeros((), dtype=torch.int64, device=flat.device)
        for d, part in enumerate(parts[1:], start=1):  # offsets of one slice of dim 0
            inner = inner.unsqueeze(-1) + part.view(*([1] * (d - 1)), -1)
        per_row = max(1, int(inner.numel()))
        step = max(1, _SCATTER_ELEMENTS // per_row)
        src = values.reshape(values.shape[0], -1) if values.dim() > 1 else values.view(-1, 1)
        for lo in range(0, len(parts[0]), step):
            rows = parts[0][lo:lo + step]
            index = (rows.view(-1, 1) + inner.reshape(1, -1)).reshape(-1)
            flat.index_copy_(0, index, src[lo:lo + step].reshape(-1))


    def _scatter_by_kernel(self, storage: torch.Tensor, box: Box, values: torch.Tensor) -> bool:
        """The copy kernel of permuted rows (``engine.kernel_copies``): one pass."""
        # imported where a CUDA storage is written: the engine package costs ~1.5 s to
        # import, which vllm_layout and wire (its importer) do not pay otherwise
        from megatron_reshard.engine.kernel_copies import permuted_tables

        rows = self.permuted_rows(storage, box)
        if rows is None:
            return False
        tables, rest = permuted_tables([(rows, values.reshape(rows.shape))], storage.device)
        if rest:
            return False
        for table in tables:
            table.run()
        return True

    def _scatter_rows_of_blocks(self, storage: torch.Tensor, box: Box, values: torch.Tensor) -> bool:
        """The common case without index arithmetic per element: a 3-D box whose last dim
        is stored in blocks of ``B`` consecutive elements ``S`` apart (TRTLLM: 64 bf16 of
        128 bytes) and whose rows land on whole block slots; one ``index_copy_`` of rows
        into a ``[E, blocks, slots, B]`` view. False where that does not describe it."""
        if len(self.terms) != 3 or values.dim() != 3:
            return False
        (e0, e1), (r0, r1), (c0, c1) = box
        cols = self.terms[2]
        n = cols.numel()
        step = cols[1:] - cols[:-1] if n > 1 else cols[:0]
        jumps = torch.nonzero(step != 1).view(-1)
        width = int(jumps[0]) + 1 if jumps.numel() else n
        if width < 2 or n % width or c0 % width or c1 % width or c1 <= c0 or r1 <= r0:
            return False
        apart = int(cols[width] - cols[0]) if n > width else width
        i = torch.arange(n, device=cols.device)
        if not torch.equal(cols, cols[0] + (i // width) * apart + i % width):
            return False
        experts, rows = self.terms[0][e0:e1], self.terms[1][r0:r1]
        if bool((rows < 0).any()) or (e1 - e0 > 1 and not bool(
                (experts[1:] - experts[:-1] == experts[1] - experts[0]).all())):
            return False
        low = int(rows.min())
        if bool(((rows - low) % width != 0).any()):
            return False
        slots = (rows - low) // width
        count = int(slots.max()) + 1
        if count * width > apart:  # the slots would overlap the next block
            return False
        stride_e = int(experts[1] - experts[0]) if e1 - e0 > 1 else 1
        view = storage.as_strided(
            (e1 - e0, (c1 - c0) // width, count, width), (stride_e, apart, width, 1),
            storage.storage_offset() + int(experts[0]) + low + int(cols[c0]))
        src = values.reshape(e1 - e0, r1 - r0, (c1 - c0) // width, width).permute(0, 2, 1, 3)
        view.index_copy_(2, slots.to(storage.device), src)
        return True


def contiguous_terms(shape: Sequence[int], device=None) -> tuple[torch.Tensor, ...]:
    """The terms of checkpoint order itself (row-major contiguous)."""
    terms, stride = [], 1
    for n in reversed([int(s) for s in shape]):
        terms.append(torch.arange(n, dtype=torch.int64, device=device) * stride)
        stride *= n
    return tuple(reversed(terms))


def is_checkpoint_order(terms: Sequence[torch.Tensor]) -> bool:
    """Whether ``terms`` are plain row-major order without padding."""
    expected = contiguous_terms([t.numel() for t in terms], terms[0].device if terms else None)
    return all(torch.equal(t, e) for t, e in zip(terms, expected))


__all__ = ["KernelOrder", "PADDING", "contiguous_terms", "is_checkpoint_order"]
