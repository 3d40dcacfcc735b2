"""The refit benchmark's models: its two cases (Qwen3-proportioned slices, tiny with
``--small``) and a fast build of them on the GPU (parameters filled by a cheap pattern
keyed by their global identity, equal on replicas, instead of CPU random numbers).
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch

from .timing import synchronize

QWEN3_VOCAB = 151936

# Full-size cases: (e2e preset, overrides, train layout, gen layout). Layers come from --layers.
CASES: dict[str, dict[str, Any]] = {
    "moe": dict(model="moe", label="Qwen3-30B-A3B slice, train EP{n} → gen TP{n}",
                overrides=dict(hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                               head_dim=128, num_moe_experts=128, moe_ffn_hidden_size=768,
                               ffn_hidden_size=6144, moe_router_topk=8, vocab_size=QWEN3_VOCAB),
                train=dict(train_tp=1, train_pp=1, train_ep=2)),
    "dense": dict(model="dense", label="Qwen3-8B slice, train TP{n} → gen TP{n}",
                  overrides=dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                 head_dim=128, ffn_hidden_size=12288, vocab_size=QWEN3_VOCAB),
                  train=dict(train_tp=2, train_pp=1, train_ep=1)),
}
# --small: tiny shapes with the same structure (head_dim != hidden / heads as in Qwen3).
SMALL_OVERRIDES = {
    "moe": dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, head_dim=16,
                num_moe_experts=8, moe_ffn_hidden_size=32, ffn_hidden_size=128,
                moe_router_topk=2, vocab_size=500),
    "dense": dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, head_dim=16,
                  ffn_hidden_size=160, vocab_size=500),
}


_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def param_identity(model, name: str, param, tp_rank: int, ep_rank: int) -> str:
    """The global identity of a local param: global layer, global expert, TP shard (as in
    ``megatron.models.fill_distinct_``): equal on replicas, different for anything else."""
    layers = model.decoder.layers
    key = name
    m = _LOCAL_LAYER.search(name)
    if m is not None:
        key = key.replace(m.group(0), f"decoder.layers.<{layers[int(m.group(1))].layer_number}>.")
    e = _LOCAL_EXPERT.search(name)
    if e is not None:
        n_local = len(layers[int(m.group(1))].mlp.experts.local_experts)
        key = key.replace(e.group(0), f"experts.<{ep_rank * n_local + int(e.group(1))}>.")
    sharded = getattr(param, "tensor_model_parallel", False) and e is None
    if sharded:
        key += f"|tp{tp_rank}"
    if getattr(param, "shared_embedding", False):
        key = "embedding.word_embeddings.weight" + (f"|tp{tp_rank}" if sharded else "")
    return key


@torch.no_grad()
def fill_pattern_(param: torch.Tensor, key: int, chunk: int = 1 << 24) -> None:
    """Overwrite ``param`` with a cheap integer-hash pattern of (element index, key), values
    in [-2, 2]: identical on any device (no RNG), computed in chunks on the param's device."""
    flat = param.view(-1)
    n = flat.numel()
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        idx = torch.arange(lo, hi, dtype=torch.int64, device=param.device)
        h = (idx * 2654435761 + key * 97 + 12345) % 2147483647
        vals = ((h >> 7) % 4001 - 2000).to(torch.float32) / 1000.0
        flat[lo:hi].copy_(vals.to(param.dtype))


def build_model_fast(spec, device: torch.device, dtype: torch.dtype):
    """``build_gpt_model`` fast on a GPU: parameters are created and initialised on ``device``
    (CUDA: ``use_cpu_initialization=False``), then overwritten by ``fill_pattern_`` keyed by
    their global identity (``models.fill_distinct_`` draws CPU random numbers instead)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_reshard.testing.megatron_models import padded_vocab_size, transformer_config

    config = transformer_config(spec)
    # Megatron sets the tensor-parallel attributes of a weight only inside its
    # initialisation, so keep it (on the GPU it is cheap); its RNG tracker needs a seed.
    config.use_cpu_initialization = device.type != "cuda"
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                            normalization="RMSNorm")
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by,
                                     ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope")
    model = model.to(device=device, dtype=dtype)
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            ident = param_identity(model, name, param, tp_rank, ep_rank)
            fill_pattern_(param.data, (zlib.crc32(ident.encode()) ^ spec.seed) & 0x7FFFFFFF)
    synchronize(device)
    return model
