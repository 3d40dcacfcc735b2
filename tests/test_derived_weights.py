"""After a refit, weights vLLM derives from refitted params are recomputed (MLA's absorbed
``kv_b_proj`` copies), and an MLA model inside vLLM with nothing to recompute is refused.

The MLA layer below is a stand-in with the attribute names of vLLM's MLA implementation
(``impl.W_UK_T``, ``impl.W_UV``, ``impl.process_weights_after_loading(act_dtype)``); the
thing under test is ``receiver.derived``, which must find and refresh such layers."""

import sys
import types

import pytest
import torch
from torch import nn

from megatron_reshard.receiver.derived import DerivedWeightsError, refresh_derived_weights

MLA_CONFIG = {"kv_lora_rank": 4, "qk_nope_head_dim": 2, "v_head_dim": 3,
              "num_attention_heads": 2}


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


def test_absorbed_copies_follow_the_refitted_kv_b_proj():
    model = _model()
    before = [layer.attn.impl.W_UV.clone() for layer in model.layers]
    with torch.no_grad():  # what a refit does: write the params in place
        for layer in model.layers:
            layer.kv_b_proj.weight.mul_(-2.0).add_(1.0)
    refreshed = refresh_derived_weights(model, MLA_CONFIG)
    assert refreshed == ["layers.0.attn", "layers.1.attn"]
    for layer, old in zip(model.layers, before):
        fresh = _StandInMlaImpl(layer.kv_b_proj, 2, 2, 3)
        fresh.process_weights_after_loading(torch.float32)
        assert torch.equal(layer.attn.impl.W_UV, fresh.W_UV)
        assert torch.equal(layer.attn.impl.W_UK_T, fresh.W_UK_T)
        assert not torch.equal(layer.attn.impl.W_UV, old)
        assert layer.attn.impl.calls == 2


def test_models_without_mla_are_left_alone():
    model = _model()
    assert refresh_derived_weights(model, {"num_attention_heads": 2}) == []
    assert all(layer.attn.impl.calls == 1 for layer in model.layers)


def test_mla_inside_vllm_with_nothing_to_refresh_is_refused(monkeypatch):
    plain = nn.Module()
    plain.kv_b_proj = nn.Linear(4, 10, bias=False)
    assert refresh_derived_weights(plain, MLA_CONFIG) == []  # outside vLLM: nothing derived
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    with pytest.raises(DerivedWeightsError, match="W_UK_T / W_UV.*old attention weights"):
        refresh_derived_weights(plain, MLA_CONFIG)
