"""After a refit, weights vLLM derives from refitted params are recomputed (MLA's absorbed
``kv_b_proj`` copies) in their storage, and an MLA model inside vLLM with nothing to
recompute is refused.

The MLA layer below is a stand-in with the attribute names older vLLM kept on its MLA
implementation (``impl.W_UK_T``, ``impl.W_UV``, ``impl.process_weights_after_loading``),
making new tensors each time; vLLM 0.33's own MLA layers (the absorbed weights as
Parameters of the layer) are refreshed against vLLM itself in ``tests/real_vllm``."""

import pytest
import torch
from torch import nn

from megatron_reshard.receiver.derived import DerivedWeightsError, refresh_derived_weights


class _StandInMlaImpl:
    """Absorbs kv_b_proj at load time, as vLLM's MLA implementation does."""

    def __init__(self, kv_b_proj: nn.Linear, heads: int, nope: int, v: int):
        self.kv_b_proj, self.heads, self.nope, self.v = kv_b_proj, heads, nope, v
        self.calls = 0

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        w = self.kv_b_proj.weight.detach().T.view(-1, self.heads, self.nope + self.v)
        self.W_UK_T = w[..., :self.nope].permute(1, 2, 0).to(act_dtype).clone()
        self.W_UV = w[..., self.nope:].transpose(0, 1).to(act_dtype).clone()
        self.calls += 1


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv_b_proj = nn.Linear(4, 2 * (2 + 3), bias=False)
        self.attn = nn.Module()
        self.attn.impl = _StandInMlaImpl(self.kv_b_proj, 2, 2, 3)
        self.attn.impl.process_weights_after_loading(torch.float32)  # model load


def _model(layers: int = 2) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(_Layer() for _ in range(layers))
    return model


def _written(model: nn.Module) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "kv_b_proj" in n]


def test_absorbed_copies_follow_the_refitted_kv_b_proj_in_their_storage():
    model = _model()
    before = [layer.attn.impl.W_UV.clone() for layer in model.layers]
    addresses = [(layer.attn.impl.W_UV.data_ptr(), layer.attn.impl.W_UK_T.data_ptr())
                 for layer in model.layers]
    with torch.no_grad():  # what a refit does: write the params in place
        for layer in model.layers:
            layer.kv_b_proj.weight.mul_(-2.0).add_(1.0)
    refreshed = refresh_derived_weights(model, _written(model))
    assert refreshed == ["layers.0.attn", "layers.1.attn"]
    for layer, old, address in zip(model.layers, before, addresses):
        fresh = _StandInMlaImpl(layer.kv_b_proj, 2, 2, 3)
        fresh.process_weights_after_loading(torch.float32)
        assert torch.equal(layer.attn.impl.W_UV, fresh.W_UV)
        assert torch.equal(layer.attn.impl.W_UK_T, fresh.W_UK_T)
        assert not torch.equal(layer.attn.impl.W_UV, old)
        assert layer.attn.impl.calls == 2
        # the stand-in makes new tensors (clone); the refresh puts them back where they were
        assert (layer.attn.impl.W_UV.data_ptr(), layer.attn.impl.W_UK_T.data_ptr()) == address


def test_only_layers_whose_kv_b_proj_was_written_are_refreshed():
    model = _model()
    assert refresh_derived_weights(model, [model.layers[1].kv_b_proj.weight]) == ["layers.1.attn"]
    assert [layer.attn.impl.calls for layer in model.layers] == [1, 2]
    assert refresh_derived_weights(model, []) == []


def test_models_without_mla_layers_are_left_alone():
    plain = nn.Module()
    plain.kv_b_proj = nn.Linear(4, 10, bias=False)  # vLLM's names, no vLLM layer: nothing derived
    assert refresh_derived_weights(plain, [plain.kv_b_proj.weight]) == []


def test_a_vllm_mla_model_with_nothing_to_refresh_is_refused():
    model = nn.Module()
    model.kv_b_proj = nn.Linear(4, 10, bias=False)
    model.mla_attn = nn.Module()  # vLLM's MLA module, but its absorbed weights are not found
    with pytest.raises(DerivedWeightsError, match="W_UK_T / W_UV.*old attention weights"):
        refresh_derived_weights(model, [model.kv_b_proj.weight])


def test_a_result_that_cannot_go_back_into_its_storage_is_refused():
    model = _model(1)
    impl = model.layers[0].attn.impl
    impl.process_weights_after_loading = lambda dtype: setattr(impl, "W_UV", torch.zeros(1))
    with pytest.raises(DerivedWeightsError, match="W_UV.*cannot be refreshed in place"):
        refresh_derived_weights(model, _written(model))


def test_a_layer_holding_expert_weights_is_never_re_processed():
    """vLLM's MoE post-load converts the storage it is given (FlashInfer CUTLASS / TRTLLM):
    a module holding ``w13_weight`` / ``w2_weight`` is never a refresh holder, even with
    the MLA markers and a post-load method, so nothing converts expert storage twice."""
    from megatron_reshard.receiver.derived import mla_layers

    model = _model(1)
    layer = model.layers[0].attn
    layer.kv_b_proj = model.layers[0].kv_b_proj
    layer.W_UK_T = nn.Parameter(torch.zeros(2), requires_grad=False)
    layer.w13_weight = nn.Parameter(torch.zeros(2), requires_grad=False)
    layer.process_weights_after_loading = lambda act_dtype: pytest.fail("re-processed")
    assert [name for name, _, _ in mla_layers(model)] == []
    del layer.w13_weight
    assert [name for name, _, _ in mla_layers(model)] == ["layers.0.attn"]


class _StandInMlaImplOwnDtype(_StandInMlaImpl):
    """vLLM 0.34's form: the post-load step takes no dtype (the layer keeps its own)."""

    act_dtype = torch.float32

    def process_weights_after_loading(self) -> None:  # noqa: D102 - same step, no argument
        super().process_weights_after_loading(self.act_dtype)


def test_a_post_load_step_without_a_dtype_argument_is_called_without_one():
    model = _model(1)
    layer = model.layers[0]
    layer.attn.impl = _StandInMlaImplOwnDtype(layer.kv_b_proj, 2, 2, 3)
    layer.attn.impl.process_weights_after_loading()  # model load
    with torch.no_grad():
        layer.kv_b_proj.weight.mul_(3.0)
    assert refresh_derived_weights(model, _written(model), act_dtype=torch.bfloat16) == ["layers.0.attn"]
    fresh = _StandInMlaImplOwnDtype(layer.kv_b_proj, 2, 2, 3)
    fresh.process_weights_after_loading()
    assert layer.attn.impl.calls == 2 and layer.attn.impl.W_UV.dtype == torch.float32
    assert torch.equal(layer.attn.impl.W_UV, fresh.W_UV)
