"""A real megatron-core ``MambaModel`` (Nemotron-H) built on a machine without CUDA.

megatron-core 0.16.1's hybrid model needs, to be *constructed*, things only a CUDA machine
with Transformer Engine, Triton and mamba-ssm has, though a refit reads only its parameters.
Every workaround is in ``mamba_on_cpu`` (restored on exit; pool workers run later jobs) and
the local spec below; nothing here runs a forward pass (it would fail: no kernels):

- ``ssm/mamba_mixer.py`` imports ``inference/contexts/attention_context/triton/tensor_ops``,
  whose first line is ``import triton``; its three functions serve only the dynamic
  inference forward. Without Triton that module is an empty stand-in while the mixer module
  is imported (removed from ``sys.modules`` right after).
- Without ``mamba_ssm`` the mixer refuses to build (``HAVE_MAMBA_SSM``), and its gated norm
  class ``RMSNormGated`` is a ``MagicMock`` (no parameter at all): the mixer's
  ``ExtendedRMSNorm`` is replaced by ``GatedNormParams``, a real module with the same
  parameter (``weight [d_inner / TP]``, ones) and ``group_size``, as mamba-ssm's
  ``layernorm_gated.RMSNorm`` builds it. ``HAVE_EINOPS`` of the mixer and of
  ``mamba_context_parallel`` (einops: used by ``forward`` only; absent from the main test
  venv) says True.
- The mixer places ``conv1d``, ``dt_bias``, ``A_log``, ``D`` and the norm with
  ``torch.cuda.current_device()`` whatever ``use_cpu_initialization`` says: that call
  answers the CPU device.
- It forks the CUDA RNG tracker around its inits (``get_cuda_rng_tracker().fork()``), which
  has no state without CUDA: a no-op fork (``fill_distinct_`` then sets every parameter).
- ``MambaStack``'s final norm is TE's ``TENorm`` whatever the spec says: megatron-core's
  ``WrappedTorchNorm`` (the torch RMSNorm the local GPT spec uses) takes its place.
- megatron-core's only Mamba stack spec (``mamba_layer_specs.mamba_stack_spec``) is
  Transformer-Engine (norms fused into ``TELayerNormColumnParallelLinear``):
  ``local_mamba_stack_spec`` is the same stack with local modules (the norm of each layer a
  ``WrappedTorchNorm`` of its own: ``norm``, ``input_layernorm``, ``pre_mlp_layernorm``).

Measured (2026-12-07): ``triton`` 3.9.0 is a 286 MB wheel and ``mamba-ssm`` 2.3.2.post1
builds without its CUDA kernels in 7 s (``MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE
pip wheel --no-build-isolation``); with both installed only the first two shims go away, the
rest stay. Neither is installed in the test venvs: the vLLM venv's behaviour would change
with a real Triton, and the shims above are all a refit test needs.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_reshard.testing.megatron_models import (_cuda_device_is_cpu, fill_distinct_,
                                                      padded_vocab_size)

_TRITON_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


@dataclass(frozen=True)
class TinyMambaSpec:
    """A tiny Nemotron-H: the layer pattern (``M`` Mamba, ``*`` attention, ``-`` MLP) and sizes."""

    pattern: str = "M*M-"
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 96
    vocab_size: int = 200
    make_vocab_size_divisible_by: int = 128
    mamba_num_heads: int = 8
    mamba_head_dim: int = 16
    mamba_state_dim: int = 16
    mamba_num_groups: int = 2
    mamba_conv_kernel: int = 4
    layernorm_epsilon: float = 1e-5
    num_moe_experts: Optional[int] = None  # with 'E' layers (Nemotron-3 Nano; refused by the refit)
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    dtype: str = "bfloat16"
    seed: int = 1234


class GatedNormParams(torch.nn.Module):
    """The parameters of mamba-ssm's gated RMSNorm (``ops/triton/layernorm_gated.RMSNorm``:
    ``weight`` of ``hidden_size`` ones, no bias, ``group_size``); construction only."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        raise NotImplementedError("construction-only stand-in of mamba-ssm's gated RMSNorm")


