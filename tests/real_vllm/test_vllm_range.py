"""What changes across the supported vLLM range (0.25.1 .. 0.34.0) for the receiver, checked
against the vLLM of the venv (``make test-vllm`` runs the newest, ``make test-vllm-oldest``
the oldest; docs/DESIGN.md, "Real vLLM in the tests").

vLLM 0.25's CPU MoE takes its older path: after loading, ``UnquantizedFusedMoEMethod``
holds a ``cpu_fused_moe`` object. Only its torch variant (``CPUFusedMOE.forward_torch``, the
one a CUDA wheel without ``vllm._C``'s prepack gets, as here) computes through views of
w13/w2 as loaded; the grouped-GEMM variant replaces them with prepacked copies and the SGL
variant packs them in place. The receiver must write the first and refuse the others
before any byte moves.
"""

from __future__ import annotations

import pytest

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
