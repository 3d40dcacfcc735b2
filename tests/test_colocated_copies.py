"""A colocated refit's copy batch (``engine/colocated_copies.py``) run again and again:
every run copies the sources' current bits (on CUDA: the second run on replays a captured
graph), across the three ways a pair is issued."""

import pytest
import torch

from megatron_reshard.engine.colocated_copies import CopyBatch
from megatron_reshard.engine.copies import MEMCPY_BYTES


def _pairs(device) -> list:
    """One pair per way a pair is issued: a memcpy (contiguous, large), the pointer table
    (contiguous, 8-byte aligned; three of them so the table is used), the foreach (a
    strided destination), and a strided source cut into contiguous sub-pairs."""
    big = MEMCPY_BYTES // 2 + 64  # bfloat16 elements: just over the memcpy size
    srcs = [torch.empty(big, dtype=torch.bfloat16, device=device),
            *(torch.empty(3, 256, dtype=torch.bfloat16, device=device) for _ in range(3)),
            torch.empty(5, 7, dtype=torch.float32, device=device),
            torch.empty(4, 6, 32, dtype=torch.bfloat16, device=device)[:, 1:3]]
    dsts = [torch.zeros(big, dtype=torch.bfloat16, device=device),
            *(torch.zeros(3, 256, dtype=torch.bfloat16, device=device) for _ in range(3)),
            torch.zeros(5, 14, dtype=torch.float32, device=device)[:, ::2],
            torch.zeros(4, 2, 32, dtype=torch.bfloat16, device=device)]
    return list(zip(dsts, srcs))


def _refill(pairs, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, src in pairs:  # random bits, NaN payloads included: copies must keep them all
        bits = torch.randint(-2**15, 2**15, src.shape, generator=g, dtype=torch.int32)
        src.copy_(bits.to(torch.int16).view(torch.bfloat16).to(src.device)
                  if src.dtype == torch.bfloat16 else bits.to(src.dtype).to(src.device))


def _check_runs(device) -> CopyBatch:
    pairs = _pairs(device)
    batch = CopyBatch(pairs, device)
    for seed in range(4):
        _refill(pairs, seed)
        batch.run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for k, (dst, src) in enumerate(pairs):
            assert torch.equal(dst.contiguous().view(torch.uint8).cpu(),
                               src.contiguous().view(torch.uint8).cpu()), (seed, k)
    return batch


def test_a_copy_batch_copies_the_current_bits_at_every_run_on_cpu():
    batch = _check_runs(torch.device("cpu"))
    assert batch.graph is None and batch.graph_error is None  # no graphs on CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_batch_replays_its_captured_graph_with_the_current_bits():
    batch = _check_runs(torch.device("cuda"))
    assert batch.graph_error is None, batch.graph_error
    assert batch.graph is not None and batch.runs == 1  # runs 2-4 were replays
