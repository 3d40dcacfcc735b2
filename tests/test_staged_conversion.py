"""The staged path's own rules, on CPU without vLLM: each written layer converted once per
refit into the same storage, a layer written in part refused, a conversion that cannot run
here or changes the storage's shape refused before any byte moves.

The expert layer below stands in for vLLM's block-FP8 ``Fp8MoEMethod`` (duck-typed by its
class name, its conversion looked up in its class's module, as the receiver finds vLLM's);
its conversion does what FlashInfer CUTLASS's does (w13 and its scales as [up; gate],
block scales clamped in place). vLLM's own layers and conversions are checked bit for bit
in ``tests/real_vllm/test_fp8_staged_conversion.py``."""

import enum

import pytest
import torch
from torch import nn

from megatron_reshard.receiver.kernel_layouts import KernelLayoutError
from megatron_reshard.receiver.staged_conversion import (
    StagedConversionError,
    StagedConversions,
    staged_layers,
)

E, I, H = 2, 4, 3


class Backend(enum.Enum):
    FLASHINFER_CUTLASS = "flashinfer_cutlass"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    DEEPGEMM = "deep_gemm"
    MARLIN = "marlin"
    TRITON = "triton"
    BATCHED_TRITON = "batched_triton"  # stands in for an identity conversion
    BATCHED_DEEPGEMM = "batched_deep_gemm"  # one that writes its inputs in place


def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, 2, x.shape[-2] // 2, x.shape[-1]).flip(dims=[1]).reshape(x.shape)


def convert_to_fp8_moe_kernel_format(backend, layer, w13, w2, s13, s2, in13, in2):
    if backend is Backend.DEEPGEMM:
        raise ImportError("deep_gemm")  # as on a machine without the package
    if backend is Backend.TRITON:
        return w13, w2[..., :1], s13, s2  # a result of another shape
    if backend is Backend.BATCHED_TRITON:
        return w13, w2, s13, s2  # vLLM's Triton experts: the inputs handed back
    if backend is Backend.BATCHED_DEEPGEMM:
        s13.clamp_(min=1e-10)  # in place: here the scales are >= 1, no byte changes
        return w13, w2, s13, s2
    if backend is Backend.FLASHINFER_TRTLLM:  # a kernel's own 4-D shape of as many elements
        return _blocked(_swap(w13)), _blocked(w2), _swap(s13), s2
    s13, s2 = _swap(s13), s2
    s13.clamp_(min=1e-10)
    s2.clamp_(min=1e-10)
    return _swap(w13), w2, s13, s2


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """[E, M, K] -> [E, K, M, 1]: columns first, as a block-major layout with blocks of 1."""
    return w.permute(0, 2, 1).unsqueeze(-1).contiguous()


class Fp8MoEMethod:
    def __init__(self, backend: Backend):
        self.fp8_backend, self.weight_block_size = backend, [128, 128]


class Experts(nn.Module):
    def __init__(self, backend: Backend = Backend.FLASHINFER_CUTLASS):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(E, 2 * I, H), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(E, H, I), requires_grad=False)
        self.w13_weight_scale_inv = nn.Parameter(torch.ones(E, 2, 1), requires_grad=False)
        self.w2_weight_scale_inv = nn.Parameter(torch.ones(E, 1, 1), requires_grad=False)
        self.quant_method = Fp8MoEMethod(backend)
        self.hidden_size, self.intermediate_size_per_partition = H, I


def _model(backend: Backend = Backend.FLASHINFER_CUTLASS) -> nn.Module:
    model = nn.Module()
    model.experts = Experts(backend)
    return model


