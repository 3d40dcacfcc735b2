"""Packed broadcast carries many full tensors bit-exact, over registered and raw groups."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_reshard.refit.packed import (broadcast_packed, buffer_bytes, chunk_items, pack,
                                     pack_entries, unpack)
from megatron_reshard.tools.worlds import init_gloo_world

ITEMS = [("a", (3, 5), torch.bfloat16), ("b", (), torch.float32), ("c", (7,), torch.int8),
         ("d", (2, 0, 4), torch.float16), ("e", (4, 4), torch.float8_e4m3fn)]


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape, dtype in ITEMS}


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_pack_then_unpack_is_bit_exact():
    entries = pack_entries(ITEMS)
    src = _tensors(0)
    out = unpack(entries, pack(entries, src, torch.device("cpu")))
    assert all(_same_bits(out[n], src[n]) for n in src)
    assert all(e.offset % 16 == 0 for e in entries)


def test_pack_names_the_param_with_the_wrong_shape():
    entries = pack_entries(ITEMS)
    bad = _tensors(0)
    bad["c"] = torch.zeros(8, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"'c' expected shape \[7\].*found shape \[8\]"):
        pack(entries, bad, torch.device("cpu"))


def _broadcast_job(job, raw_group):
    entries = pack_entries(ITEMS)
    if raw_group:  # a group that c10d does not know about, as across two worlds
        store = dist.PrefixStore("packed", dist.TCPStore(job.host, job.ports[1], job.nprocs,
                                                         job.rank == 0, timedelta(seconds=30)))
        group = dist.ProcessGroupGloo(store, job.rank, job.nprocs, timedelta(seconds=30))
    else:
        init_gloo_world(job)
        group = None
    root = 1
    mine = _tensors(42) if job.rank == root else None
    out = broadcast_packed(entries, group, root, torch.device("cpu"), mine)
    expected = _tensors(42)
    return all(_same_bits(out[n], expected[n]) for n in expected)


@pytest.mark.parametrize("raw_group", [False, True])
def test_broadcast_reaches_every_rank_bit_exact(pool, raw_group):
    assert pool.run(_broadcast_job, 3, raw_group, timeout_s=60) == [True, True, True]


def test_chunks_fit_the_budget_and_keep_order():
    items = [(f"p{i}", (i + 1, 8), torch.float32) for i in range(10)]  # 32..320 bytes each
    chunks = chunk_items(items, 400)
    assert [it for chunk in chunks for it in chunk] == items
    assert len(chunks) > 1
    assert all(buffer_bytes(pack_entries(c)) <= 400 for c in chunks if len(c) > 1)


def test_an_item_larger_than_the_budget_travels_alone():
    items = [(f"p{i}", (64,), torch.float32) for i in range(3)]  # 256 bytes each
    assert chunk_items(items, 100) == [[it] for it in items]


def test_pack_takes_strided_views_without_changing_their_bits():
    base = torch.randn(6, 4).to(torch.bfloat16)
    view = base.t()  # [4, 6], not contiguous
    entries = pack_entries([("v", (4, 6), torch.bfloat16)])
    out = unpack(entries, pack(entries, {"v": view}, torch.device("cpu")))
    assert torch.equal(out["v"], view)
