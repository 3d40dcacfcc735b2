"""``check_nccl_reshard_refit_support``: can this NeMo-RL style config use nccl_reshard refit?

Stdlib only. Decides from the config alone and reports *every* violation in one
``ValueError``, each line naming the config key to change. The key names follow NeMo-RL's
``master_config`` layout (``policy.generation.*``, ``policy.megatron_cfg.*``).

Rules that exist only because this project cannot serve the feature yet are marked
"not supported yet" in their message; each goes away when the feature lands.

Interpretations taken here:

- ``policy.generation.colocated.enabled`` missing counts as colocated (NeMo-RL's default).
- ``policy.megatron_cfg.expert_tensor_parallel_size`` missing/None means Megatron's
  default, which is the tensor parallel size; so ``tp > 1`` with no explicit ETP is ETP > 1.
- "real quantization" = weights that are not plain bf16/fp8 tensors on either side: vLLM
  loading a quantized checkpoint format (``quantization`` set) or Megatron keeping FP8
  parameters (``fp8_cfg.fp8_param``).
- Uneven first/last PP stages (``num_layers_in_first/last_pipeline_stage``) are accepted:
  the train side builds the layer → stage map from the model's real layer numbers. An
  explicit ``pipeline_model_parallel_layout`` is rejected.
- Context parallelism is accepted: CP ranks hold replicas of the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

_MISSING = object()

# (key, predicate on the value -> True when it is a violation, message). Missing keys are
# passed as _MISSING.
_Rule = tuple[str, Callable[[Any], bool], str]


def _truthy(value: Any) -> bool:
    return value is not _MISSING and bool(value)


def _set(value: Any) -> bool:
    return value is not _MISSING and value is not None and value != "" and value != []


def _gt1(value: Any) -> bool:
    return value is not _MISSING and value is not None and int(value) > 1


SIMPLE_RULES: tuple[_Rule, ...] = (
    ("policy.megatron_cfg.enabled", lambda v: not _truthy(v),
     "must be true: nccl_reshard refit sends weights from the Megatron training backend"),
    ("policy.generation.backend", lambda v: v != "vllm",
     "must be 'vllm': nccl_reshard refit writes into vLLM generation workers"),
    ("policy.generation.colocated.enabled", lambda v: v is _MISSING or bool(v),
     "must be false: nccl_reshard refit needs training and generation on separate GPUs (non-colocated)"),
    ("policy.generation.vllm_cfg.enable_eplb", _truthy,
     "must be false: expert load balancing (EPLB) moves experts between vLLM ranks"),
    ("policy.generation.vllm_cfg.vllm_kwargs.enable_eplb", _truthy,
     "must be false: expert load balancing (EPLB) moves experts between vLLM ranks"),
    ("policy.generation.vllm_cfg.quantization", _set,
     "must be unset: real (checkpoint-format) quantization in vLLM is not supported"),
    ("policy.generation.vllm_cfg.vllm_kwargs.quantization", _set,
     "must be unset: real (checkpoint-format) quantization in vLLM is not supported"),
    ("policy.megatron_cfg.fp8_cfg.fp8_param", _truthy,
     "must be false: FP8 (real-quantized) Megatron parameters are not supported"),
    ("policy.megatron_cfg.virtual_pipeline_model_parallel_size", _gt1,
     "must be unset or 1: virtual pipeline parallelism is not supported yet"),
    ("policy.megatron_cfg.pipeline_model_parallel_layout", _set,
     "must be unset: custom pipeline layouts are not supported yet (uneven first/last stages are)"),
    ("policy.generation.vllm_cfg.pipeline_parallel_size", _gt1,
     "must be 1: vLLM pipeline parallelism is not supported yet"),
)

# Supported (train weight format, generation precision) pairs.
SUPPORTED_PRECISION_PAIRS = frozenset({("bf16", "bf16"), ("blockwise-fp8", "fp8"), ("bf16", "mxfp8")})

_PRECISION_ALIASES = {
    "bfloat16": "bf16", "bf16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
    "fp8": "fp8", "mxfp8": "mxfp8",
}


def _lookup(root: Any, dotted: str) -> Any:
    """Walk a dotted key through mappings and attribute objects; _MISSING if absent."""
    node = root
    for part in dotted.split("."):
        if isinstance(node, Mapping):
            node = node.get(part, _MISSING)
        else:
            node = getattr(node, part, _MISSING)
        if node is _MISSING or node is None:
            return _MISSING if node is _MISSING else None
    return node


def _root(master_config: Any) -> Any:
    """Accept a mapping (``{"policy": ...}``) or an object with a ``.policy`` attribute."""
    if isinstance(master_config, Mapping):
        return master_config
    if hasattr(master_config, "policy"):
        return {"policy": master_config.policy}
    raise TypeError(
        f"check_nccl_reshard_refit_support: expected a mapping or an object with a .policy "
        f"attribute, got {type(master_config).__name__}"
    )


def _norm_precision(value: Any) -> Optional[str]:
    if value is _MISSING or value is None:
        return None
    return _PRECISION_ALIASES.get(str(value).lower(), str(value).lower())


def _precision_violation(cfg: Any) -> Optional[str]:
    policy_precision = _norm_precision(_lookup(cfg, "policy.precision")) or "bf16"
    if _truthy(_lookup(cfg, "policy.megatron_cfg.fp8_cfg.enabled")):
        recipe = _lookup(cfg, "policy.megatron_cfg.fp8_cfg.fp8_recipe")
        recipe = "unset" if recipe in (_MISSING, None) else str(recipe)
        train = "blockwise-fp8" if recipe == "blockwise" else f"fp8 ({recipe} recipe)"
        train_keys = "policy.megatron_cfg.fp8_cfg.fp8_recipe"
    else:
        train = policy_precision
        train_keys = "policy.precision / policy.megatron_cfg.fp8_cfg.enabled"
    gen = _norm_precision(_lookup(cfg, "policy.generation.vllm_cfg.precision")) or policy_precision
    if (train, gen) in SUPPORTED_PRECISION_PAIRS:
        return None
    pairs = ", ".join(f"{a}->{b}" for a, b in sorted(SUPPORTED_PRECISION_PAIRS))
    return (
        f"policy.generation.vllm_cfg.precision / {train_keys}: training weights {train} with "
        f"generation precision {gen} is not a supported pair (supported: {pairs})"
    )


def nccl_reshard_refit_violations(master_config: Any) -> list[str]:
    """Every violated precondition, one line each naming its config key; empty if supported."""
    cfg = _root(master_config)
    problems: list[str] = []
    for key, violated, message in SIMPLE_RULES:
        value = _lookup(cfg, key)
        try:
            bad = violated(value)
        except (TypeError, ValueError):
            bad, message = True, f"has an unreadable value {value!r}"
        if bad:
            shown = "missing" if value is _MISSING else repr(value)
            problems.append(f"{key} {message} (found {shown})")
    etp = _lookup(cfg, "policy.megatron_cfg.expert_tensor_parallel_size")
    tp = _lookup(cfg, "policy.megatron_cfg.tensor_model_parallel_size")
    effective_etp = etp if etp not in (_MISSING, None) else tp
    if effective_etp not in (_MISSING, None) and int(effective_etp) > 1:
        how = "" if etp not in (_MISSING, None) else f" (unset, so Megatron uses tensor_model_parallel_size={tp})"
        problems.append(
            f"policy.megatron_cfg.expert_tensor_parallel_size must be 1: expert tensor parallelism "
            f"is not supported yet (effective value {effective_etp}{how})"
        )
    precision = _precision_violation(cfg)
    if precision:
        problems.append(precision)
    return problems


def check_nccl_reshard_refit_support(master_config: Any) -> None:
    """Raise one ValueError listing every violated nccl_reshard refit precondition; no-op if none.

    Not checkable from the config (enforced at run time): MoE experts must use
    ``...experts.N.{gate_proj,up_proj,down_proj}.weight`` naming (or the pre-grouped form).
    """
    problems = nccl_reshard_refit_violations(master_config)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"nccl_reshard refit is not supported with this config ({len(problems)} problems):\n{lines}")
