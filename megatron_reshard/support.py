"""``check_nccl_reshard_refit_support``: may this NeMo-RL config use nccl_reshard refit?

Stdlib only. Decides from the config alone, with the rules and key names of NeMo-RL's
config schema (``policy.generation.*``, ``policy.megatron_cfg.*``, ``policy.precision``),
so that the drop-in accepts and rejects exactly what the seed module does. Every violation
is one entry, and all of them are raised together in one ``ValueError``.

A missing key reads as the schema's default (``colocated.enabled`` False, ETP 1, vLLM
TP/EP/PP 1, FP8 off); a key present with ``None`` stays ``None``, as the seed reads it.

FP8: the rules accept the two FP8 pairs the seed accepts (blockwise-FP8 training storage
→ FP8 generation, and BF16 training → MXFP8 generation quantized on the receiver); the
project refits both (``MegatronRefitSource(gen_quant="block_fp8" | "mxfp8")``, see README
"FP8 refit"), and its native API also serves BF16 → block FP8, which these rules, as the
seed's, reject.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_reshard.errors import BadInputError, BadInputTypeError

# Generation precisions the refit can serve: BF16 spellings, or FP8.
GEN_PRECISIONS = (None, "auto", "bf16", "bfloat16", "fp8")


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node[key]`` for a mapping or ``node.key`` for an object; ``default`` if absent.

    Like ``dict.get``: a key present with the value ``None`` returns ``None``.
    """
    if isinstance(node, Mapping):
        return node.get(key, default)
    return getattr(node, key, default)


def _section(node: Any, key: str) -> Any:
    """A nested config section; absent or ``None`` reads as empty."""
    value = _get(node, key)
    return {} if value is None else value


def _policy(master_config: Any) -> Any:
    """The ``policy`` section of an object with ``.policy`` or a mapping with ``"policy"``."""
    if isinstance(master_config, Mapping):
        return _section(master_config, "policy")
    if hasattr(master_config, "policy"):
        return _section(master_config, "policy")
    raise BadInputTypeError(
        "check_nccl_reshard_refit_support: master_config must be a mapping with a 'policy' key "
        f"or an object with a .policy attribute; got {type(master_config).__name__}"
    )


def _deployment_violations(policy: Any) -> list[str]:
    """Placement and backend rules: separate GPUs, vLLM, fixed experts, no real quantization."""
    generation = _section(policy, "generation")
    problems = []
    if _get(_section(generation, "colocated"), "enabled", False):
        problems.append("policy.generation.colocated.enabled must be False: nccl_reshard refit moves "
                        "weights between separate training and generation GPUs (found True)")
    backend = _get(generation, "backend")
    if backend != "vllm":
        problems.append(f"policy.generation.backend must be 'vllm' (got {backend!r}): the refit "
                        "writes into vLLM generation workers")
    if _get(_section(generation, "vllm_kwargs"), "enable_eplb"):
        problems.append("policy.generation.vllm_kwargs.enable_eplb must be False: the expert-to-rank "
                        "map is fixed when the refit is set up, and EPLB moves experts afterwards")
    if _get(generation, "real_quant"):
        problems.append("policy.generation.real_quant must be False: real-quantized generation "
                        "params load through vLLM's weight loaders, which the direct writes skip")
    return problems


def _backend_violations(policy: Any) -> list[str]:
    """Training backend: Megatron on, DTensor off."""
    problems = []
    if not _get(_section(policy, "megatron_cfg"), "enabled", False):
        problems.append("policy.megatron_cfg.enabled must be True: the refit sends weights from the "
                        "Megatron training backend")
    if _get(_section(policy, "dtensor_cfg"), "enabled", False):
        problems.append("policy.dtensor_cfg.enabled must be False: the DTensor training backend is "
                        "not a refit source")
    return problems


def _megatron_parallel_violations(megatron_cfg: Any) -> list[str]:
    """Megatron parallel layouts the train-side placement rules do not describe."""
    problems = []
    etp = _get(megatron_cfg, "expert_tensor_parallel_size", 1)
    if etp not in (1, None):
        problems.append(f"policy.megatron_cfg.expert_tensor_parallel_size must be 1 or unset "
                        f"(got {etp!r}): expert tensor parallelism is not supported")
    layout = _get(megatron_cfg, "pipeline_model_parallel_layout")
    if layout is not None:
        problems.append(f"policy.megatron_cfg.pipeline_model_parallel_layout must be unset "
                        f"(got {layout!r})")
    vpp = _get(megatron_cfg, "virtual_pipeline_model_parallel_size")
    if vpp not in (None, 1):
        problems.append(f"policy.megatron_cfg.virtual_pipeline_model_parallel_size must be None or 1 "
                        f"(got {vpp!r})")
    for key in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if _get(megatron_cfg, key, False):
            problems.append(f"policy.megatron_cfg.{key} must be False (got {_get(megatron_cfg, key)!r})")
    return problems


