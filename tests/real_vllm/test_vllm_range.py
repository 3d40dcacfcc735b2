"""What changes across the supported vLLM range (0.25.1 .. 0.34.0) for the receiver, checked
against the vLLM of the venv (``make test-vllm`` runs the newest, ``make test-vllm-oldest``
the oldest; docs/DESIGN.md, "Real vLLM in the tests"; docs/VLLM_CHECKS.md, "The two ends of
the range").

vLLM 0.25 keeps MLA's derived ``W_UK_T`` / ``W_UV`` as plain attributes of the layer (0.34:
parameters): the bit-for-bit comparison must list them on both.

vLLM 0.25's CPU MoE takes its older path: after loading, ``UnquantizedFusedMoEMethod``
holds a ``cpu_fused_moe`` object. Only its torch variant (``CPUFusedMOE.forward_torch``, the
one a CUDA wheel without ``vllm._C``'s prepack gets, as here) computes through views of
w13/w2 as loaded; the grouped-GEMM variant replaces them with prepacked copies and the SGL
variant packs them in place. The receiver must write the first and refuse the others
before any byte moves.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from test_real_vllm import FAMILIES, vllm_config_json  # noqa: E402

pytestmark = pytest.mark.vllm_range


def _old_cpu_moe_orders(job, hf_config) -> dict:
    """Pool job (one process): vLLM's Qwen3-MoE dummy-loaded and post-processed; what
    ``storage_orders`` says of it as vLLM left it, then with each prepacking variant of
    vLLM 0.25's CPU MoE as the layers' ``cpu_fused_moe`` (the variant vLLM builds where
    ``vllm._C`` has the kernels): the refusal message, or None."""
    from megatron_reshard.receiver.kernel_layouts import KernelLayoutError, storage_orders
    from megatron_reshard.testing import vllm_models as vm

    config = vm.vllm_config_for(vm.write_model_dir(hf_config), 1)
    with vm.vllm_parallel_state(config, 0, 1, job.ports[0]):
        model = vm.dummy_loaded_model(config)
        methods = [m.quant_method for m in model.modules()
                   if type(getattr(m, "quant_method", None)).__name__ == "UnquantizedFusedMoEMethod"]
        held = [getattr(m, "cpu_fused_moe", None) for m in methods]
        out = {"layers": len(methods), "old_path": all(h is not None for h in held),
               "forward": sorted({getattr(getattr(h, "forward_method", None), "__name__", None)
                                  for h in held}),
               "orders": {n: o.backend for n, o in storage_orders(model).items()}, "refused": {}}
        if not out["old_path"]:
            return out
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe

        grouped = object.__new__(cpu_fused_moe.CPUFusedMOE)
        grouped.forward_method = grouped.forward_grouped_gemm
        variants = {"grouped_gemm": grouped, "sgl": object.__new__(cpu_fused_moe.SGLFusedMOE)}
        for name, variant in variants.items():
            for method in methods:
                method.cpu_fused_moe = variant
            try:
                storage_orders(model)
                out["refused"][name] = None
            except KernelLayoutError as err:
                out["refused"][name] = str(err)
        for method, h in zip(methods, held):
            method.cpu_fused_moe = h
    return out


def test_vllm_0_25_cpu_moe_is_written_in_place_only_where_it_keeps_the_loaded_storage(pool):
    (out,) = pool.run(_old_cpu_moe_orders, 1, vllm_config_json(FAMILIES["qwen3_moe"]),
                      num_ports=1, timeout_s=300)
    assert out["layers"] == 3, out  # Qwen3-MoE tiny: layers 1-3 are MoE
    assert out["orders"] == {}, out  # checkpoint order: written in place
    if not out["old_path"]:
        pytest.skip("this vLLM's CPU MoE has no cpu_fused_moe path (vLLM 0.26 and newer)")
    assert out["forward"] == ["forward_torch"], out
    for name, message in out["refused"].items():
        assert message is not None, name
        assert "model.layers.1.mlp.experts.routed_experts" in message, message
        assert "kernel backend CPU" in message and "prepack" in message, message


def _mla_derived_weights_compared(job, hf_config) -> dict:
    """Pool job (one process): two of vLLM's DeepSeek-V3 models dummy-loaded alike (vLLM's
    seeded dummy loader); where each version keeps the MLA weights derived from kv_b_proj,
    and whether the bit-for-bit comparison sees one sign bit flipped in the first's ``W_UV``
    (given storage of its own first, as vLLM does for an FP8 kv_b_proj)."""
    from megatron_reshard.receiver.derived import mla_layers
    from megatron_reshard.testing import vllm_models as vm

    config = vm.vllm_config_for(vm.write_model_dir(hf_config), 1)
    with vm.vllm_parallel_state(config, 0, 1, job.ports[0]):
        model = vm.dummy_loaded_model(config)
        other = vm.dummy_loaded_model(vm.vllm_config_for(vm.write_model_dir(hf_config), 1))
        layers = mla_layers(model)
        name, holder, _ = layers[0]
        out = {"layers": len(layers), "holder": type(holder).__name__,
               "as_params": sorted(n for n, _ in model.named_parameters() if n.endswith(("W_UK_T", "W_UV"))),
               "compared": sorted(n for n in vm.model_tensors(model) if n.endswith(("W_UK_T", "W_UV"))),
               "before": vm.bitwise_differences(model, other)}
        holder.W_UV.data = holder.W_UV.data.clone()
        first = (0,) * holder.W_UV.dim()
        with torch.no_grad():
            holder.W_UV.data[first] = -holder.W_UV.data[first]  # its sign bit (-0.0 too)
        out["planted"] = f"{name}.W_UV"
        out["after"] = vm.bitwise_differences(model, other)
    return out


def test_mla_derived_weights_are_compared_where_this_vllm_keeps_them(pool):
    """vLLM 0.34 registers W_UK_T / W_UV as parameters of the MLAAttention layer, vLLM 0.25
    keeps them as plain attributes of it (no parameter lists them): the comparison of the
    MLA refit cases must cover them on both (``testing.vllm_models.model_tensors``)."""
    (out,) = pool.run(_mla_derived_weights_compared, 1, vllm_config_json(FAMILIES["deepseek_v3"]),
                      num_ports=1, timeout_s=300)
    layers = FAMILIES["deepseek_v3"].model["num_layers"]
    assert out["layers"] == layers and out["holder"] == "MLAAttention", out
    expected = sorted(f"model.layers.{i}.self_attn.mla_attn.mla_attn.{w}"
                      for i in range(layers) for w in ("W_UK_T", "W_UV"))
    assert out["compared"] == expected, out
    assert out["as_params"] in ([], expected), out  # 0.25: attributes; 0.34: parameters
    assert out["before"] == [], out
    assert out["after"] == [out["planted"]], out
