"""Batches of copies ``dst <- src`` as Triton kernel launches (CUDA), shared by the engine's
copy batches (``copies.Copies``) and the colocated transport's (``colocated_copies``).

Torch + stdlib only: Triton, which the CUDA builds of torch ship, loads lazily, and every
caller keeps its torch path for when it is absent (CPU builds) or switched off
(``MEGATRON_RESHARD_COPY_KERNELS=0``).

Two tables, each one launch for any number of pairs, reading the pairs' addresses and
geometry from small device tables built once (a batch is kept across calls, and so are
they; the pairs' views are kept with them, so the addresses stay valid):

- ``BlockTable``: contiguous, 8-byte aligned pairs of any sizes, as int64 words; one
  program per ``BLOCK`` words of some pair (a rank's experts into a stacked tensor: one
  launch instead of 128 copies).
- ``TileTable``: strided pairs, as integers of their element size (or words), cut into
  tiles of rows x columns: a destination whose last dim (after merging dims) has unit
  stride, read from a source of unit stride along the same dim (``ROWS``: column blocks of
  a wider tensor) or along another one (``TRANSPOSED``: a transposed storage, which
  torch copies element by element at ~15% of a memcpy; the tile is turned on chip).
- ``PermutedTable``: destinations whose rows are permuted (``layout.permuted_rows``: a GPU
  kernel's own order of an expert tensor, e.g. FlashInfer TRTLLM's block layout, which no
  strided view describes): each row's address is read from the order's term tables and
  its runs of ``width`` contiguous elements are stored ``apart``; the source is read in
  checkpoint order. One pass, as a plain tile copy, instead of a staging buffer and a
  scatter.

Copies move integer bits, never float values: CUDA's float copies rewrite NaN payloads
(copies.py).
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple, Optional

import torch

from megatron_reshard.layout.permuted_rows import INTS, PermutedRows
from .triton_build import built_once

ROWS, TRANSPOSED = 0, 1


def _table(values, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


def _program_map(counts: list, device) -> tuple:
    """(first program of each pair, pair of each program) for ``counts`` programs per pair."""
    starts = [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + n)
    pair_of = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32),
                                      torch.tensor(counts)).to(device)
    return _table(starts, torch.int64, device), pair_of


def aligned_words(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a pair can be copied as whole int64 words (``BlockTable``)."""
    nbytes = dst.numel() * dst.element_size()
    return (nbytes > 0 and nbytes % 8 == 0 and dst.is_contiguous() and src.is_contiguous()
            and (dst.data_ptr() | src.data_ptr()) % 8 == 0)