class _NoFork:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


def _import_mixer_module():
    """``megatron.core.ssm.mamba_mixer``, its Triton-only import stood in for where Triton is
    absent (see the module docstring)."""
    name = "megatron.core.ssm.mamba_mixer"
    if name in sys.modules:
        return sys.modules[name]
    try:
        importlib.import_module("triton")
        return importlib.import_module(name)
    except ImportError:
        pass
    stand_in = types.ModuleType(_TRITON_OPS)
    stand_in.tensor_get_slice_after = stand_in.tensor_masked_update = stand_in.tensor_merge = None
    sys.modules[_TRITON_OPS] = stand_in
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules[_TRITON_OPS]


@contextlib.contextmanager
def mamba_on_cpu():
    """While active, megatron-core 0.16.1 builds a ``MambaModel`` with Mamba layers on the CPU."""
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mixer = _import_mixer_module()
    from megatron.core.ssm import mamba_context_parallel as cp  # imported by the mixer module

    saved = (mixer.HAVE_MAMBA_SSM, mixer.HAVE_EINOPS, cp.HAVE_EINOPS, mixer.ExtendedRMSNorm,
             mixer.get_cuda_rng_tracker, mamba_block.TENorm)
    mixer.HAVE_MAMBA_SSM, mixer.HAVE_EINOPS, cp.HAVE_EINOPS = True, True, True
    if not isinstance(mixer.RMSNormGated, type):  # mamba-ssm absent: a MagicMock
        mixer.ExtendedRMSNorm = GatedNormParams
    mixer.get_cuda_rng_tracker = _NoFork
    mamba_block.TENorm = WrappedTorchNorm
    try:
        with _cuda_device_is_cpu(True):
            yield
    finally:
        (mixer.HAVE_MAMBA_SSM, mixer.HAVE_EINOPS, cp.HAVE_EINOPS, mixer.ExtendedRMSNorm,
         mixer.get_cuda_rng_tracker, mamba_block.TENorm) = saved


def local_mamba_stack_spec():
    """megatron-core's Mamba stack (Mamba, attention, MLP layers) with local modules."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    mixer = _import_mixer_module()
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(module=mixer.MambaMixer, submodules=mixer.MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                      linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp=get_moe_module_spec(use_te=False, num_experts=8), mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp, moe_layer=moe))


def mamba_config(spec: TinyMambaSpec):
    """The ``TransformerConfig`` of ``spec`` under the live parallel state (Nemotron-H's
    squared-ReLU MLP, RMSNorm, no biases)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = getattr(torch, spec.dtype)
    return TransformerConfig(
        num_layers=len(spec.pattern), hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        activation_func=lambda x: torch.pow(F.relu(x), 2), gated_linear_unit=False,
        add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=spec.layernorm_epsilon,
        mamba_num_heads=spec.mamba_num_heads, mamba_head_dim=spec.mamba_head_dim,
        mamba_state_dim=spec.mamba_state_dim, mamba_num_groups=spec.mamba_num_groups,
        **(dict(num_moe_experts=spec.num_moe_experts, moe_ffn_hidden_size=spec.ffn_hidden_size,
                moe_router_topk=2, moe_token_dispatcher_type="allgather") if spec.num_moe_experts else {}),
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,
        num_layers_in_first_pipeline_stage=spec.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=spec.num_layers_in_last_pipeline_stage)


