"""The payload's plain maps as frozen records: the model's HF sizes (``HFConfig``) and the
two sides' parallel layouts (``GenLayout``, ``TrainLayout``).

Torch + stdlib only. On the wire they stay plain maps (``wire.codec``); ``RefitPayload``
parses them once, and everything past that point reads fields (``cfg.num_experts``), never
keys. A key without a field is kept as it came (``extra``; ``value(key)`` reads it) and
``to_plain`` gives back exactly the keys that came, in their order, so a payload round-trips
unchanged. Values are not converted: whole-payload validation (``wire.check``) has checked
the ones the receiver computes with; lists become tuples (the records are frozen).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional, TypeVar

from megatron_reshard.errors import BadInputTypeError

_R = TypeVar("_R", bound="PlainRecord")


def _frozen(value: Any) -> Any:
    """Read-only plain data: lists become tuples, maps mappingproxies."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    return value


def _plain(value: Any) -> Any:
    """Plain data back from ``_frozen`` (what the wire takes: lists and dicts)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class PlainRecord:
    """A plain map as a frozen record: one field per known key (None: absent), the rest in
    ``extra``; ``keys`` remembers which keys came, in order."""

    keys: tuple[str, ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()

    WHAT: ClassVar[str] = "map"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("keys", "extra"))

    @classmethod
    def of(cls: type[_R], value: Any) -> _R:
        """``value`` itself if already this record, else parsed from a map (None: empty)."""
        if isinstance(value, cls):
            return value
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise BadInputTypeError(f"{cls.WHAT} is a {type(value).__name__}, expected a map")
        known = set(cls.field_names())
        items = [(str(k), v) for k, v in value.items()]
        return cls(keys=tuple(k for k, _ in items),
                   extra=tuple((k, _frozen(v)) for k, v in items if k not in known),
                   **{k: _frozen(v) for k, v in items if k in known})

    def value(self, key: str, default: Any = None) -> Any:
        """A key without a field of its own (``extra``), or ``default``."""
        return dict(self.extra).get(key, default)

    def to_plain(self) -> dict[str, Any]:
        """The map that came: its keys, in order, plain data only."""
        extra = dict(self.extra)
        return {k: _plain(extra[k] if k in extra else getattr(self, k)) for k in self.keys}


@dataclass(frozen=True)
class HFConfig(PlainRecord):
    """The model's HF sizes (payload ``hf_config``; the train side's ``HF_CONFIG_KEYS``).

    The receiver computes vLLM's per-rank layout from them (``receiver.targets``,
    ``vllm_layout``). MLA fields are set for DeepSeek-V3-style attention only.
    """

    WHAT: ClassVar[str] = "hf_config"

    family: Optional[str] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    num_experts: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    vocab_size: Optional[int] = None
    tie_word_embeddings: Optional[bool] = None
    gated: Optional[bool] = None
    qk_norm: Optional[bool] = None
    num_experts_per_tok: Optional[int] = None
    shared_expert_intermediate_size: Optional[int] = None
    moe_layers: Optional[tuple[int, ...]] = None
    attention_bias: Optional[bool] = None
    rms_norm_eps: Optional[float] = None
    torch_dtype: Optional[str] = None
    router_expert_bias: Optional[bool] = None
    # MLA (DeepSeek-V3 family)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # Qwen3-Next (Gated-DeltaNet layers, the attention output gate)
    linear_num_key_heads: Optional[int] = None
    linear_num_value_heads: Optional[int] = None
    linear_key_head_dim: Optional[int] = None
    linear_value_head_dim: Optional[int] = None
    linear_conv_kernel_dim: Optional[int] = None
    attn_output_gate: Optional[bool] = None
    layer_types: Optional[tuple[str, ...]] = None
    # Nemotron-H (Mamba-2 layers)
    mamba_num_heads: Optional[int] = None
    mamba_head_dim: Optional[int] = None
    n_groups: Optional[int] = None
    ssm_state_size: Optional[int] = None


@dataclass(frozen=True)
class GenLayout(PlainRecord):
    """The generation side's parallel sizes (payload ``gen_layout``)."""

    WHAT: ClassVar[str] = "gen_layout"

    tp: Optional[int] = None
    ep: Optional[int] = None
    pp: Optional[int] = None
    world_size: Optional[int] = None


@dataclass(frozen=True)
class TrainLayout(PlainRecord):
    """The training side's parallel sizes as read from ``parallel_state`` (payload
    ``train_layout``)."""

    WHAT: ClassVar[str] = "train_layout"

    tp: Optional[int] = None
    pp: Optional[int] = None
    ep: Optional[int] = None
    etp: Optional[int] = None
    dp: Optional[int] = None
    cp: Optional[int] = None
    world_size: Optional[int] = None


__all__ = ["GenLayout", "HFConfig", "PlainRecord", "TrainLayout"]
