"""``receiver.online_quant.OnlineBlockFp8``: the matrices vLLM quantizes online are gathered
whole and quantized by the function found in vLLM's module, once each (vLLM-free; the
refits into vLLM's own online layers are in tests/real_vllm/test_online_fp8.py).

The function sits in a module object standing for vLLM's ``quantization.online.fp8``; it
records each matrix it is called on and quantizes with ``fp8.quant`` (bit-identical to
vLLM's ``per_block_cast_to_fp8`` on the CPU: test_online_fp8.py).
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_reshard.fp8.quant import quantize_blockwise_fp8
from megatron_reshard.receiver.online_quant import (OnlineBlockFp8, OnlineQuantError,
                                                     VllmBlockQuantizer)
from megatron_reshard.receiver.target_plan import Piece, TargetError, TargetPlan
from megatron_reshard.receiver.targets import VllmTargets

W13 = "layers.1.experts.w13_weight"
SCALE = W13 + "_scale_inv"
E, N, K = 2, 256, 128  # two experts: gate rows 0..127, up rows 128..255


def _setup():
    calls = []

    def per_block_cast_to_fp8(x, block_size=None, use_ue8m0=False):
        calls.append((tuple(x.shape), x.dtype, list(block_size), use_ue8m0))
        return quantize_blockwise_fp8(x)

    module = types.ModuleType("online_fp8_module")
    module.per_block_cast_to_fp8 = per_block_cast_to_fp8
    params = {W13: torch.zeros(E, N, K, dtype=torch.float8_e4m3fn),
              SCALE: torch.zeros(E, N // 128, 1)}
    online = OnlineBlockFp8({W13: VllmBlockQuantizer("layers.1.experts", module, (128, 128),
                                                     torch.bfloat16)})
    targets = VllmTargets.from_named_parameters(params, None, 0, 1, label="gen rank 0",
                                                quantizers=online)
    return targets, online, calls


def _half(rows: tuple[int, int]) -> tuple[Piece, Piece]:
    box = ((0, E), rows, (0, K))
    tiles = ((0, E), (rows[0] // 128, rows[1] // 128), (0, 1))
    return Piece(W13, box, box), Piece(SCALE, tiles, tiles)


def test_each_expert_is_quantized_whole_by_vllms_function_once_its_last_piece_arrives():
    targets, online, calls = _setup()
    full = torch.randn(E, N, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    online.begin()
    gate, up = _half((0, 128)), _half((128, 256))
    online.write(targets, *gate, full[:, :128].float())  # fp32 on the wire: cast as vLLM's loader
    assert calls == [] and online.report()["pending_bytes"] == E * N * K * 2
    online.write(targets, *up, full[:, 128:])
    assert calls == [((N, K), torch.bfloat16, [128, 128], False)] * E  # per expert, whole
    online.finish("gen rank 0")
    for e in range(E):
        q, s = quantize_blockwise_fp8(full[e])
        assert torch.equal(targets.params[W13][e].view(torch.uint8), q.view(torch.uint8)), e
        assert torch.equal(targets.params[SCALE][e], s), e
    stats = online.report()
    assert stats["matrices"] == E and stats["pending_bytes"] == 0
    assert stats["peak_pending_bytes"] == E * N * K * 2


def test_a_matrix_left_incomplete_is_a_loud_error_and_the_next_refit_starts_clean():
    targets, online, calls = _setup()
    online.begin()
    online.write(targets, *_half((0, 128)), torch.ones(E, 128, K))
    with pytest.raises(OnlineQuantError, match=r"gen rank 0: the refit left 2 matrices .*"
                                               r"w13_weight\[0\]"):
        online.finish("gen rank 0")
    online.write(targets, *_half((128, 256)), torch.ones(E, 128, K))  # not completed by stale halves
    assert calls == [] and online.report()["pending_bytes"] == E * N * K * 2


def test_a_plan_that_covers_a_matrix_in_part_or_twice_is_refused_at_prepare():
    targets, online, _ = _setup()
    gate, up = _half((0, 128)), _half((128, 256))
    plan = lambda *pieces: TargetPlan("w", (E, N, K), pieces=list(pieces))  # noqa: E731
    online.check_coverage(targets.params, [plan(gate[0], gate[1]), plan(up[0])], "gen rank 0")
    for plans, found in (([plan(gate[0])], 128 * K), ([plan(gate[0]), plan(up[0]), plan(up[0])],
                                                      (N + 128) * K)):
        with pytest.raises(TargetError) as err:
            online.check_coverage(targets.params, plans, "gen rank 0")
        assert (f"'{W13}' expert 0 on gen rank 0: vLLM quantizes it online as one [{N}, {K}] "
                f"matrix" in str(err.value)), str(err.value)
        assert f"expected {N * K} elements written once, found {found}" in str(err.value)
