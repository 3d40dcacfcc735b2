"""HF names of routed-expert weights, written once: per expert
(``<P>.experts.<i>.<proj>.weight``) and grouped (``<P>.experts.<proj>.weight [E, ...]``, the
payload's name for all experts of one projection).

Torch + stdlib only. The train side groups per-expert names with it (``wire.metadata``,
``megatron.local_specs``, ``megatron.fp8_source``), the receiver maps both forms onto vLLM's
expert tensors (``receiver.targets``), and the test fixtures stack per-expert tensors with it.
"""

from __future__ import annotations

import re

# anchored at the end, so ``..._scale_inv`` siblings never match
PER_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# per expert, or grouped (``index`` None)
EXPERT_WEIGHT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts)\.(?:(?P<index>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def grouped_name(hf_name: str) -> str:
    """``P.experts.<i>.<proj>.weight`` -> ``P.experts.<proj>.weight``; any other name as is."""
    m = PER_EXPERT_RE.match(hf_name)
    return f"{m['prefix']}.{m['proj']}.weight" if m else hf_name


__all__ = ["EXPERT_WEIGHT_RE", "PER_EXPERT_RE", "grouped_name"]