def build_mamba_model(spec: TinyMambaSpec):
    """This rank's ``MambaModel`` for ``spec`` (parallel_state initialised), every param
    distinct by its global identity (``megatron_models.fill_distinct_``), all in ``spec.dtype``
    (as Megatron's ``Float16Module`` holds them)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.mamba.mamba_model import MambaModel

    config = mamba_config(spec)
    torch.manual_seed(spec.seed)
    with mamba_on_cpu():
        model = MambaModel(config=config, mamba_stack_spec=local_mamba_stack_spec(),
                           vocab_size=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by,
                                                        ps.get_tensor_model_parallel_world_size()),
                           max_sequence_length=64, hybrid_override_pattern=spec.pattern,
                           pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                           share_embeddings_and_output_weights=False, position_embedding_type="none")
    model = model.to(dtype=getattr(torch, spec.dtype))
    fill_distinct_(model, spec.seed)
    return model


# ---- the oracle: full HF tensors, written without ``converters`` / ``megatron.mamba``
_LAYER_NAMES = {
    "norm.weight": "norm.weight", "input_layernorm.weight": "norm.weight",
    "pre_mlp_layernorm.weight": "norm.weight",
    "mixer.A_log": "mixer.A_log", "mixer.D": "mixer.D", "mixer.dt_bias": "mixer.dt_bias",
    "mixer.norm.weight": "mixer.norm.weight", "mixer.out_proj.weight": "mixer.out_proj.weight",
    "self_attention.linear_proj.weight": "mixer.o_proj.weight",
    "mlp.linear_fc1.weight": "mixer.up_proj.weight", "mlp.linear_fc2.weight": "mixer.down_proj.weight",
}


def _tp_parts(param: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's copy of ``param`` (one part when it is not TP-sharded)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    size = ps.get_tensor_model_parallel_world_size()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return [param.detach()]
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return parts


def _by_stream(parts: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
    """The streams of per-rank ``parts`` (each rank: ``rows`` rows per stream, in order),
    joined stream after stream, by an explicit loop over streams and ranks."""
    out = []
    for s in range(len(rows)):
        start = sum(rows[:s])
        for part in parts:
            out.append(part[start:start + rows[s]])
    return torch.cat(out, 0)


def gather_nemotron_h_hf_state_dict(model, vocab_size: int) -> dict[str, torch.Tensor]:
    """Every HF tensor of a Nemotron-H ``MambaModel`` (checkpoint names), whole, on every
    train rank (a collective over the TP and whole training worlds)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    c = model.config
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        parts = _tp_parts(param)
        dim = getattr(param, "partition_dim", None)  # conv1d, A_log, D, dt_bias, norm: None (dim 0)
        dim = 0 if dim is None else dim
        full = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
        if name == "embedding.word_embeddings.weight":
            out["backbone.embeddings.weight"] = full[:vocab_size]
            continue
        if name == "output_layer.weight":
            out["lm_head.weight"] = full[:vocab_size]
            continue
        if name == "decoder.final_norm.weight":
            out["backbone.norm_f.weight"] = full
            continue
        layer_index, rest = name.split(".", 3)[2], name.split(".", 3)[3]
        p = f"backbone.layers.{model.decoder.layers[int(layer_index)].layer_number - 1}"
        d_inner, g = c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
        if rest == "mixer.in_proj.weight":
            out[f"{p}.mixer.in_proj.weight"] = _by_stream(
                parts, [d_inner // tp, d_inner // tp, g // tp, g // tp, c.mamba_num_heads // tp])
        elif rest in ("mixer.conv1d.weight", "mixer.conv1d.bias"):
            out[f"{p}.{rest}"] = _by_stream(parts, [d_inner // tp, g // tp, g // tp])
        elif rest == "self_attention.linear_qkv.weight":  # per KV group [q heads, k, v]
            hd, nkv = c.kv_channels, c.num_query_groups
            per = c.num_attention_heads // nkv
            q, k, v = [], [], []
            for group in full.split((per + 2) * hd, 0):
                q.append(group[:per * hd])
                k.append(group[per * hd:(per + 1) * hd])
                v.append(group[(per + 1) * hd:])
            for which, rows in (("q", q), ("k", k), ("v", v)):
                out[f"{p}.mixer.{which}_proj.weight"] = torch.cat(rows, 0)
        else:
            out[f"{p}.{_LAYER_NAMES[rest]}"] = full
    mine = {n: t.detach().cpu() for n, t in out.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        for n, t in part.items():
            if n in merged and not torch.equal(merged[n], t):
                raise ValueError(f"reference: two ranks hold different copies of {n}")
            merged.setdefault(n, t.clone())
    return merged
