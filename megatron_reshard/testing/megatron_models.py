"""Tiny Megatron-Core GPT models for CPU tests and the demo.

``build_gpt_model(**spec)`` builds this rank's part of a GPT model (local layer spec,
``use_cpu_initialization=True``) under the already initialised ``parallel_state``, then
overwrites every parameter with deterministic values derived from its *global* identity
(global layer, global expert, TP rank for TP-sharded params): replicated copies agree across
ranks, while different layers, experts and shards all differ, so a mixed-up index cannot
go unnoticed in a bit-for-bit comparison.
"""

from __future__ import annotations

import contextlib
import re
import zlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TinyGPTSpec:
    """What a tiny model is made of (plain data: it crosses into worker processes)."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    ffn_hidden_size: int = 48
    vocab_size: int = 200  # real vocab; the model pads it like Megatron's trainer does
    make_vocab_size_divisible_by: int = 128
    gated: bool = True
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_layer_freq: object = 1  # int or list of 0/1 per layer (DeepSeek-style first dense layers)
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    tie_embeddings: bool = False
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    dtype: str = "bfloat16"
    seed: int = 1234
    # DeepSeek-V3 style: MLA attention (q_lora_rank None: no q LoRA, a plain q projection)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 16  # HF qk_nope_head_dim
    qk_pos_emb_head_dim: int = 8  # HF qk_rope_head_dim
    v_head_dim: int = 16
    # MLA RoPE: "rope" (plain) or "yarn" (DeepSeek-V3's long-context scaling)
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    # DeepSeek-V3 routing: sigmoid scores, score-correction bias (Megatron expert_bias)
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    layernorm_epsilon: float = 1e-5
    mtp_num_layers: Optional[int] = None
    # gpt-oss: learnable softmax offsets (attention sinks), a bias on every linear and on the
    # router, a sliding window on every other layer (window_attn_skip_freq=2: layers 1, 3, ...
    # in Megatron's 1-based numbering, HF's 0, 2, ...), gpt-oss's clamped GLU
    softmax_type: str = "vanilla"
    add_bias_linear: bool = False
    window_size: Optional[tuple] = None
    window_attn_skip_freq: Optional[int] = None
    gpt_oss_activation: bool = False
    # GLM-4.5: RoPE over the first rotary_percent of each head (HF partial_rotary_factor)
    rotary_percent: float = 1.0
    # Qwen3-Next: megatron-core's own Gated-DeltaNet layers ("gated_delta_net"; one full
    # attention layer every linear_attention_freq layers) and the attention output gate
    experimental_attention_variant: Optional[str] = None
    linear_attention_freq: Optional[int] = None
    attention_output_gate: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron trainer's padding: round up to a multiple of ``divisible_by · tp``."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(spec: TinyGPTSpec):
    """The ``TransformerConfig`` of ``spec`` under the live parallel state."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = getattr(torch, spec.dtype)
    moe = spec.num_moe_experts is not None
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated,
        activation_func=F.silu if spec.gated else F.gelu,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        normalization="RMSNorm",
        qk_layernorm=spec.qk_layernorm,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        num_layers_in_first_pipeline_stage=spec.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=spec.num_layers_in_last_pipeline_stage,
        sequence_parallel=False,
        pipeline_dtype=dtype,
        layernorm_epsilon=spec.layernorm_epsilon,
        mtp_num_layers=spec.mtp_num_layers,
        softmax_type=spec.softmax_type,
        window_size=tuple(spec.window_size) if spec.window_size else None,
        window_attn_skip_freq=spec.window_attn_skip_freq,
    )
    if spec.gpt_oss_activation:
        # gpt-oss: (clamp(up) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=7): Megatron's
        # quick_gelu GLU with its linear offset and clamp (unfused: the fused kernel is CUDA)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kwargs.update(activation_func=quick_gelu, glu_linear_offset=1.0,
                      activation_func_clamp_value=7.0, bias_activation_fusion=False)
    if spec.multi_latent_attention:
        # by default plain RoPE (rotary_scaling_factor 1 keeps mscale 1 and the softmax scale
        # 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)); MLA norms are built only with qk_layernorm
        kwargs.update(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                      qk_head_dim=spec.qk_head_dim, qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
                      v_head_dim=spec.v_head_dim, rope_type=spec.rope_type,
                      rotary_scaling_factor=spec.rotary_scaling_factor, mscale=spec.mscale,
                      mscale_all_dim=spec.mscale_all_dim,
                      original_max_position_embeddings=spec.original_max_position_embeddings,
                      qk_layernorm=True, num_query_groups=spec.num_attention_heads)
    if moe:
        kwargs.update(
            num_moe_experts=spec.num_moe_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
            moe_router_topk=spec.moe_router_topk,
            moe_layer_freq=spec.moe_layer_freq,
            moe_token_dispatcher_type="allgather",
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=spec.moe_shared_expert_gate,
            moe_router_score_function=spec.moe_router_score_function,
            moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
            moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        )
    if spec.experimental_attention_variant:
        kwargs.update(experimental_attention_variant=spec.experimental_attention_variant,
                      linear_attention_freq=spec.linear_attention_freq,
                      linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
                      linear_key_head_dim=spec.linear_key_head_dim,
                      linear_value_head_dim=spec.linear_value_head_dim,
                      linear_num_key_heads=spec.linear_num_key_heads,
                      linear_num_value_heads=spec.linear_num_value_heads)
    if spec.attention_output_gate:
        kwargs.update(attention_output_gate=True)
    if spec.multi_latent_attention:
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def build_gpt_model(spec: TinyGPTSpec):
    """This rank's ``GPTModel`` for ``spec`` (parallel_state must be initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(spec)
    torch.manual_seed(spec.seed)
    layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if spec.multi_latent_attention:
        for layer in layer_spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _mla_local_core_attention()
    gdn = spec.experimental_attention_variant == "gated_delta_net"
    if gdn:
        layer_spec = gated_delta_net_block_spec(config, layer_spec)
    with _cuda_device_is_cpu(spec.multi_latent_attention or spec.moe_router_enable_expert_bias
                             or spec.softmax_type != "vanilla" or gdn), \
            _mla_without_te(spec.multi_latent_attention), _gated_delta_net_on_cpu(gdn):
        model = _gpt_model(GPTModel, config, layer_spec, spec, ps)
    fill_distinct_(model, spec.seed)
    return model


@contextlib.contextmanager
def _cuda_device_is_cpu(active: bool):
    """megatron-core 0.16.1 places two things with ``torch.cuda.current_device()`` whatever
    ``use_cpu_initialization`` says: MLA's rotary tables (``MLASelfAttention`` does not pass
    the flag on), the router's ``expert_bias`` buffers and the learnable ``softmax_offset``
    of ``DotProductAttention`` (gpt-oss's sinks). Without CUDA that call raises, so
    while such a model is built on a machine without CUDA it answers the CPU device;
    restored on exit."""
    if not active or torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


def gated_delta_net_block_spec(config, block):
    """``block`` (the local GPT decoder spec) with megatron-core's own ``GatedDeltaNet`` in
    the linear-attention layers of ``config``'s pattern (``get_linear_attention_pattern``).

    megatron-core 0.16.1's hybrid block spec
    (``get_transformer_block_with_experimental_attention_variant_spec``) asserts
    ``transformer_impl == "transformer_engine"`` and builds its GDN ``in_proj`` from TE's
    ``TELayerNormColumnParallelLinear`` (the input norm fused in). This is the same layer
    with the local modules the local GPT spec uses: ``in_proj`` a ``ColumnParallelLinear``
    after the layer's own ``input_layernorm``, ``out_norm`` ``WrappedTorchNorm``, ``out_proj``
    a ``RowParallelLinear``. Layers of the pattern's full attention keep the local spec.
    """
    import dataclasses

    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))
    # the block spec holds this PP stage's layers: the pattern from its first global layer on
    offset = get_transformer_layer_offset(config)
    pattern = get_linear_attention_pattern(config)[offset:]
    # the local block spec shares one layer spec object between layers: copy, then replace
    layers = [dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=gdn))
              if linear else layer for layer, linear in zip(block.layer_specs, pattern)]
    return dataclasses.replace(block, layer_specs=layers)


@contextlib.contextmanager
def _gated_delta_net_on_cpu(active: bool):
    """What megatron-core 0.16.1's ``GatedDeltaNet.__init__`` needs beyond the CPU build,
    though a refit needs only its parameters (restored on exit):

    - it raises ImportError when the flash-linear-attention package (``fla``: Triton
      kernels, CUDA) is absent (``ssm/gated_delta_net.py``, ``if not HAVE_FLA``), though
      only ``forward`` calls ``fla`` (``chunk_gated_delta_rule``, ``l2norm``): while the
      model is built ``HAVE_FLA`` says True; a forward still fails without ``fla``;
    - its ``reset_parameters`` forks the CUDA RNG tracker (``get_cuda_rng_tracker().fork()``)
      whatever ``use_cpu_initialization`` says, which has no state without CUDA: it is
      skipped (``fill_distinct_`` then sets every parameter, these included);
    - ``conv1d``, ``dt_bias`` and ``A_log`` are placed on ``torch.cuda.current_device()``
      (``_cuda_device_is_cpu`` answers the CPU).
    """
    if not active:
        yield
        return
    from megatron.core.ssm import gated_delta_net

    saved = gated_delta_net.HAVE_FLA, gated_delta_net.GatedDeltaNet.reset_parameters
    gated_delta_net.HAVE_FLA = True
    gated_delta_net.GatedDeltaNet.reset_parameters = lambda self: None
    try:
        yield
    finally:
        gated_delta_net.HAVE_FLA, gated_delta_net.GatedDeltaNet.reset_parameters = saved


@contextlib.contextmanager
def _mla_without_te(active: bool):
    """Without Transformer Engine, megatron-core 0.16.1's ``multi_latent_attention`` module
    still sets ``HAVE_TE = True`` (its guarded import succeeds, ``TELinear`` being a stand-in
    object that is not a class) and then calls ``isinstance(linear_proj, TELinear)``, which
    raises. While an MLA model is built in that state,
    ``HAVE_TE`` says False, which is the truth; restored on exit."""
    if not active:
        yield
        return
    from megatron.core.transformer import multi_latent_attention as mla_module

    saved = mla_module.HAVE_TE
    if not isinstance(getattr(mla_module, "TELinear", None), type):
        mla_module.HAVE_TE = False
    try:
        yield
    finally:
        mla_module.HAVE_TE = saved


_MLA_CORE_ATTENTION = None


def _mla_local_core_attention():
    """The local ``DotProductAttention`` made to accept what MLA builds it with.

    megatron-core 0.16.1's ``MLASelfAttention`` passes ``k_channels`` (qk head dim) and
    ``v_channels`` (v head dim) to its core attention; only the Transformer-Engine class
    takes them. The local class computes with any head dims (its matmuls read them from
    the tensors) except for the width of its output, which it takes from ``kv_channels``:
    this subclass drops the two arguments and sets that width from ``v_channels``.
    """
    global _MLA_CORE_ATTENTION
    if _MLA_CORE_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLALocalDotProductAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
                super().__init__(*args, **kwargs)
                if v_channels is not None:
                    self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        _MLA_CORE_ATTENTION = MLALocalDotProductAttention
    return _MLA_CORE_ATTENTION


def _gpt_model(GPTModel, config, layer_spec, spec: TinyGPTSpec, ps):
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by,
                                     ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,
    )


_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@torch.no_grad()
def fill_distinct_(model, seed: int) -> None:
    """Overwrite every parameter with values keyed by its global identity (see module doc).
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    layers = model.decoder.layers
    for name, param in model.named_parameters():
        key = name
        m = _LOCAL_LAYER.search(name)
        if m is not None:
            global_layer = layers[int(m.group(1))].layer_number
            key = key.replace(m.group(0), f"decoder.layers.<{global_layer}>.")
        m = _LOCAL_EXPERT.search(name)
        if m is not None:
            n_local = len(layers[int(_LOCAL_LAYER.search(name).group(1))].mlp.experts.local_experts)
            key = key.replace(m.group(0), f"experts.<{ep_rank * n_local + int(m.group(1))}>.")
        # the attention sinks are per local head but carry no TP attribute (Megatron's own
        # sharded_state_dict splits them on dim 0 over TP)
        sharded = (getattr(param, "tensor_model_parallel", False) or name.endswith("softmax_offset")) \
            and m is None
        if sharded:
            key += f"|tp{tp_rank}"
        if getattr(param, "shared_embedding", False):  # tied output layer on the last stage
            key = "embedding.word_embeddings.weight" + (f"|tp{tp_rank}" if sharded else "")
        gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) ^ seed) & 0x7FFFFFFF)
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        param.copy_(values.to(param.dtype))
    # the router's score-correction bias is a buffer (zeros at init): distinct values too, so
    # a bias sent to the wrong layer or left at zero changes the routing
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            global_layer = layers[int(_LOCAL_LAYER.search(name).group(1))].layer_number
            gen = torch.Generator().manual_seed((global_layer * 7919 + seed) & 0x7FFFFFFF)
            buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype))


def model_spec_dict(spec: TinyGPTSpec) -> dict:
    return asdict(spec)
