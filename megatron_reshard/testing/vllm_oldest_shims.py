"""What the tests need to build and check vLLM 0.25.1's model classes on the CPU (the oldest
vLLM of the supported range), beyond ``testing.vllm_models``' shims: each function is a
no-op on vLLM 0.34, which has what it stands in for.

- MLA: vLLM 0.25's CPU platform has no MLA backend ("MLA is not supported on CPU"; 0.34 has
  ``CPU_MLA``). ``mla_without_cpu_backend`` gives MLA layers ``OLD_CPU_MLA_BACKEND``'s decode
  implementation (vLLM's portable Triton MLA, built without CUDA) and ``_NoMLAPrefill`` as
  their prefill half: every 0.25 prefill backend needs flash-attn or a CUDA workspace to
  construct (``FLASH_ATTN``: ``vllm_flash_attn``; ``FLASHINFER`` / ``TRTLLM_RAGGED``: a CUDA
  workspace; ``TOKENSPEED_MLA``: its package). Neither holds weights and no forward pass
  runs here: the weights and the post-load step deriving ``W_UK_T`` / ``W_UV`` from
  ``kv_b_proj`` are ``MLAAttention``'s own. vLLM 0.25 keeps those two as plain attributes
  of the layer, not parameters: ``vllm_models.model_tensors`` lists them by name, so the
  bit-for-bit comparison covers them on both ends of the range.
- gpt-oss: vLLM 0.25's loader takes the experts only stacked, as the HF checkpoint holds
  them (``mlp.experts.gate_up_proj [E, H, 2I]``); from the per-expert tensors the tests'
  oracle gathers (``mlp.experts.<e>.gate_up_proj [H, 2I]``, which vLLM 0.34 streams) it
  fails ("too many indices"). The oracle stacks them for that vLLM
  (``stacked_gpt_oss_experts``): the same values, what a real checkpoint holds.

Imports vLLM lazily (inside functions), like ``testing.vllm_models``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch


# vLLM's MLA decode backend the shim builds where the CPU platform has none (vLLM 0.25)
OLD_CPU_MLA_BACKEND = "TRITON_MLA"


class _NoMLAPrefill:
    """Stands for the prefill half of an MLA layer on vLLM 0.25 (see the module docstring):
    it holds no weights and is never run here."""

    def __init__(self, **kwargs: Any) -> None:
        pass


def mla_without_cpu_backend() -> None:
    """MLA layers buildable on a CPU platform without an MLA backend (vLLM 0.25; see the
    module docstring); nothing where vLLM has ``CPU_MLA``."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if hasattr(AttentionBackendEnum, "CPU_MLA"):
        return
    from vllm.model_executor.layers.attention import mla_attention

    choose = CpuPlatform.get_attn_backend_cls

    def select(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if attn_selector_config.use_mla and not attn_selector_config.use_sparse:
            return AttentionBackendEnum[OLD_CPU_MLA_BACKEND].get_path()
        return choose.__func__(cls, selected_backend, attn_selector_config, *args, **kwargs)

    CpuPlatform.get_attn_backend_cls = classmethod(select)
    mla_attention.get_mla_prefill_backend = lambda vllm_config: _NoMLAPrefill


# one gpt-oss expert's tensor as the tests' full HF tensors name it (vLLM's streamed form)
_GPT_OSS_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)(_bias)?$")


def loads_gpt_oss_experts_stacked(model: torch.nn.Module) -> bool:
    """vLLM 0.25's gpt-oss loader takes the experts only stacked, as the HF checkpoint holds
    them; 0.34's also streams them one by one (``_try_load_streamed_expert``)."""
    inner = getattr(model, "model", None)
    return type(model).__name__ == "GptOssForCausalLM" and inner is not None \
        and not hasattr(inner, "_try_load_streamed_expert")


def stacked_gpt_oss_experts(full_hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full HF tensors with gpt-oss's per-expert ``mlp.experts.<e>.gate_up_proj [H, 2I]``,
    ``down_proj [I, H]`` and their ``_bias`` stacked over the experts into the checkpoint's
    ``mlp.experts.gate_up_proj [E, H, 2I]`` etc. (the same values, one tensor per layer)."""
    out, experts = {}, {}
    for name, tensor in full_hf.items():
        m = _GPT_OSS_EXPERT.match(name)
        if m is None:
            out[name] = tensor
        else:
            experts.setdefault(f"{m[1]}.{m[3]}{m[4] or ''}", {})[int(m[2])] = tensor
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"{name}: experts {sorted(by_index)} are not 0..E-1")
        out[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


__all__ = ["OLD_CPU_MLA_BACKEND", "loads_gpt_oss_experts_stacked", "mla_without_cpu_backend",
           "stacked_gpt_oss_experts"]
