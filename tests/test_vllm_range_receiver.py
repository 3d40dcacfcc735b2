"""What the receiver reads off vLLM's live modules where versions of the supported range
(0.25.1 .. 0.34.0) differ, on stand-ins with vLLM's names (torch only; the same checks
against vLLM itself run in ``tests/real_vllm``).

- vLLM 0.34 keeps an FP8 model's KV-cache scales as params of the attention layer, under
  its ``Fp8KVCacheMethod``: no refit target, and no refusal of the layer.
- vLLM 0.25's CPU MoE (``method.cpu_fused_moe``): written in place only in its torch
  variant; every other variant is refused before any byte moves."""

import pytest
import torch
from torch import nn

from megatron_reshard.receiver.kernel_layouts import (KernelLayoutError, kv_cache_scale_names,
                                                      storage_orders)


class Fp8KVCacheMethod:  # vLLM's class name is what the receiver reads
    pass


class UnquantizedLinearMethod:
    pass


def _attention_with_scales(names=("k_scale", "v_scale", "q_scale", "prob_scale"), numel=1):
    attn = nn.Module()
    attn.quant_method = Fp8KVCacheMethod()
    for n in names:
        attn.register_parameter(n, nn.Parameter(torch.full((numel,), -1.0), requires_grad=False))
    return attn


def _model(attn: nn.Module) -> nn.Module:
    model = nn.Module()
    model.attn = attn
    model.proj = nn.Linear(4, 4, bias=False)
    model.proj.quant_method = UnquantizedLinearMethod()
    return model


def test_kv_cache_scales_are_no_targets_and_their_layer_is_not_refused():
    model = _model(_attention_with_scales())
    assert kv_cache_scale_names(model) == {"attn.k_scale", "attn.v_scale", "attn.q_scale",
                                           "attn.prob_scale"}
    assert storage_orders(model) == {}


@pytest.mark.parametrize("attn", [
    _attention_with_scales(("k_scale", "weight")),  # a param that is no KV-cache scale
    _attention_with_scales(numel=4),                # not a single value
], ids=["other-param", "not-scalar"])
def test_anything_else_under_a_kv_cache_method_is_still_refused(attn):
    model = _model(attn)
    assert kv_cache_scale_names(model) == set()
    with pytest.raises(KernelLayoutError, match="attn: quant method Fp8KVCacheMethod"):
        storage_orders(model)


class UnquantizedFusedMoEMethod:
    unquantized_backend = "CPU"  # the receiver reads the backend's name


class CPUFusedMOE:  # vLLM 0.25's names
    def forward_torch(self):
        pass

    def forward_grouped_gemm(self):
        pass


def _old_cpu_moe(forward: str) -> nn.Module:
    experts = nn.Module()
    experts.quant_method = UnquantizedFusedMoEMethod()
    held = CPUFusedMOE()
    held.forward_method = getattr(held, forward)
    experts.quant_method.cpu_fused_moe = held
    experts.w13_weight = nn.Parameter(torch.zeros(2, 8, 4), requires_grad=False)
    experts.w2_weight = nn.Parameter(torch.zeros(2, 4, 4), requires_grad=False)
    model = nn.Module()
    model.experts = experts
    return model


def test_vllm_0_25_cpu_moe_variants_that_prepack_are_refused_before_anything_else():
    with pytest.raises(KernelLayoutError, match="experts: .* kernel backend CPU: .*prepack"):
        storage_orders(_old_cpu_moe("forward_grouped_gemm"))
    # the torch variant passes this check and goes on to the next one (the conversion
    # function, which this stand-in lacks: refused for that, not for prepacking)
    with pytest.raises(KernelLayoutError) as err:
        storage_orders(_old_cpu_moe("forward_torch"))
    assert "prepack" not in str(err.value) and "conversion function" in str(err.value)
