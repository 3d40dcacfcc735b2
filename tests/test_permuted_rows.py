"""Writing straight into a kernel's permuted-row order (issue 34): ``KernelOrder
.permuted_rows`` (index math, CPU) and the copy kernel of ``engine.kernel_copies``
(``PermutedTable``), bit for bit against the conversion the order was learned from.

The orders are learned (``receiver.kernel_layouts.learn_order``) from conversions written
for the test: a padded row permutation into column blocks (the shape of FlashInfer
TRTLLM's block layout) and a half swap (FlashInfer CUTLASS's [up; gate]). The kernel
tests run on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` with Triton installed;
else they skip.
"""

from __future__ import annotations


import pytest
import torch

from megatron_reshard.engine.colocated_copies import CopyBatch
from megatron_reshard.engine.kernel_copies import permuted_tables
from megatron_reshard.receiver.kernel_layouts import learn_order
from megatron_reshard.vllm_layout.kernel_order import KernelOrder, contiguous_terms
from test_kernel_copies import device  # noqa: F401 - the kernels' device fixture (CUDA or interpreter)

E, R, C, KEEP, B = 3, 32, 128, 12, 16  # experts, rows (two halves), columns, kept rows, block
ROWS = torch.randperm(R, generator=torch.Generator().manual_seed(5))


