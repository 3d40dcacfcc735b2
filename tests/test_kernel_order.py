"""``receiver.kernel_layouts.learn_order`` and ``vllm_layout.kernel_order.KernelOrder``:
learning where a conversion puts each element, and writing boxes through that order.

The conversions here are written for the test (vLLM's own ones are exercised in
``tests/real_vllm/test_moe_kernel_layouts.py``): a half swap (the shape of FlashInfer
CUTLASS's [up; gate]), a padded row permutation into column blocks (the shape of TRTLLM's
block layout), and conversions that must be refused: one that computes values, one whose
placement depends on the values, one that is not separable per dim.
"""

from __future__ import annotations

import pytest
import torch

from megatron_reshard.receiver.kernel_layouts import learn_order
from megatron_reshard.vllm_layout.kernel_order import KernelOrder, is_checkpoint_order

E, R, C, KEEP = 2, 16, 24, 6  # experts, rows (two halves of 8), columns; rows kept per half


def half_swap(w):
    return w.reshape(w.shape[0], 2, -1, w.shape[-1]).flip(1).reshape(w.shape)


ROWS = torch.tensor([5, 0, 7, 2, 4, 1, 6, 3, 13, 8, 15, 10, 12, 9, 14, 11])


def padded_blocks(w):
    """Zero rows KEEP.. of each half, permute rows, store 8-column blocks block-major."""
    w = w.clone()
    w[:, KEEP:R // 2] = 0
    w[:, R // 2 + KEEP:] = 0
    w = w[:, ROWS]
    return w.reshape(w.shape[0], R, C // 8, 8).permute(0, 2, 1, 3).contiguous().reshape(w.shape)


def _learn(convert):
    return learn_order(lambda a: [convert(a)], [(E, R, C)])[0]


def _write_through(order: KernelOrder, w: torch.Tensor, boxes) -> torch.Tensor:
    storage = torch.zeros_like(w)
    for box in boxes:
        values = w[tuple(slice(a, b) for a, b in box)]
        view = order.view(storage, box)
        if view is None:
            order.scatter(storage, box, values)
        else:
            view.copy_(values)
    return storage


def _bits(t):
    return t.view(torch.int16)


def test_checkpoint_order_is_recognised():
    terms = _learn(lambda w: w.clone())
    assert is_checkpoint_order(terms)


def test_a_half_swap_is_written_as_strided_views():
    terms = _learn(half_swap)
    order = KernelOrder("swap", terms)
    assert not is_checkpoint_order(terms)
    w = torch.randn(E, R, C).to(torch.bfloat16)
    boxes = [((0, E), (0, R // 2), (0, C)), ((0, E), (R // 2, R), (0, C))]
    assert all(order.view(torch.zeros_like(w), b) is not None for b in boxes)
    assert torch.equal(_bits(_write_through(order, w, boxes)), _bits(half_swap(w)))


def test_a_padded_block_layout_is_scattered_and_keeps_its_padding():
    order = KernelOrder("blocks", _learn(padded_blocks))
    w = torch.randn(E, R, C).to(torch.bfloat16)
    boxes = [((0, E), (0, KEEP), (0, C)), ((0, E), (R // 2, R // 2 + KEEP), (0, C))]
    assert order.view(torch.zeros_like(w), boxes[0]) is None
    assert torch.equal(_bits(_write_through(order, w, boxes)), _bits(padded_blocks(w)))
    # one expert at a time, as per-expert names arrive
    per_expert = [((e, e + 1), rows, cols) for e in range(E) for _, rows, cols in boxes]
    assert torch.equal(_bits(_write_through(order, w, per_expert)), _bits(padded_blocks(w)))
    problem = order.padding_problem(((0, E), (0, KEEP + 1), (0, C)))
    assert "padding" in problem


def test_a_planted_mapping_error_is_visible():
    terms = list(_learn(padded_blocks))
    rows = terms[1].clone()
    rows[[0, 1]] = rows[[1, 0]]
    order = KernelOrder("blocks", (terms[0], rows, terms[2]))
    w = torch.randn(E, R, C).to(torch.bfloat16)
    boxes = [((0, E), (0, KEEP), (0, C)), ((0, E), (R // 2, R // 2 + KEEP), (0, C))]
    assert not torch.equal(_bits(_write_through(order, w, boxes)), _bits(padded_blocks(w)))


@pytest.mark.parametrize("convert,why", [
    (lambda w: -w, "computes values"),
    (lambda w: torch.sort(w.view(torch.int16), dim=-1)[0].view(torch.bfloat16), "depends on the values"),
    (lambda w: torch.stack([torch.roll(w[:, i], i, dims=-1) for i in range(R)], dim=1),
     "not separable"),
])
def test_conversions_that_are_not_rearrangements_are_refused(convert, why):
    with pytest.raises(ValueError, match=why):
        _learn(convert)


def test_a_conversion_that_changes_the_shape_is_refused():
    with pytest.raises(ValueError, match="not checkpoint-shaped"):
        learn_order(lambda a: [a.reshape(E, C, R)], [(E, R, C)])


def test_block_aligned_boxes_take_one_row_copy_and_others_the_general_scatter():
    """Both scatter paths give the conversion's bytes: a box of whole 8-column blocks goes
    as one ``index_copy_`` of rows, a box cutting a block through per-element offsets."""
    order = KernelOrder("blocks", _learn(padded_blocks))
    w = torch.randn(E, R, C).to(torch.bfloat16)
    whole = ((0, E), (0, KEEP), (0, C))
    assert order._scatter_rows_of_blocks(torch.zeros_like(w), whole, w[:, :KEEP]) is True
    cut = ((0, E), (0, KEEP), (0, 12))
    assert order._scatter_rows_of_blocks(torch.zeros_like(w), cut, w[:, :KEEP, :12]) is False
    halves = [((0, E), rows, cols) for rows in ((0, KEEP), (R // 2, R // 2 + KEEP))
              for cols in ((0, 12), (12, C))]
    assert torch.equal(_bits(_write_through(order, w, halves)), _bits(padded_blocks(w)))


def _moe_method_in_module(convert):
    """An unquantized MoE method (Triton backend) whose module holds ``convert`` under vLLM's
    name for it, as vLLM's ``unquantized_fused_moe_method`` module does."""
    import enum
    import sys
    import types

    module = types.ModuleType("fake_vllm_moe_method")
    module.convert_to_unquantized_kernel_format = convert
    backend = enum.Enum("UnquantizedMoeBackend", "TRITON FLASHINFER_CUTLASS").TRITON
    method = type("UnquantizedFusedMoEMethod", (), {"__module__": module.__name__,
                                                     "unquantized_backend": backend})()
    sys.modules[module.__name__] = module
    return method


@pytest.mark.parametrize("version", ["0.25.1", "0.33"])
def test_vllms_conversion_is_called_with_the_arguments_it_takes(version, monkeypatch):
    """vLLM 0.33's conversion takes ``layer=`` (MoonEP reads it), 0.25.1's does not: both are
    learned (Triton keeps checkpoint order: nothing to write differently), none refused."""
    import types

    from megatron_reshard.receiver import kernel_layouts

    if version == "0.25.1":
        def convert(backend, moe_config, w13_weight, w2_weight):
            return w13_weight.contiguous(), w2_weight.contiguous()
    else:
        def convert(backend, moe_config, w13_weight, w2_weight, layer=None):
            assert layer is None
            return w13_weight.contiguous(), w2_weight.contiguous()
    monkeypatch.setattr(kernel_layouts, "_learned", {})  # learned per call, not cached
    method = _moe_method_in_module(convert)
    module = types.SimpleNamespace(moe_config=types.SimpleNamespace(is_act_and_mul=True))
    params = {"w13_weight": torch.zeros(4, 2 * 8, 16, dtype=torch.bfloat16),
              "w2_weight": torch.zeros(4, 16, 8, dtype=torch.bfloat16)}
    assert kernel_layouts._moe_orders("model.layers.0.mlp.experts", module, method, params) == {}