def _receive(model: nn.Module) -> dict:
    """What a refit writes: checkpoint order, a scale of 0 (an all-zero tile) included."""
    sent = {n: torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(sent[n])
    return sent


def test_each_written_layer_is_converted_once_into_its_storage():
    model = _model()
    staged = StagedConversions(staged_layers(model))
    addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
    sent = _receive(model)
    staged.received(list(model.parameters()))
    assert staged.convert() == ["experts"]
    live = dict(model.named_parameters())
    assert torch.equal(live["experts.w13_weight"], _swap(sent["experts.w13_weight"]))
    assert torch.equal(live["experts.w13_weight_scale_inv"],
                       _swap(sent["experts.w13_weight_scale_inv"]).clamp(min=1e-10))
    assert live["experts.w2_weight_scale_inv"].min() == torch.tensor(1e-10)  # the clamp: values change
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == addresses
    # a second call (or vLLM's post-load re-run by mistake) finds nothing to convert
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert staged.convert() == []
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    report = staged.report()
    assert report["conversions"] == 1 and report["backends"] == ["Fp8MoEMethod:FLASHINFER_CUTLASS"]
    assert report["peak_staging_bytes"] == (E * 2 * I * H + E * 2) * 4  # w13 and its scales, new
    own = report["per_layer"]["experts"]
    assert own["layer_bytes"] == (E * 2 * I * H + E * H * I + E * 2 + E) * 4  # every param, float32
    assert own["peak_staging_bytes"] == own["staging_bytes"] == report["peak_staging_bytes"]
    assert own["conversions"] == 1 and own["total_convert_s"] == own["convert_s"] >= 0


def test_per_layer_figures_add_up_over_refits():
    """Two refits: the layer's own staging peak and conversion count follow each refit;
    the report's totals are those of its layers."""
    model = _model()
    staged = StagedConversions(staged_layers(model))
    for _ in range(2):
        _receive(model)
        staged.received(list(model.parameters()))
        staged.convert()
    report = staged.report()
    own = report["per_layer"]["experts"]
    assert own["conversions"] == report["conversions"] == 2
    assert own["total_convert_s"] == pytest.approx(report["convert_s"])
    assert own["peak_staging_bytes"] == report["peak_staging_bytes"] > 0


def test_a_layer_written_in_part_is_refused():
    model = _model()
    staged = StagedConversions(staged_layers(model))
    with pytest.raises(StagedConversionError, match=r"experts: the refit wrote \['experts.w13_weight'\]"):
        staged.received([model.experts.w13_weight])
    assert staged.convert() == []


@pytest.mark.parametrize("backend, why", [
    (Backend.MARLIN, "repacks the experts with its own device kernels"),
    (Backend.DEEPGEMM, "does not run on this cpu device (ImportError: deep_gemm)"),
    (Backend.TRITON, "it returned [((1, 3, 1), torch.float32)]"),
])
def test_a_conversion_that_cannot_run_here_is_refused_before_any_byte_moves(backend, why):
    model = _model(backend)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(KernelLayoutError) as err:
        staged_layers(model)
    message = str(err.value)
    assert message.startswith(f"experts: quant method Fp8MoEMethod, kernel backend {backend.name}:"), message
    assert why in message and "--moe-backend flashinfer_cutlass, flashinfer_trtllm or triton" in message, message
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # dry run on a copy


def test_storage_vllm_holds_in_a_kernels_shape_is_received_through_a_checkpoint_shaped_view():
    """As vLLM re-allocates block-FP8 TRTLLM experts ([E, K/128, M, 128]): the refit writes
    checkpoint order through a view of that storage in the checkpoint's shape, and the
    conversion's result lands in the same storage."""
    model = _model(Backend.FLASHINFER_TRTLLM)
    with torch.no_grad():  # what vLLM's load left: the params in the kernel's shape
        for leaf, shape in (("w13_weight", (E, H, 2 * I, 1)), ("w2_weight", (E, I, H, 1))):
            getattr(model.experts, leaf).data = torch.zeros(shape)
    (layer,) = staged_layers(model)
    views = layer.receive_views()
    assert {n: tuple(v.shape) for n, v in views.items()} == {
        "experts.w13_weight": (E, 2 * I, H), "experts.w2_weight": (E, H, I)}
    live = dict(model.named_parameters())
    assert all(v.data_ptr() == live[n].data_ptr() for n, v in views.items())
    sent = {n: torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) for n, v in views.items()}
    with torch.no_grad():
        for n, v in views.items():
            v.copy_(sent[n])
    staged = StagedConversions([layer])
    staged.received(list(model.parameters()))
    assert staged.convert() == ["experts"]
    assert torch.equal(live["experts.w13_weight"], _blocked(_swap(sent["experts.w13_weight"])))
    assert torch.equal(live["experts.w2_weight"], _blocked(sent["experts.w2_weight"]))
    assert all(v.data_ptr() == live[n].data_ptr() for n, v in views.items())


@pytest.mark.parametrize("backend, kept", [
    (Backend.BATCHED_TRITON, True),       # the inputs handed back, no byte touched
    (Backend.FLASHINFER_CUTLASS, False),  # new tensors copied back
    (Backend.BATCHED_DEEPGEMM, False),    # inputs handed back, but written in place
])
def test_only_an_identity_conversion_keeps_the_storage_a_delta_base(backend, kept):
    """A delta refit is cut from the bytes as they arrived: after a conversion that changed
    nothing (found by the dry run and again by the live call) the storage still holds them;
    after any other, even one that wrote values equal to the old ones, it does not."""
    model = _model(backend)
    staged = StagedConversions(staged_layers(model))
    assert staged.layers[0].identity is (backend is Backend.BATCHED_TRITON)
    sent = _receive(model)
    staged.received(list(model.parameters()))
    assert staged.convert() == ["experts"]
    assert staged.rewrote is (not kept)
    if kept:
        assert all(torch.equal(p, sent[n]) for n, p in model.named_parameters())
        assert staged.report()["peak_staging_bytes"] == 0


def test_vllm_online_linear_methods_are_seen_under_either_versions_base_name():
    """vLLM 0.33's online linear methods derive from ``OnlineLinearBase``, 0.25.1's from
    ``_Fp8OnlineLinearBase``: both are vLLM's online quantization (refused or staged as
    such), never taken for a plain layer."""
    from megatron_reshard.receiver.staged_conversion import _is_online

    for base_name in ("OnlineLinearBase", "_Fp8OnlineLinearBase"):
        base = type(base_name, (), {})
        method = type("Fp8PerTensorOnlineLinearMethod", (base,), {})()
        assert _is_online(method), base_name
    assert not _is_online(type("UnquantizedLinearMethod", (), {})())