def _precision_violations(policy: Any) -> list[str]:
    """Training storage ↔ generation precision.

    Accepted: BF16 → BF16; blockwise-FP8 storage (``fp8_param`` + recipe 'blockwise') →
    FP8; BF16 storage (``policy.precision == 'bfloat16'``) → MXFP8 (``is_mx``), quantized on
    the receiver. Anything else would put bytes of one format into params of another.
    """
    megatron_cfg = _section(policy, "megatron_cfg")
    fp8_cfg = _section(megatron_cfg, "fp8_cfg")
    vllm_cfg = _section(_section(policy, "generation"), "vllm_cfg")
    fp8_param = _get(fp8_cfg, "fp8_param", False)
    recipe = _get(fp8_cfg, "fp8_recipe")
    is_mx = _get(vllm_cfg, "is_mx")
    train_precision = _get(policy, "precision")
    gen_precision = _get(vllm_cfg, "precision")

    problems = []
    if gen_precision not in GEN_PRECISIONS:
        problems.append(f"policy.generation.vllm_cfg.precision must be one of "
                        f"{', '.join(repr(p) for p in GEN_PRECISIONS)} (got {gen_precision!r}): the refit "
                        "copies bytes, so generation params must have the training storage's format")
    if gen_precision == "fp8":
        if fp8_param and is_mx:
            problems.append("policy.generation.vllm_cfg.is_mx=True does not support blockwise-FP8 storage "
                            "(policy.megatron_cfg.fp8_cfg.fp8_param=True): MXFP8 generation is quantized "
                            "on the receiver from BF16 training storage")
        elif fp8_param and recipe != "blockwise":
            problems.append(f"policy.megatron_cfg.fp8_cfg.fp8_recipe must be 'blockwise' with "
                            f"fp8_param=True (got {recipe!r}): only that recipe stores per-block "
                            "scale_inv tensors in the layout vLLM's block-FP8 params use")
        elif not fp8_param and is_mx and train_precision != "bfloat16":
            problems.append(f"policy.generation.vllm_cfg.is_mx=True with fp8_param=False requires "
                            f"policy.precision='bfloat16' (got {train_precision!r}): MXFP8 is quantized "
                            "on the receiver from BF16 training storage")
        elif not fp8_param and not is_mx:
            problems.append("policy.generation.vllm_cfg.precision='fp8' needs either "
                            "policy.megatron_cfg.fp8_cfg.fp8_param=True (blockwise-FP8 training storage) "
                            "or policy.generation.vllm_cfg.is_mx=True for BF16-to-MXFP8 refit")
    elif fp8_param:
        problems.append(f"policy.megatron_cfg.fp8_cfg.fp8_param=True requires "
                        f"policy.generation.vllm_cfg.precision='fp8' (got {gen_precision!r}): BF16 "
                        "generation params cannot take FP8 training storage")
    return problems


def _vllm_parallel_violations(policy: Any) -> list[str]:
    """vLLM layouts the receiver serves: EP 1 or EP == TP (experts by index), no PP."""
    generation = _section(policy, "generation")
    if _get(generation, "backend") != "vllm":
        return []
    vllm_cfg = _section(generation, "vllm_cfg")
    tp = _get(vllm_cfg, "tensor_parallel_size", 1)
    ep = _get(vllm_cfg, "expert_parallel_size", 1)
    pp = _get(vllm_cfg, "pipeline_parallel_size", 1)
    problems = []
    if ep != 1 and ep != tp:
        problems.append(f"policy.generation.vllm_cfg.expert_parallel_size must be 1 or equal to "
                        f"tensor_parallel_size (got expert_parallel_size={ep!r}, tensor_parallel_size={tp!r})")
    if pp != 1:
        problems.append(f"policy.generation.vllm_cfg.pipeline_parallel_size must be 1 (got {pp!r})")
    return problems


def nccl_reshard_refit_violations(master_config: Any) -> list[str]:
    """Every violated precondition, one line each starting with its config key; empty if none."""
    policy = _policy(master_config)
    problems = _deployment_violations(policy) + _backend_violations(policy)
    megatron_cfg = _section(policy, "megatron_cfg")
    if _get(megatron_cfg, "enabled", False):
        problems += _megatron_parallel_violations(megatron_cfg) + _precision_violations(policy)
    return problems + _vllm_parallel_violations(policy)


def check_nccl_reshard_refit_support(master_config: Any) -> None:
    """Raise one ValueError listing every violated nccl_reshard refit precondition; no-op if none.

    ``master_config`` is an object with a ``.policy`` attribute (as NeMo-RL passes it) or a
    mapping with a ``"policy"`` key; sections may be mappings or attribute objects. Not
    checkable from the config (enforced at run time): MoE experts must use
    ``...experts.N.{gate_proj,up_proj,down_proj}.weight`` naming (or the pre-grouped form).
    """
    problems = nccl_reshard_refit_violations(master_config)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise BadInputError(f"nccl_reshard refit is not supported with this config "
                         f"({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n{lines}")
