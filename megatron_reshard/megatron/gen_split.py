"""Whether vLLM can split a model's attention over the generation TP size: the one rule,
checked when a ``MegatronRefitSource`` is built (before any collective) and by the demo's
option checks (``tools.run_config``), so both refuse the same sizes with the same words.

vLLM splits the query heads evenly over TP, each KV head over TP / KV-heads ranks (or
KV-heads / TP per rank), and a Gated-DeltaNet layer by whole key heads. The attention
rule itself is ``vllm_layout.AttentionHeads.tp_problem``; this module adds the
Gated-DeltaNet key heads and says which model sizes the refusal comes from.

Torch is imported only when a size is checked (``vllm_layout``, ``model_info``), so the
demo's parser can import this module without it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from megatron_reshard.errors import BadInputError
from megatron_reshard.megatron import nemotron_h


def gen_tp_problem(tp: int, num_heads: int, num_kv_groups: int,
                   linear_key_heads: int = 0) -> Optional[str]:
    """Why vLLM cannot split this attention over ``tp`` generation ranks (None: it can).
    ``num_kv_groups``: KV heads (Megatron's query groups; the heads themselves for MLA);
    ``linear_key_heads``: Gated-DeltaNet key heads (0: none)."""
    from megatron_reshard.vllm_layout.dense import AttentionHeads  # torch: only when checking

    why = AttentionHeads(num_heads, num_kv_groups, 1).tp_problem(tp)
    if why is None and linear_key_heads and linear_key_heads % tp:
        why = f"{linear_key_heads} Gated-DeltaNet key heads do not split over tp_size={tp}"
    if why is None:
        return None
    linear = (f" and {linear_key_heads} Gated-DeltaNet key heads, which the tp_size must "
              f"divide too" if linear_key_heads else "")
    return (f"{why} (the model has {num_heads} attention heads in {num_kv_groups} KV groups"
            f"{linear}: vLLM needs a tp_size that divides the heads and divides or is a "
            f"multiple of the KV groups)")


def attention_sizes(config: Any) -> tuple[int, int, int]:
    """(attention heads, KV groups, Gated-DeltaNet key heads) of a megatron-core
    ``TransformerConfig``; MLA has one KV head per query head in vLLM's layout."""
    heads = int(config.num_attention_heads)
    kv = heads if getattr(config, "multi_latent_attention", False) else int(
        getattr(config, "num_query_groups", None) or heads)
    linear = (int(getattr(config, "linear_num_key_heads", 0) or 0)
              if getattr(config, "experimental_attention_variant", None) == "gated_delta_net"
              else 0)
    return heads, kv, linear


def check_gen_attention_split(model: Any, gen_parallelism: Any) -> None:
    """``BadInputError`` naming the heads and groups when vLLM cannot split ``model``'s
    attention over ``gen_parallelism["tp_size"]``. Anything it cannot read (a malformed
    size, no Megatron model) is left to ``train_plan.check_inputs``, which names it."""
    tp = gen_parallelism.get("tp_size", 1) if isinstance(gen_parallelism, Mapping) else None
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return
    from megatron_reshard.megatron.model_info import unwrap_model  # torch

    bare, _ = unwrap_model(model)
    config = getattr(bare, "config", None)
    if config is None or not getattr(config, "num_attention_heads", None):
        return
    why = gen_tp_problem(tp, *attention_sizes(config))
    if why is None and type(bare).__name__ == "MambaModel":  # Nemotron-H's Mamba-2 layers
        why = nemotron_h.mamba_gen_tp_problem(config, tp)
    if why is not None:
        raise BadInputError(f"gen_parallelism['tp_size']={tp}: {why}")


__all__ = ["attention_sizes", "check_gen_attention_split", "gen_tp_problem"]