class BlockTable:
    """Contiguous, 8-byte aligned copies of any sizes in one Triton launch: one program per
    ``BLOCK`` words of some pair, found through a device map of program -> pair (4 bytes
    per 32 KiB copied), so no program idles on a short pair."""

    BLOCK = 4096  # 8-byte words per program

    def __init__(self, kernels, pairs: list, device: torch.device):
        words = [d.numel() * d.element_size() // 8 for d, _ in pairs]
        self.kernel = kernels.copy_blocks
        self.dst_ptrs = _table([d.data_ptr() for d, _ in pairs], torch.int64, device)
        self.src_ptrs = _table([s.data_ptr() for _, s in pairs], torch.int64, device)
        self.words = _table(words, torch.int64, device)
        blocks = [-(-w // self.BLOCK) for w in words]
        self.first, self.pair_of = _program_map(blocks, device)
        self.grid = (sum(blocks),)
        self._keep = pairs  # the views (and their storages) outlive the table

    def run(self) -> None:
        self.kernel[self.grid](self.dst_ptrs, self.src_ptrs, self.words, self.first,
                               self.pair_of, BLOCK=self.BLOCK)


class Tiled(NamedTuple):
    """A pair as ``batch`` x ``rows`` x ``cols`` elements: the destination has unit stride
    along cols, the source along cols (ROWS) or along rows (TRANSPOSED)."""

    kind: int
    batch: int
    rows: int
    cols: int
    dst_strides: tuple  # (batch, rows)
    src_strides: tuple  # (batch, rows) for ROWS; (batch, cols) for TRANSPOSED


def tiled(dst: torch.Tensor, src: torch.Tensor) -> Optional[Tiled]:
    """The pair as tiles, or None when its dims do not fold into that form (three dims at
    most after merging, a unit stride on each side)."""
    dims = []
    for n, ds, ss in zip(dst.shape, dst.stride(), src.stride()):
        if n == 1:
            continue
        if dims and dims[-1][1] == ds * n and dims[-1][2] == ss * n:
            dims[-1] = (dims[-1][0] * n, ds, ss)  # merges with the dim before it
        else:
            dims.append((n, ds, ss))
    if not dims:
        dims = [(1, 1, 1)]
    last = [i for i, d in enumerate(dims) if d[1] == 1]
    if not last:
        return None
    inner = dims.pop(last[0])
    if inner[2] == 1:
        if len(dims) > 2:
            return None
        outer = [(1, 0, 0)] * (2 - len(dims)) + dims
        return Tiled(ROWS, outer[0][0], outer[1][0], inner[0], (outer[0][1], outer[1][1]),
                     (outer[0][2], outer[1][2]))
    across = [i for i, d in enumerate(dims) if d[2] == 1]
    if not across or len(dims) > 2:
        return None
    rows = dims.pop(across[0])
    b = dims[0] if dims else (1, 0, 0)
    return Tiled(TRANSPOSED, b[0], rows[0], inner[0], (b[1], rows[1]), (b[2], inner[2]))


VECTOR = 16  # bytes: the widest load and store a thread issues


def _vector_unit(pair: tuple, shape: Tiled, itemsize: int) -> int:
    """Elements per 16 bytes when every address, stride and contiguous extent of the pair
    is a multiple of 16 bytes (the kernel is then told so, and moves 16-byte vectors),
    else 1."""
    unit = VECTOR // itemsize
    if unit < 2:
        return 1
    steps = (*shape.dst_strides, *shape.src_strides, shape.cols,
             shape.rows if shape.kind == TRANSPOSED else 0)
    if (pair[0].data_ptr() | pair[1].data_ptr()) % VECTOR or any(x % unit for x in steps):
        return 1
    return unit


class TileTable:
    """Strided copies of one kind, element size and vector unit in one Triton launch: one
    program per tile of some pair (a device map of program -> pair, as ``BlockTable``).
    Every address is an offset from one base tensor, in vector units, and every stride and
    extent is stored in vector units too: so the compiler knows them to be multiples of
    16 bytes (a pointer read from a table would tell it nothing) and vectorizes."""

    TILE_BYTES = 32 << 10  # bytes per program, as a BlockTable's
    TURNED_ROWS = 128      # TRANSPOSED: rows per tile (bf16: 128 x 128, fp32: 128 x 64)
    WARPS = 4

    @classmethod
    def tile_cols(cls, kind: int, cols: int, itemsize: int) -> int:
        """A tile's columns for a pair of ``cols`` columns: TRANSPOSED, a square-ish
        tile; ROWS, the smallest of five widths (a tile's elements / 1, 4, 16, 64, 256)
        that holds a row, so that a pair of short rows does not run a program per row of
        a wide tile, and a batch compiles a few kernels, not one per row length."""
        elems = cls.TILE_BYTES // itemsize
        if kind == TRANSPOSED:
            return elems // cls.TURNED_ROWS
        return next((elems >> k for k in (8, 6, 4, 2) if cols <= elems >> k), elems)

    def __init__(self, kernels, kind: int, itemsize: int, unit: int, cols: int, pairs: list,
                 shapes: list, device: torch.device):
        """``cols``: the tile's columns (``tile_cols``); its rows fill ``TILE_BYTES``."""
        # measured on one H200, 512 MiB bf16 turned: 128 x 128 94% of a memcpy, 64 x 64
        # 90%, 32 x 32 68%, with 16-byte vectors; 33-49% without (docs/MEASUREMENTS.md)
        self.bc = cols
        self.br = max(1, self.TILE_BYTES // itemsize // cols)
        self.base = pairs[0][0].view(INTS[itemsize])
        base, step = self.base.data_ptr(), unit * itemsize
        self.row_unit = unit if kind == TRANSPOSED else 1
        meta, offs, tiles = [], [], []
        for (d, s), t in zip(pairs, shapes):
            offs += [(d.data_ptr() - base) // step, (s.data_ptr() - base) // step]
            meta.append((t.rows // self.row_unit, t.cols // unit,
                         *(x // unit for x in (*t.dst_strides, *t.src_strides)), 0, 0))
            tiles.append(t.batch * -(-t.rows // self.br) * -(-t.cols // self.bc))
        self.kernel, self.kind, self.unit = kernels.copy_tiles, kind, unit
        self.offs = _table(offs, torch.int64, device)
        self.meta = _table(meta, torch.int64, device)
        self.first, self.pair_of = _program_map(tiles, device)
        self.grid = (sum(tiles),)
        self._keep = pairs

    def run(self) -> None:
        self.kernel[self.grid](self.base, self.offs, self.meta, self.first, self.pair_of,
                               KIND=self.kind, UNIT=self.unit, ROW_UNIT=self.row_unit,
                               BR=self.br, BC=self.bc, num_warps=self.WARPS)


def _src3(src: torch.Tensor, shape: tuple) -> Optional[torch.Tensor]:
    """``src`` as the ``[outer, inner, cols]`` box it fills, or None."""
    if tuple(src.shape) == shape:
        return src
    if src.dim() == 2 and shape[0] == 1 and tuple(src.shape) == shape[1:]:
        return src.unsqueeze(0)
    return None


class PermutedTable:
    """Copies into ``PermutedRows`` destinations of one element size, run width and vector
    unit in one Triton launch: a program per tile of ``BR`` rows x ``NB`` runs of some
    pair. Row addresses come from the order's tables (two loads per row), so the copy reads
    the source once and writes every element once; offsets are kept in vector units (as
    ``TileTable``'s) so that each run moves in 16-byte vectors.

    The tile's shape decides how far apart its bytes land: a row's runs go to as many
    column blocks (``apart`` elements apart), while the rows of one run go to the slots
    of one block, which the kernels' orders keep in groups (FlashInfer TRTLLM: 8 or 32
    checkpoint rows to consecutive slots). A tile of ``ROWS`` rows and the runs that fill
    ``TILE_BYTES`` reads ``ROWS`` pieces of the source and writes ``NB`` pieces of about
    as many slots into each block; ``NB``, a power of two, divides every pair's runs
    (w2's 12 runs: 4 at most), so no lane is masked off at a row's end."""

    # measured on one H200 (docs/MEASUREMENTS.md), TRTLLM's w13 and w2 of a 30B-A3B layer
    # per expert: 16 KiB tiles of 32 rows x 4 runs 97-98% of the checkpoint-order copy,
    # 32 KiB of 8 rows x 32 runs (the earlier shape) 91-95%, streaming hints 92-94%
    TILE_BYTES = 16 << 10
    ROWS = 32  # rows per tile (at least; more where the runs per tile are few)
    WARPS = 4

    def __init__(self, kernels, itemsize: int, unit: int, width: int, pairs: list,
                 device: torch.device):
        self.kernel, self.unit, self.width = kernels.copy_permuted, unit, width
        first_dst = pairs[0][0]
        self.base = first_dst.storage.view(INTS[itemsize])
        base, step = self.base.data_ptr(), unit * itemsize
        run_bytes = width * itemsize
        runs = [d.cols // width for d, _ in pairs]
        common = min(n & -n for n in runs)  # the largest power of two dividing them all
        self.nb = max(1, min(common, self.TILE_BYTES // (run_bytes * self.ROWS)))
        self.br = max(1, self.TILE_BYTES // (run_bytes * self.nb))
        offs, meta, outer, inner, tiles = [], [], [], [], []
        for d, s in pairs:
            start = d.storage.data_ptr() + d.first * itemsize
            offs += [(start - base) // step, (s.data_ptr() - base) // step]
            n = d.cols // width
            meta.append((d.shape[0], d.shape[1], n, s.stride(0) // unit, s.stride(1) // unit,
                         d.apart // unit, 0, 0))
            outer.append(d.outer.data_ptr())
            inner.append(d.inner.data_ptr())
            tiles.append(-(-d.shape[0] * d.shape[1] // self.br) * -(-n // self.nb))
        self.offs = _table(offs, torch.int64, device)
        self.meta = _table(meta, torch.int64, device)
        self.outer = _table(outer, torch.int64, device)
        self.inner = _table(inner, torch.int64, device)
        self.first, self.pair_of = _program_map(tiles, device)
        self.grid = (sum(tiles),)
        self._keep = pairs

    def run(self) -> None:
        self.kernel[self.grid](self.base, self.offs, self.meta, self.outer, self.inner,
                               self.first, self.pair_of, UNIT=self.unit, W=self.width,
                               BR=self.br, NB=self.nb, num_warps=self.WARPS)


def _permuted_unit(dst: PermutedRows, src: torch.Tensor, multiples: dict) -> int:
    """Elements per 16 bytes when every address, stride and term of the pair is a multiple
    of 16 bytes, else 1 (``multiples``: the term tables already checked, by address)."""
    size = dst.storage.element_size()
    unit = VECTOR // size
    if unit < 2 or dst.width % unit:
        return 1
    start = dst.storage.data_ptr() + dst.first * size
    if (start | src.data_ptr()) % VECTOR or dst.apart % unit \
            or src.stride(0) % unit or src.stride(1) % unit:
        return 1
    for terms in (dst.outer, dst.inner):
        key = (terms.data_ptr(), terms.numel(), unit)
        if key not in multiples:
            multiples[key] = not bool((terms % unit).any())
        if not multiples[key]:
            return 1
    return unit


def permuted_tables(pairs: list, device: torch.device) -> tuple[list, list]:
    """``(tables, rest)``: the ``(PermutedRows, src)`` pairs the kernel takes, one table per
    element size, run width, vector unit and power of two dividing the runs; ``rest``:
    those it cannot (no kernels, a source whose last dim is not unit-stride, a run width
    that is no power of two)."""
    kernels = kernels_for(device)
    if kernels is None or not pairs or (device.type == "cuda" and device.index is not None
                                        and device.index != torch.cuda.current_device()):
        return [], list(pairs)
    groups, rest, multiples = {}, [], {}
    for d, s in pairs:
        s3 = _src3(s, d.shape)
        w = d.width
        if (s3 is None or d.numel() == 0 or w & (w - 1) or s3.dtype != d.dtype
                or (d.cols > 1 and s3.stride(2) != 1)):
            rest.append((d, s))
            continue
        size = d.storage.element_size()
        if s3.data_ptr() % size:
            rest.append((d, s))
            continue
        unit = _permuted_unit(d, s3, multiples)
        runs = d.cols // w
        # pairs whose runs share their largest power-of-two divisor share a tile shape
        groups.setdefault((size, unit, w, runs & -runs), []).append((d, s3))
    tables = [PermutedTable(kernels, size, unit, w, got, device)
              for (size, unit, w, _), got in groups.items()]
    return tables, rest


class KernelCopies:
    """The pairs of a batch that the kernels take: the 8-byte aligned contiguous ones in a
    ``BlockTable`` (at least ``min_blocks`` of them, else they are left), the strided ones
    that fold into tiles in a ``TileTable`` per kind, element size and vector unit;
    ``rest``: the others, for the caller's own path. Empty (everything in ``rest``)
    without kernels."""

    def __init__(self, pairs: list, device: torch.device, min_blocks: int = 1):
        self.tables: list = []
        self.device = device
        kernels = kernels_for(device)
        if kernels is None or (device.type == "cuda" and device.index is not None
                               and device.index != torch.cuda.current_device()):
            # (another device's tensors: Triton launches on the current one)
            self.rest = list(pairs)
            return
        blocks, tiles, self.rest = [], {}, []
        for d, s in pairs:
            if d.numel() == 0:
                continue
            if aligned_words(d, s):
                blocks.append((d, s))
                continue
            shape, size = tiled(d, s), d.element_size()
            if shape is None or (d.data_ptr() | s.data_ptr()) % size:
                self.rest.append((d, s))
            else:
                key = (shape.kind, size, _vector_unit((d, s), shape, size),
                       TileTable.tile_cols(shape.kind, shape.cols, size))
                tiles.setdefault(key, []).append((d, s, shape))
        if len(blocks) >= min_blocks:
            self.tables.append(BlockTable(kernels, blocks, device))
        else:
            self.rest += blocks
        for (kind, size, unit, cols), got in tiles.items():
            self.tables.append(TileTable(kernels, kind, size, unit, cols,
                                         [(d, s) for d, s, _ in got], [t for *_, t in got],
                                         device))

    def run(self) -> None:
        for table in self.tables:
            table.run()


class Replayed:
    """``fn`` (kernel launches only: it allocates nothing and never waits on the host)
    recorded as a CUDA graph after its ``after``-th eager call (0: never) and replayed
    from then on: one replay costs the host ~5 µs, a Triton launch 13-24 µs and a foreach
    copy ~10 (one H200, docs/MEASUREMENTS.md). Recorded on a side stream in thread-local
    mode; when that fails, ``error`` says why and the calls stay eager. Recorded only on the
    main thread: a refit on another thread runs beside generation (a staged refit's
    receive), and a capture in progress makes a device-wide sync on the generating thread
    fail ("operation not permitted when stream is capturing", seen on an H100 under
    scripts/bench_staged.py), so off the main thread the calls stay eager. The graph holds
    raw addresses: its owner keeps every tensor it reads and writes alive."""

    def __init__(self, fn, device: torch.device, after: int):
        self.fn, self.device, self.after = fn, device, after
        self.runs = 0
        self.graph = None
        self.error: Optional[str] = None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        self.fn()
        self.runs += 1
        if (self.runs == self.after and self.device.type == "cuda"
                and threading.current_thread() is threading.main_thread()):
            self.graph = self._capture()

    def _capture(self):
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.fn()
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - a speed-up only: keep the eager calls
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            torch.cuda.current_stream(self.device).wait_stream(side)
        return graph


def kernels_for(device: torch.device) -> Optional["_Kernels"]:
    """The copy kernels for tensors on ``device`` (CUDA only), or None."""
    return triton_kernels() if device.type == "cuda" else None


def kernels_enabled() -> bool:
    """Whether the copy kernels may be used (``MEGATRON_RESHARD_COPY_KERNELS=0``: no)."""
    return os.environ.get("MEGATRON_RESHARD_COPY_KERNELS", "1") != "0"


class _Kernels(NamedTuple):
    copy_blocks: object
    copy_tiles: object
    copy_permuted: object


def _build(triton, tl) -> _Kernels:

    @triton.jit
    def copy_blocks(dst_ptrs, src_ptrs, words, first, pair_of, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        pair = tl.load(pair_of + block)
        n = tl.load(words + pair)
        offs = (block - tl.load(first + pair)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        src = tl.load(src_ptrs + pair).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptrs + pair).to(tl.pointer_type(tl.int64))
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def copy_tiles(base, offs, meta, first, pair_of, KIND: tl.constexpr, UNIT: tl.constexpr,
                   ROW_UNIT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # meta per pair: rows, cols, dst batch and row strides, src batch and row (ROWS)
        # or col (TRANSPOSED) strides; rows in ROW_UNITs, the others in UNITs
        tile = tl.program_id(0)
        pair = tl.load(pair_of + tile)
        m = meta + pair * 8
        rows, cols = tl.load(m) * ROW_UNIT, tl.load(m + 1) * UNIT
        tiles_c = (cols + BC - 1) // BC
        per_batch = (rows + BR - 1) // BR * tiles_c
        t = (tile - tl.load(first + pair)).to(tl.int64)
        b = t // per_batch
        t = t - b * per_batch
        tr = t // tiles_c
        r = tr * BR + tl.arange(0, BR)
        c = (t - tr * tiles_c) * BC + tl.arange(0, BC)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        dst = base + (tl.load(offs + 2 * pair) + b * tl.load(m + 2)) * UNIT
        src = base + (tl.load(offs + 2 * pair + 1) + b * tl.load(m + 4)) * UNIT
        d = dst + r[:, None] * (tl.load(m + 3) * UNIT) + c[None, :]
        if KIND == 0:  # ROWS
            s = src + r[:, None] * (tl.load(m + 5) * UNIT) + c[None, :]
        else:          # TRANSPOSED: the source's unit stride runs along the rows
            s = src + r[:, None] + c[None, :] * (tl.load(m + 5) * UNIT)
        tl.store(d, tl.load(s, mask=mask), mask=mask)

    @triton.jit
    def copy_permuted(base, offs, meta, outer_ptrs, inner_ptrs, first, pair_of,
                      UNIT: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
        # meta per pair: outer, inner, runs, src outer and inner strides, apart (units)
        tile = tl.program_id(0)
        pair = tl.load(pair_of + tile)
        m = meta + pair * 8
        inner_n, runs = tl.load(m + 1), tl.load(m + 2)
        rows = tl.load(m) * inner_n
        tiles_c = (runs + NB - 1) // NB
        t = (tile - tl.load(first + pair)).to(tl.int64)
        tr = t // tiles_c
        i = tr * BR + tl.arange(0, BR)
        b = (t - tr * tiles_c) * NB + tl.arange(0, NB)
        live = i < rows
        o = i // inner_n
        r = i - o * inner_n
        outer = tl.load(outer_ptrs + pair).to(tl.pointer_type(tl.int64))
        inner = tl.load(inner_ptrs + pair).to(tl.pointer_type(tl.int64))
        row = (tl.load(outer + o, mask=live, other=0) + tl.load(inner + r, mask=live, other=0)) // UNIT
        srow = o * tl.load(m + 3) + r * tl.load(m + 4)
        k = tl.arange(0, W)[None, None, :]
        d = base + ((tl.load(offs + 2 * pair) + row)[:, None, None]
                    + (b * tl.load(m + 5))[None, :, None]) * UNIT + k
        s = base + ((tl.load(offs + 2 * pair + 1) + srow)[:, None, None]
                    + (b * (W // UNIT))[None, :, None]) * UNIT + k
        mask = live[:, None, None] & (b < runs)[None, :, None]  # broadcast along the run
        tl.store(d, tl.load(s, mask=mask), mask=mask)

    return _Kernels(copy_blocks, copy_tiles, copy_permuted)


_built = built_once(_build)


def triton_kernels() -> Optional[_Kernels]:
    """The copy kernels (built once); None when Triton is absent or they are switched off."""
    return _built() if kernels_enabled() else None
