"""Views into a call's tensors and batches of copies between them.

Views are made with ``as_strided`` from geometry computed once per program (from the
plan's slices and the tensor's strides, which are part of the program's key): one call
per view instead of Python indexing, and the same elements as ``tensor[slices]``.

Copy speed (H200; docs/MEASUREMENTS.md, fourth session): torch copies a strided view
element by element, so a 256 MiB strided bf16 pack took 302 µs, the same bytes as 8-byte
words 140 µs, a contiguous memcpy 129. Strided copies therefore run as the widest word
their geometry and addresses allow. The batched foreach kernel moves contiguous bytes at
half a memcpy's speed (128 MiB: 145 µs against 67), but each separate ``copy_`` costs
the host ~10 µs: contiguous pairs of MEMCPY_BYTES or more are copied one by one (a
memcpy each; 8 local copies of 32 MiB: 490 → 297 µs), smaller ones stay batched (at
1 MiB, 400 params of 0.5-4 MiB took 7 → 11 ms). On CUDA with Triton, the pairs that are
no memcpy go to the copy kernels instead (``kernel_copies.py``: one launch per table,
90-94% of a memcpy for experts, column blocks and transposed storage alike).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from . import kernel_copies
from .kernel_copies import KernelCopies
from megatron_reshard.layout.permuted_rows import PermutedRows

MEMCPY_BYTES = 16 << 20
# Integer dtypes of each element size: the views every copy batch runs on. On CUDA
# ``_foreach_copy_`` of a floating dtype goes through float arithmetic, which rewrites
# NaN payloads (bf16 bytes 0x7f81 came back 0x7fc0 on an H200); integers copy bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The foreach kernel moves uint8 views at 44% of a memcpy and int64 views at 67% (a rank's
# 128 experts of 3 MiB, one H200: scripts/probe_copy_kernels.py); below this size the
# device time is too small to pay for the check on the host.
WIDEN_BYTES = 64 << 10
_WORDS = {8: torch.int64, 4: torch.int32}


class Strided(NamedTuple):
    """A view's size and stride (in elements) and its storage offset from its tensor's."""

    size: tuple
    stride: tuple
    delta: int


class TypedRef(NamedTuple):
    """A view of tensor ``k`` of the call in its own dtype; ``view`` None: the whole tensor."""

    k: int
    view: Optional[Strided]


class FlatRef(NamedTuple):
    """The bytes of a contiguous view of tensor ``k``: ``numel`` elements from ``delta``;
    ``numel`` None: the tensor is 1-D with stride 1 and whole."""

    k: int
    numel: Optional[int]
    delta: int


class RowsRef(NamedTuple):
    """A box of tensor ``k`` of the call, a destination in a kernel's permuted-row order
    (``layout.permuted_rows.PermutedRows``); ``view``: the piece's slices of it."""

    k: int
    view: tuple


def typed_view(tensors: list, ref: TypedRef):
    x = tensors[ref.k]
    v = ref.view
    if v is None:
        return x
    if type(ref) is RowsRef:
        return x.box(v)
    return x.as_strided(v.size, v.stride, x.storage_offset() + v.delta)


def address(x) -> object:
    """What a kept batch compares between calls: a tensor's ``data_ptr``, or the
    ``key`` of a permuted-row destination."""
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.key()


def flat_view(tensors: list, ref: FlatRef) -> torch.Tensor:
    x = tensors[ref.k]
    if ref.numel is None:
        return x.view(torch.uint8)
    return x.as_strided((ref.numel,), (1,), x.storage_offset() + ref.delta).view(torch.uint8)


def word_bytes(size, stride, itemsize: int) -> int:
    """The widest word (8 or 4 bytes, wider than an element; 0: none) that a view of this
    size and stride (in elements) can be copied as, by ``Tensor.view(dtype)``'s rule: unit
    last stride, the last dim's bytes and every other stride's a multiple of the word. The
    view's address is checked per call (``words_pair``)."""
    if not size or 0 in size or stride[-1] != 1:
        return 0
    for w in (8, 4):
        if w > itemsize and all(b * itemsize % w == 0 for b in (size[-1], *stride[:-1])):
            return w
    return 0


