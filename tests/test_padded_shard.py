"""Padded shards (vocab matrices): owned rows travel, padding rows never do."""

import pytest
import torch
from torch.distributed.tensor import Replicate

from megatron_reshard.engine import Transfer, xfer_batch
from megatron_reshard.layout.geometry import rank_region
from megatron_reshard.layout.placements import (
    MeshInfo,
    PaddedShard,
    placements_to_plain,
    restore_placement,
)
from megatron_reshard.tools.worlds import init_gloo_world

TWO = MeshInfo(torch.tensor([0, 1]))


def test_a_padded_shard_owns_equal_chunks_of_the_padded_size_clipped_at_the_real_size():
    # 500 real rows padded to 768 over 2 ranks: chunks of 384, the second owns 116 real rows
    assert rank_region((500, 8), TWO, [PaddedShard(0, 768)], 0) == (((0, 384), (0, 8)), (384, 8))
    assert rank_region((500, 8), TWO, [PaddedShard(0, 768)], 1) == (((384, 500), (0, 8)), (384, 8))


def test_a_rank_whose_chunk_is_all_padding_owns_nothing_but_keeps_its_local_shape():
    four = MeshInfo(torch.tensor([0, 1, 2, 3]))
    assert rank_region((100, 2), four, [PaddedShard(0, 256)], 3) == (((100, 100), (0, 2)), (64, 2))


@pytest.mark.parametrize("padded", [400, 769])
def test_a_padded_size_smaller_than_the_tensor_or_not_divisible_is_refused(padded):
    with pytest.raises(ValueError, match="padded size"):
        rank_region((500, 8), TWO, [PaddedShard(0, padded)], 0)


def test_wire_form_round_trips():
    plain = placements_to_plain([PaddedShard(0, 768), Replicate()])
    assert plain == [{"dim": 0, "padded": 768}, {}]
    assert [restore_placement(p) for p in plain] == [PaddedShard(0, 768), Replicate()]


FULL = torch.arange(500 * 8, dtype=torch.float32).reshape(500, 8)


def _job(job):
    init_gloo_world(job)
    src_mesh, dst_mesh = MeshInfo(torch.tensor([0, 1])), MeshInfo(torch.tensor([2, 3]))
    src = dst = None
    if job.rank < 2:  # Megatron-like: 768 padded rows, 384 per rank, padding is garbage
        src = torch.full((384, 8), -7.0)
        rows = FULL[job.rank * 384: (job.rank + 1) * 384]
        src[: rows.shape[0]] = rows
    else:  # vLLM-like: 512 padded rows, 256 per rank, padding must stay as it is
        dst = torch.full((256, 8), 99.0)
    xfer_batch([Transfer("embed", (500, 8), torch.float32, src_mesh, [PaddedShard(0, 768)],
                         dst_mesh, [PaddedShard(0, 512)], src=src, dst=dst)], None)
    if dst is None:
        return True
    start = (job.rank - 2) * 256
    owned = FULL[start: start + 256]
    return (torch.equal(dst[: owned.shape[0]], owned)
            and bool((dst[owned.shape[0]:] == 99.0).all()))


def test_engine_moves_owned_rows_between_different_paddings(pool):
    assert pool.run(_job, 4, timeout_s=60) == [True] * 4
