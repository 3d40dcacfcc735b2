"""What ``receiver.staged_conversion`` says of vLLM's own block-FP8 layers: a pool job.

One process builds vLLM 0.33's block-FP8 model on the CPU (``testing.vllm_models``' shim)
with FlashInfer CUTLASS experts, lists its staged layers, then sets the live layers'
backend to each FP8 MoE backend whose conversion cannot run here (as another platform or
setting would select it) and asks again; then builds the same model with FlashInfer
TRTLLM experts (vLLM stores block-FP8 experts in TRTLLM's own 4-D shape). Imports vLLM
lazily: the module itself needs only torch.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch


def _refusal(model: torch.nn.Module, skip=()) -> Optional[str]:
    from megatron_reshard.receiver.kernel_layouts import KernelLayoutError
    from megatron_reshard.receiver.staged_conversion import staged_layers

    try:
        staged_layers(model, skip=skip)
        return None
    except KernelLayoutError as err:
        return str(err)


def fp8_refusals_job(job, hf_config: Mapping[str, Any], moe_backends: tuple = ()) -> dict:
    """Pool job (one process, ``num_ports=1``): ``{"staged": [(layer, method, backend)],
    "refused": {backend: message or None}, "marlin_linear": message, "trtllm": message,
    "orders_alone": message}``."""
    from megatron_reshard.receiver.kernel_layouts import KernelLayoutError, storage_orders
    from megatron_reshard.receiver.staged_conversion import staged_layers
    from megatron_reshard.testing import vllm_models as vm

    model_dir = vm.write_model_dir(hf_config)
    config = vm.vllm_config_for(model_dir, 1, moe_backend="flashinfer_cutlass")
    out: dict[str, Any] = {"refused": {}}
    with vm.vllm_parallel_state(config, 0, 1, job.ports[0]):
        model = vm.dummy_loaded_model(config)
        out["staged"] = [(layer.name, layer.method, layer.backend) for layer in staged_layers(model)]
        moe = [m.quant_method for m in model.modules()
               if type(getattr(m, "quant_method", None)).__name__ == "Fp8MoEMethod"]
        chosen = moe[0].fp8_backend
        for name in moe_backends:
            for method in moe:
                method.fp8_backend = type(chosen)[name]
            out["refused"][name] = _refusal(model)
        for method in moe:
            method.fp8_backend = chosen
        linear = next(m.quant_method for m in model.modules()
                      if type(getattr(m, "quant_method", None)).__name__ == "Fp8LinearMethod")
        linear.use_marlin = True  # vLLM's choice on GPUs without FP8 hardware
        out["marlin_linear"] = _refusal(model)
        linear.use_marlin = False
        try:  # the order alone, without the staged path, never writes FP8 layers
            storage_orders(model)
            out["orders_alone"] = None
        except KernelLayoutError as err:
            out["orders_alone"] = str(err)
        trtllm = vm.dummy_loaded_model(vm.vllm_config_for(model_dir, 1, moe_backend="flashinfer_trtllm"))
        out["trtllm"] = _refusal(trtllm)
    return out


def per_tensor_refusals_job(job, hf_config: Mapping[str, Any], fp8_quant_config: Mapping[str, Any],
                            online: tuple = ("fp8", "fp8_per_tensor")) -> dict:
    """Pool job (one process, ``num_ports=1``): vLLM's model built from a per-tensor FP8
    checkpoint (``hf_config`` with ``fp8_quant_config``) and, from the BF16 checkpoint, with
    each of vLLM's ``--quantization`` values in ``online``. Per case ``{"methods": {quant
    method: first layer}, "refused": message or None, "moe_refused": the message when only
    the expert layers are asked about, "post_load": vLLM's post-load error or None}``; the
    post-load runs on the dummy-loaded per-tensor checkpoint only (online layers are
    quantized while loading, the same code)."""
    from megatron_reshard.testing import vllm_models as vm

    out: dict[str, Any] = {}
    cases = [("checkpoint", dict(hf_config, quantization_config=dict(fp8_quant_config)), None)]
    cases += [(f"online:{q}", dict(hf_config), q) for q in online]
    for label, hf, quantization in cases:
        config = vm.vllm_config_for(vm.write_model_dir(hf), 1, quantization=quantization,
                                    moe_backend="flashinfer_cutlass")
        with vm.vllm_parallel_state(config, 0, 1, job.ports[0]):
            model = vm.build_model(config)
            methods: dict[str, str] = {}
            for name, module in model.named_modules():
                method = getattr(module, "quant_method", None)
                if method is not None and any(True for _ in module.parameters(recurse=False)):
                    methods.setdefault(type(method).__name__, name)
            not_experts = {n for n, _ in model.named_parameters() if ".experts." not in n}
            case = {"methods": methods, "refused": _refusal(model),
                    "moe_refused": _refusal(model, skip=not_experts), "post_load": None}
            if quantization is None:
                from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

                DummyModelLoader(config.load_config).load_weights(model, config.model_config)
                try:
                    vm.post_process(model, config)
                except Exception as exc:  # what this CPU cannot run (the finding under test)
                    case["post_load"] = f"{type(exc).__name__}: {exc}"
            out[label] = case
    return out


def online_block_job(job, hf_config: Mapping[str, Any], moe_backend: str = "flashinfer_cutlass") -> dict:
    """Pool job (one process, ``num_ports=1``): vLLM's model of the BF16 checkpoint with
    ``--quantization fp8_per_block`` (dummy load, vLLM's own online quantization and
    post-load). ``{"staged": [(layer, method, backend)], "held": {param: (shape, dtype)} of
    every staged param, "bf16_payload" / "train_fp8_payload" / "block_payload":
    what ``check_online_payload`` says of a payload planned for BF16, for block FP8 with a
    weight in its training FP8 bytes, and for block FP8 (None: accepted)}``."""
    from megatron_reshard.receiver.kernel_layouts import KernelLayoutError
    from megatron_reshard.receiver.staged_conversion import check_online_payload, staged_layers
    from megatron_reshard.testing import vllm_models as vm
    from megatron_reshard.wire.records import ParamRecord, RefitPayload

    config = vm.vllm_config_for(vm.write_model_dir(hf_config), 1, quantization="fp8_per_block",
                                moe_backend=moe_backend)
    out: dict[str, Any] = {}
    with vm.vllm_parallel_state(config, 0, 1, job.ports[0]):
        model = vm.dummy_loaded_model(config)
        layers = staged_layers(model)
        out["staged"] = [(layer.name, layer.method, layer.backend) for layer in layers]
        out["held"] = {n: (tuple(t.shape), str(t.dtype)) for layer in layers
                       for n, t in zip(layer.params, layer.tensors)}
        weight = layers[0].params[0]
        trained = ParamRecord(weight, (1, 1), "torch.float8_e4m3fn", None, (), None, (),
                              gen_quant="train_fp8")
        payloads = {"bf16_payload": RefitPayload(layer_names=(), per_layer_params={}),
                    "train_fp8_payload": RefitPayload(
                        layer_names=("l",), per_layer_params={"l": (trained,)},
                        gen_quant={"format": "block_fp8", "block": [128, 128]}),
                    "block_payload": RefitPayload(layer_names=(), per_layer_params={},
                                                  gen_quant={"format": "block_fp8",
                                                             "block": [128, 128]})}
        for key, payload in payloads.items():
            try:
                check_online_payload(layers, payload)
                out[key] = None
            except KernelLayoutError as err:
                out[key] = str(err)
    return out


__all__ = ["fp8_refusals_job", "online_block_job", "per_tensor_refusals_job"]