def blocks(w):
    """Zero rows KEEP.. of each half, permute rows, store B-column blocks block-major."""
    w = w.clone()
    w[:, KEEP:R // 2] = 0
    w[:, R // 2 + KEEP:] = 0
    w = w[:, ROWS]
    return w.reshape(w.shape[0], R, C // B, B).permute(0, 2, 1, 3).contiguous().reshape(w.shape)


def half_swap(w):
    return w.reshape(w.shape[0], 2, -1, w.shape[-1]).flip(1).reshape(w.shape)


def _order(convert) -> KernelOrder:
    return KernelOrder("test", learn_order(lambda a: [convert(a)], [(E, R, C)])[0])


BOXES = [((0, E), (0, KEEP), (0, C)), ((0, E), (R // 2, R // 2 + KEEP), (0, C))]


def _values(w, box):
    return w[tuple(slice(a, b) for a, b in box)]


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def test_column_runs_of_a_block_layout_and_of_checkpoint_order():
    order = _order(blocks)
    assert order.column_runs(BOXES[0]) == (0, B, R * B)
    assert order.column_runs(((0, E), (0, KEEP), (B, 3 * B))) == (R * B, B, R * B)
    assert order.column_runs(((0, E), (0, KEEP), (4, C))) is None  # cuts a run
    plain = KernelOrder("plain", contiguous_terms((E, R, C)))
    assert plain.column_runs(((0, E), (0, R), (0, 96))) == (0, 32, 32)  # 96 = 3 x 32


@pytest.mark.parametrize("convert", [blocks, half_swap])
def test_permuted_rows_write_the_conversions_bytes(convert):
    """The torch path of ``PermutedRows`` (what runs where the kernel does not), whole boxes
    and per expert as members arrive, against the conversion itself."""
    order, w = _order(convert), torch.randn(E, R, C).to(torch.bfloat16)
    want = convert(w)
    for boxes in (BOXES, [((e, e + 1), r, c) for e in range(E) for _, r, c in BOXES]):
        storage = torch.zeros_like(w)
        for box in boxes:
            rows = order.permuted_rows(storage, box)
            assert rows is not None and rows.shape == tuple(b - a for a, b in box)
            rows.write(_values(w, box))
        if convert is blocks:
            assert torch.equal(_bits(storage), _bits(want))
        else:  # the half swap: only the rows of the boxes were written
            sel = [r for _, (a, b), _ in BOXES for r in range(a, b)]
            got = storage.reshape(E, 2, R // 2, C).flip(1).reshape(E, R, C)
            assert torch.equal(_bits(got[:, sel]), _bits(w[:, sel]))
    if convert is blocks:  # a box reaching the padding vLLM keeps
        assert order.permuted_rows(torch.zeros_like(w), ((0, E), (0, KEEP + 1), (0, C))) is None


def test_a_planted_row_error_is_visible():
    order = _order(blocks)
    rows = order.terms[1].clone()
    rows[[0, 1]] = rows[[1, 0]]
    bad = KernelOrder("test", (order.terms[0], rows, order.terms[2]))
    w = torch.randn(E, R, C).to(torch.bfloat16)
    storage = torch.zeros_like(w)
    for box in BOXES:
        bad.permuted_rows(storage, box).write(_values(w, box))
    assert not torch.equal(_bits(storage), _bits(blocks(w)))




def _nan_bits(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8,
                      generator=g)
    if dtype.itemsize == 2:
        x.view(torch.int16)[:4] = torch.tensor([0x7F81, -0x8000, 0x7FC1, -1], dtype=torch.int16)
    return x.view(dtype).view(shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("convert", [blocks, half_swap])
def test_the_kernel_writes_the_conversions_bytes(device, dtype, convert):
    """Sources as a column block of a wider tensor (rows not contiguous) and as one tensor
    per expert (members), NaN payloads among the bits; the kernel is the only writer."""
    order = _order(convert)
    order = KernelOrder(order.backend, tuple(t.to(device) for t in order.terms))
    w = _nan_bits((E, R, C), dtype, 1)
    wide = torch.zeros(E, R, C + 2 * B, dtype=dtype)
    wide[:, :, B:B + C] = w
    src = wide.to(device)[:, :, B:B + C]
    storage = torch.zeros((E, R, C), dtype=dtype, device=device)
    pairs = []
    for box in BOXES:
        rows = order.permuted_rows(storage, box)
        pairs += [(rows, _values(src, box))]
        # per expert, as a stacked destination filled from members
        pairs += list(zip(rows.unbind(0), [_values(src, box)[e] for e in range(E)]))
    tables, rest = permuted_tables(pairs, device)
    assert rest == [] and tables
    for t in tables:
        t.run()
    want = convert(w)
    if convert is blocks:
        assert torch.equal(_bits(storage.cpu()), _bits(want))
    else:
        sel = [r for _, (a, b), _ in BOXES for r in range(a, b)]
        got = storage.cpu().reshape(E, 2, R // 2, C).flip(1).reshape(E, R, C)
        assert torch.equal(_bits(got[:, sel]), _bits(w[:, sel]))


def test_scatter_and_the_colocated_copy_batch_take_the_kernel(device):
    """``KernelOrder.scatter`` on the device and a colocated ``CopyBatch`` whose destination
    is a ``PermutedRows`` (twice: the second run replays its CUDA graph on CUDA)."""
    order = _order(blocks)
    order = KernelOrder(order.backend, tuple(t.to(device) for t in order.terms))
    w = _nan_bits((E, R, C), torch.bfloat16, 2).to(device)
    want = blocks(w.cpu())
    storage = torch.zeros_like(w)
    for box in BOXES:
        if device.type == "cuda":
            order.scatter(storage, box, _values(w, box))
        else:
            assert order._scatter_by_kernel(storage, box, _values(w, box))
    assert torch.equal(_bits(storage.cpu()), _bits(want))
    storage.zero_()
    members = [w[e] for e in range(E)]
    pairs = []
    for _, rows, cols in BOXES:
        dst = order.permuted_rows(storage, ((0, E), rows, cols))
        pairs += list(zip(dst.unbind(0), [m[rows[0]:rows[1]] for m in members]))
    batch = CopyBatch(pairs, device)
    assert batch.permuted and not batch.permuted_rest
    for _ in range(2):
        storage.zero_()
        batch.run()
        assert torch.equal(_bits(storage.cpu()), _bits(want))


@pytest.mark.parametrize("rows_per_tile", [1, 8, 64])
@pytest.mark.parametrize("col_boxes", [[(0, 3 * B), (3 * B, 6 * B), (6 * B, C)],
                                       [(0, 6 * B), (6 * B, C)]])
def test_tiles_of_any_shape_cover_column_sub_boxes(device, monkeypatch, rows_per_tile,
                                                   col_boxes):
    """Column sub-boxes of 3, 3 and 2 runs, or of 6 and 2 runs (tiles of 2 runs: a power
    of two dividing both), with tiles from one row to more rows than a box holds."""
    from megatron_reshard.engine.kernel_copies import PermutedTable

    monkeypatch.setattr(PermutedTable, "ROWS", rows_per_tile)
    order = _order(blocks)
    order = KernelOrder(order.backend, tuple(t.to(device) for t in order.terms))
    w = _nan_bits((E, R, C), torch.bfloat16, 3).to(device)
    storage = torch.zeros_like(w)
    pairs = [(order.permuted_rows(storage, (e, r, c)), _values(w, (e, r, c)))
             for e, r, _ in BOXES for c in col_boxes]
    tables, rest = permuted_tables(pairs, device)
    # 3, 3 and 2 runs: a table of odd run counts (tiles of one run) and one of 2 runs
    # (tiles of 2); 6 and 2 runs: one table, tiles of 2
    assert rest == [] and len(tables) == (2 if col_boxes[0][1] == 3 * B else 1)
    assert sorted(t.nb for t in tables) == ([1, 2] if col_boxes[0][1] == 3 * B else [2])
    for t in tables:
        t.run()
    want = blocks(w.cpu())
    assert torch.equal(_bits(storage.cpu()), _bits(want))


def _engine_into_rows(job, cases):
    """Ranks 0-2 of a gloo world: for each case, the training side shards an expert tensor
    over ``src`` ranks, the generation side (``dst`` ranks, replicated) writes it into a
    storage in the ``blocks`` order through ``PermutedRows`` destinations: local copies
    where a rank is on both sides, staged unpacks of what it receives. Two calls per
    case with new values (the second runs the kept program and copy batches). Returns each
    generation rank's storages (bits) and what it was sent."""
    from megatron_reshard.engine import Planner, Transfer, xfer_batch
    from megatron_reshard.layout.placements import MeshInfo
    from megatron_reshard.tools.worlds import init_gloo_world
    from torch.distributed.tensor import Replicate, Shard

    init_gloo_world(job)
    order = _order(blocks)
    planner, out = Planner(), []
    for src_ranks, shard_dim, dst_ranks, fused in cases:
        got = []
        for call in range(2):
            transfers, storages, sent = [], [], []
            for p in range(2 if fused else 1):  # two small params of one layout fuse
                w = _nan_bits((E, R, C), torch.bfloat16, 10 * call + p)
                sent.append(w)
                src = dst = None
                if job.rank in src_ranks:
                    n = len(src_ranks)
                    part = src_ranks.index(job.rank)
                    src = w.tensor_split(n, dim=shard_dim)[part].contiguous()
                storage = torch.zeros(E, R, C, dtype=torch.bfloat16)
                storages.append(storage)
                if job.rank in dst_ranks:
                    dst = order.permuted_rows(storage, BOXES[p % 2])
                box_w = _values(w, BOXES[p % 2])
                t = Transfer(f"experts{p}", tuple(box_w.shape), torch.bfloat16,
                             MeshInfo(torch.tensor(src_ranks)), [Shard(shard_dim)],
                             MeshInfo(torch.tensor(dst_ranks)), [Replicate()],
                             src if src is None else box_w.tensor_split(
                                 len(src_ranks), dim=shard_dim)[src_ranks.index(job.rank)],
                             dst)
                transfers.append(t)
            xfer_batch(transfers, None, planner=planner, staging_bytes=1 << 20)
            got.append(([_bits(s) for s in storages], [_bits(w) for w in sent]))
        out.append(got)
    return out


@pytest.mark.parametrize("cases", [
    # rows split over two training ranks, one of them also a generation rank (a local copy
    # and a staged unpack on it, unpacks only on the other)
    [([0, 1], 1, [1, 2], False)],
    # columns split in three: pieces that cut the 16-column runs (the index-copy path)
    # and two small params of one layout, fused (their image written into the order)
    [([0, 1, 2], 2, [1, 2], False), ([0], 1, [1, 2], True)],
])
def test_the_engine_unpacks_and_copies_straight_into_permuted_rows(pool, cases):
    """Over a real gloo group: the generation ranks' storages equal the conversion
    (``blocks``) of what was sent, bit for bit, padding untouched, after each call."""
    results = pool.run(_engine_into_rows, 3, cases, timeout_s=120)
    for rank in (1, 2):
        for (_, _, dst_ranks, _), calls in zip(cases, results[rank]):
            for storages, sent in calls:
                for p, (got, w) in enumerate(zip(storages, sent)):
                    box = BOXES[p % 2]
                    full = torch.zeros(E, R, C, dtype=torch.bfloat16)
                    full[tuple(slice(a, b) for a, b in box)] = \
                        _values(w.view(torch.bfloat16), box)
                    assert torch.equal(got, _bits(blocks(full))), (rank, p)


def test_an_engine_copy_batch_writes_permuted_rows_through_the_kernel(device):
    """The engine's ``Copies`` with permuted-row destinations (local copies and unpacks
    of the process-group path): whole boxes go to the permuted-row kernel, a box that cuts
    runs to the index copy, a tensor read from the order (a forwarded send) to a gather;
    three runs (the third replays the batch's CUDA graph on CUDA), bit for bit."""
    from megatron_reshard.engine.copies import Copies

    order = _order(blocks)
    order = KernelOrder(order.backend, tuple(t.to(device) for t in order.terms))
    w = _nan_bits((E, R, C), torch.bfloat16, 4).to(device)
    storage = torch.zeros_like(w)
    copies = Copies()
    for e, rows, _ in BOXES:  # each box in two, cut at column 40 (inside a run)
        dst = order.permuted_rows(storage, (e, rows, (0, C)))
        copies.exact(dst.box((slice(0, E), slice(0, rows[1] - rows[0]), slice(0, 40))),
                     _values(w, (e, rows, (0, 40))))
        copies.exact(dst.box((slice(0, E), slice(0, rows[1] - rows[0]), slice(40, C))),
                     _values(w, (e, rows, (40, C))))
    copies.exact(order.permuted_rows(storage, BOXES[0]).box(
        (slice(0, E), slice(0, KEEP), slice(B, 3 * B))), _values(w, (BOXES[0][0], BOXES[0][1],
                                                                       (B, 3 * B))))
    back = torch.zeros(E, KEEP, C, dtype=torch.bfloat16, device=device)
    reader = Copies()
    reader.exact(back, order.permuted_rows(storage, BOXES[1]))
    want = blocks(w.cpu())
    for _ in range(3):
        storage.zero_()
        copies.run()
        assert torch.equal(_bits(storage.cpu()), _bits(want))
        reader.run()
        assert torch.equal(_bits(back.cpu()), _bits(_values(w, BOXES[1]).cpu()))
    if device.type == "cuda" or copies.row_tables:  # the kernel took the whole-run boxes
        assert len(copies.row_tables) == 1 and len(copies.rows) == 4


def test_the_colocated_copy_batch_takes_boxes_that_cut_runs():
    """A colocated read whose box cuts the order's runs (a train split off the 16-column
    blocks): its elements' offsets, filled per expert from members, written by index
    copies; the rest of the box through the permuted rows. Bit for bit."""
    from megatron_reshard.engine.colocated_copies import _paired

    order = _order(blocks)
    w = _nan_bits((E, R, C), torch.bfloat16, 5)
    storage = torch.zeros_like(w)
    pairs = []
    for e, rows, _ in BOXES:
        dst = order.permuted_rows(storage, (e, rows, (0, C)))
        n = rows[1] - rows[0]
        for c0, c1 in ((0, 40), (40, C)):
            members = [w[k, rows[0]:rows[1], c0:c1] for k in range(E)]
            pairs += _paired([dst.box((slice(0, E), slice(0, n), slice(c0, c1)))], members)
    batch = CopyBatch(pairs, torch.device("cpu"))
    assert batch.pairs == 4 * E
    batch.run()
    assert torch.equal(_bits(storage), _bits(blocks(w)))


def test_checksums_read_a_permuted_row_destination_in_checkpoint_order():
    """``verify_checksums`` on a generation rank whose buffer is the order's storage: the
    box's checksum is that of its checkpoint-order values, and a planted wrong row (its
    bytes in another slot) changes it."""
    from megatron_reshard.refit.checksums import buffer_checksum

    order = _order(blocks)
    w = _nan_bits((E, R, C), torch.bfloat16, 6)
    storage = torch.zeros_like(w)
    box = BOXES[1]
    rows = order.permuted_rows(storage, box)
    rows.write(_values(w, box))
    origin = tuple(a for a, _ in box)
    want = buffer_checksum(_values(w, box).clone(), box, origin)
    assert torch.equal(buffer_checksum(rows, box, origin), want)
    storage.view(-1)[rows.offsets()[0, 0]] = storage.view(-1)[rows.offsets()[0, 1]]
    assert not torch.equal(buffer_checksum(rows, box, origin), want)
