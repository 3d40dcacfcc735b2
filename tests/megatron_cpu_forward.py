"""Megatron-Core's own forward on CPU (gloo), for the transformers oracle (tests only).

megatron-core 0.16.1 builds and trains on CPU, but its inference forward assumes CUDA in a
few places. Every workaround the oracle tests need lives in this file, each undone on exit
so the pool's long-lived workers are left as they were:

1. ``torch.cuda.current_device`` is called to place new buffers (TP all-gathers in
   ``tensor_parallel.mappings``, the MoE router and dispatcher, rotary tables): it returns
   the CPU device here.
2. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is only bound when
   Transformer Engine imports; the router's fp32 GEMM reads the name unconditionally, so
   it is bound to ``None`` (the plain ``torch`` path) while the shim is active.
3. Attention dropout runs inside ``get_cuda_rng_tracker().fork()``, which needs CUDA RNG
   states; Megatron's inference tracker (``inference_rng_tracker=True``) forks nothing.
   The previous tracker is restored on exit.
5. Sliding-window attention (gpt-oss): the unfused softmax builds its window mask with
   ``device="cuda"`` (``transformer.utils.get_sliding_window_causal_mask``); the same band
   (key j seen by query i iff ``i' - left <= j <= i' + right``, ``i' = i + skv - sq``) is
   built on the CPU here.

One more stand-in is needed while a model is *built*, not run:

4. With tied embeddings and PP > 1, ``LanguageModule.setup_embeddings_and_output_layer``
   moves the last stage's copy of the embedding to CUDA (``weight.data.cuda()``) before
   the all-reduce that makes both copies equal; ``cpu_build_shims`` makes ``Tensor.cuda``
   return the tensor itself during the build.

The rest is plain configuration, not a workaround: the local (non-TE) layer spec, every
fusion off (the ``TransformerConfig`` defaults), the ``allgather`` MoE dispatcher,
``model.eval()`` and an explicit causal mask (the local attention reads the mask it is
given). Pipeline stages pass the hidden states with plain ``dist.send``/``dist.recv`` on
the PP group (no schedule: one micro-batch, forward only).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

_MISSING = object()


@contextlib.contextmanager
def cpu_forward_shims() -> Iterator[None]:
    """Stand-ins 1-3 above, active inside the ``with`` block only."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    saved_device = torch.cuda.current_device
    saved_gemm = getattr(moe_utils, "te_general_gemm", _MISSING)
    saved_tracker = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    if saved_gemm is _MISSING:
        moe_utils.te_general_gemm = None
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    saved_window = fused_softmax.get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_window_mask
    try:
        yield
    finally:
        fused_softmax.get_sliding_window_causal_mask = saved_window
        torch.cuda.current_device = saved_device  # type: ignore[assignment]
        if saved_gemm is _MISSING:
            del moe_utils.te_general_gemm
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


def _cpu_window_mask(sq: int, skv: int, window) -> torch.Tensor:
    """True where a query must NOT see a key: outside the causal window (stand-in 5)."""
    query = torch.arange(sq).unsqueeze(1) + (skv - sq)
    key = torch.arange(skv).unsqueeze(0)
    return ~((key >= query - window[0]) & (key <= query + window[1]))


@contextlib.contextmanager
def cpu_build_shims() -> Iterator[None]:
    """Stand-in 4 above, active inside the ``with`` block only."""
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved  # type: ignore[method-assign]


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's attention mask convention: True where a query must NOT see a key."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


@torch.no_grad()
def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Full logits ``[batch, seq, vocab_size]`` of ``tokens`` (float32) from this rank's
    Megatron model chunk; collective over the training world (every rank calls it).

    Returned on the last PP stage's ranks (all TP ranks there hold the same gathered
    logits), None elsewhere. Megatron's vocab padding columns are dropped.
    """
    from megatron.core import parallel_state as ps

    model.eval()
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = causal_mask(seq)
    hidden = model.config.hidden_size
    with cpu_forward_shims():
        if not ps.is_pipeline_first_stage():
            received = torch.empty(seq, batch, hidden, dtype=model.config.params_dtype)
            dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank(),
                      group=ps.get_pipeline_model_parallel_group())
            model.set_input_tensor(received)
        out = model(tokens, positions, mask)
        if not ps.is_pipeline_last_stage():
            # out: this stage's hidden states [seq, batch, hidden], the next stage's input
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(),
                      group=ps.get_pipeline_model_parallel_group())
            return None
    # out: [batch, seq, padded vocab / TP], this TP rank's vocab columns
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :vocab_size].float()