def _as_words(v: torch.Tensor, w: int) -> Optional[torch.Tensor]:
    if v.data_ptr() % w or v.storage_offset() * v.element_size() % w:
        return None
    return v.view(_WORDS[w])


def words_pair(dst: torch.Tensor, src: torch.Tensor, w: int) -> tuple:
    """``(dst, src)`` as ``w``-byte words when both addresses allow it (their geometry
    passed ``word_bytes``), else as they are. Bit-exact either way: a copy moves bits."""
    if w:
        dw, sw = _as_words(dst, w), _as_words(src, w)
        if dw is not None and sw is not None:
            return dw, sw
    return dst, src


def as_bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as integers of its element size (same strides, same bits)."""
    return x if not x.dtype.is_floating_point else x.view(_BITS[x.element_size()])


def address_bits(x: torch.Tensor) -> int:
    """The bits that decide whether views of ``x`` can be copied as words: its address
    and its storage offset in bytes (``Tensor.view(dtype)`` needs both aligned)."""
    return x.data_ptr() | x.storage_offset() * x.element_size()


def as_words(v: torch.Tensor, w: int) -> torch.Tensor:
    """``v`` as ``w``-byte words (its geometry passed ``word_bytes``, its address and
    storage offset are multiples of ``w``)."""
    return v.view(_WORDS[w])


class Copies:
    """One batch of copies ``dst <- src`` whose destinations never overlap, issued as few
    kernels as the views allow (see MEMCPY_BYTES): large contiguous pairs at once, one
    memcpy each. On CUDA with Triton the others go to the copy kernels at the first run
    (``kernel_copies.KernelCopies``: one launch for the aligned contiguous pairs, one per
    kind of strided pair that folds into tiles), and what they do not take stays below.
    Elsewhere: the other contiguous pairs (uint8 views of equal length) as one
    ``_foreach_copy_`` (multi-tensor kernels on CUDA, whatever the params' dtypes); strided
    pairs as one ``_foreach_copy_`` as well, which runs them one ``copy_`` each, in C++."""

    def __init__(self) -> None:
        self.flat_dst, self.flat_src, self.typed_dst, self.typed_src = [], [], [], []
        self.word_dst, self.word_src, self.memcpy = [], [], []
        # destinations in a kernel's permuted-row order: the permuted-row kernel on CUDA
        # (one pass from the source, kernel_copies.PermutedTable), else torch's index copy
        self.rows: list = []
        self.row_tables: list = []
        self.rows_read: list = []  # (tensor, rows): gathered by torch (forwarded sends)
        self.kernels: Optional[KernelCopies] = None  # set at the first run
        self._launch = None  # what runs after the memcpys (set at the first run)

    def flat(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        """A pair of uint8 views of ``nbytes`` each."""
        if nbytes >= MEMCPY_BYTES:
            self.memcpy.append((dst, src))
        elif (nbytes >= WIDEN_BYTES and nbytes % 8 == 0
              and (dst.data_ptr() | src.data_ptr()) % 8 == 0):
            self.word_dst.append(dst.view(torch.int64))
            self.word_src.append(src.view(torch.int64))
        else:
            self.flat_dst.append(dst)
            self.flat_src.append(src)

    def typed(self, dst: torch.Tensor, src: torch.Tensor, w: int) -> None:
        self.exact(*words_pair(dst, src, w))

    def exact(self, dst, src: torch.Tensor) -> None:
        """A typed pair as it is (the caller has made words of it where it could), copied
        as integers of its element size; ``dst`` may be a box in a kernel's permuted-row
        order (``layout.permuted_rows.PermutedRows``, or ``ScatteredRows`` where it cuts runs),
        and so may ``src`` (a phase-1 send forwarding what a generation rank received)."""
        if not isinstance(dst, torch.Tensor):
            self.rows.append((dst, src))
            return
        if not isinstance(src, torch.Tensor):  # a generation rank forwards what it holds
            self.rows_read.append((dst, src))
            return
        self.typed_dst.append(as_bits(dst))
        self.typed_src.append(as_bits(src))

    def many(self, dsts, srcs) -> None:
        """Typed pairs as they are, given as two sequences (of one device). On CPU in
        their own dtype: a CPU copy of one dtype moves bits, and an integer view costs the
        host a Python call per tensor; elsewhere as integers, as ``exact``."""
        if dsts and dsts[0].device.type == "cpu":
            self.typed_dst += dsts
            self.typed_src += srcs
        else:
            self.typed_dst += map(as_bits, dsts)
            self.typed_src += map(as_bits, srcs)

    def run(self) -> None:
        """Issue the batch (a batch may be run again: it holds views, no data)."""
        for dst, src in self.memcpy:
            dst.copy_(src)
        if self._launch is None:
            self.kernels = self._to_kernels()
            self._rows_to_kernels()
            # a kept batch (program.py) runs on every call: from its third run on, its
            # launches replay as one CUDA graph (the host's cost of a Triton launch would
            # show on small batches); run once or twice, it pays no capture. The replay
            # holds the batch weakly: a cycle would keep a dropped batch's views (staging
            # buffers among them) alive until a gc pass (the CPU memory test saw 2.7x).
            if self.kernels.tables or self.row_tables:
                issue = weakref.WeakMethod(self._issue)
                # the tables' device (a batch of permuted rows alone has no KernelCopies
                # tables, and its empty KernelCopies names the CPU: it was never captured)
                device = (self.kernels.device if self.kernels.tables
                          else self.row_tables[0].base.device)
                self._launch = kernel_copies.Replayed(lambda: issue()(), device, after=2)
            else:
                self._launch = False
        for dst, src in self.rows:  # torch's index copies allocate: never in a graph
            dst.write(src)
        for dst, src in self.rows_read:
            as_bits(dst).copy_(as_bits(src.read()))
        if self._launch is False:
            self._issue()
        else:
            self._launch()

    def _issue(self) -> None:
        for table in self.row_tables:
            table.run()
        self.kernels.run()
        if self.word_dst:
            torch._foreach_copy_(self.word_dst, self.word_src)
        if self.flat_dst:
            torch._foreach_copy_(self.flat_dst, self.flat_src)
        if self.typed_dst:
            torch._foreach_copy_(self.typed_dst, self.typed_src)

    def _rows_to_kernels(self) -> None:
        """The permuted-row pairs the kernel takes, moved out of ``rows`` (CUDA only)."""
        whole = [(d, s) for d, s in self.rows if isinstance(d, PermutedRows)]
        if not whole or kernel_copies.kernels_for(whole[0][0].device) is None:
            return
        self.row_tables, rest = kernel_copies.permuted_tables(whole, whole[0][0].device)
        left = {id(d) for d, _ in rest}
        self.rows = [(d, s) for d, s in self.rows
                     if id(d) in left or not isinstance(d, PermutedRows)]

    def _to_kernels(self) -> KernelCopies:
        """The pairs the copy kernels take, moved out of the foreach lists (none off CUDA,
        where the lists stay as they are)."""
        first = next((x for x in (self.word_dst, self.flat_dst, self.typed_dst) if x), None)
        if first is None or kernel_copies.kernels_for(first[0].device) is None:
            return _NO_KERNELS
        lists = ((self.word_dst, self.word_src), (self.flat_dst, self.flat_src),
                 (self.typed_dst, self.typed_src))
        kernels = kernel_copies.KernelCopies([p for d, s in lists for p in zip(d, s)],
                                             first[0].device)
        left = {id(d) for d, _ in kernels.rest}
        for dsts, srcs in lists:
            kept = [(d, s) for d, s in zip(dsts, srcs) if id(d) in left]
            dsts[:], srcs[:] = [d for d, _ in kept], [s for _, s in kept]
        return kernels


_NO_KERNELS = KernelCopies([], torch.device("cpu"))
