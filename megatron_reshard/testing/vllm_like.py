"""A stand-in for a vLLM model on one generation rank, and the oracle for what it must hold.

Torch only. ``build_vllm_like_model`` returns a plain ``nn.Module`` whose
``named_parameters()`` carry vLLM's per-rank names and shapes for Llama/Qwen3 dense and
Qwen3-MoE / Qwen2-MoE style models; parameters start as NaN (integers: -1) so anything a
refit forgets to write is visible. ``expected_vllm_shard`` computes what one such parameter
must contain from full HF tensors, by plain slicing written independently of the receiver
(it is the reference the tests and the demo compare against). ``random_hf_state_dict``
makes full HF tensors for a config.

hf_config keys: hidden_size, num_attention_heads, num_key_value_heads, head_dim (optional),
intermediate_size, moe_intermediate_size, num_experts (0/None = dense), num_hidden_layers,
vocab_size (real), tie_word_embeddings, gated, qk_norm; optional
shared_expert_intermediate_size (adds Qwen2-MoE shared experts), attention_bias, moe_layers
(global indexes of the MoE layers when only some are; the others are dense).
DeepSeek-V3 (``family == "deepseek_v3"``): MLA attention when ``kv_lora_rank`` is set
(``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``): vLLM's
``fused_qkv_a_proj`` = ``[q_a_proj ; kv_a_proj_with_mqa]`` replicated (with q LoRA; else
``kv_a_proj_with_mqa`` replicated and ``q_proj`` column parallel), ``q_b_proj`` /
``kv_b_proj`` column parallel, ``o_proj`` row parallel, the two norms replicated; shared
experts under ``mlp.shared_experts`` (no gate); ``router_expert_bias`` adds
``mlp.gate.e_score_correction_bias``, float32 whatever the model dtype (as vLLM holds it).
GLM-4.5 (``family == "glm4_moe"``): GQA attention, DeepSeek's MoE names (``shared_experts``,
no shared-expert gate), and the router ``mlp.gate.weight`` held in float32 too (vLLM's
``Glm4MoE`` builds its gate with ``params_dtype=torch.float32``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

import torch
from torch import nn

VOCAB_PADDING = 64


def _as_map(hf_config: Any) -> Mapping[str, Any]:
    """A config as a plain map: a map as given, a payload's ``wire.HFConfig`` as its plain form."""
    return hf_config.to_plain() if hasattr(hf_config, "to_plain") else hf_config


def _cfg(hf_config: Any) -> dict:
    """The oracle's own plain copy of a config, defaults filled in."""
    c = dict(_as_map(hf_config))
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    if not c.get("head_dim"):
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    c.setdefault("gated", True)
    c.setdefault("qk_norm", False)
    c.setdefault("tie_word_embeddings", False)
    c["num_experts"] = int(c.get("num_experts") or 0)
    return c


def _is_moe_layer(c: Mapping[str, Any], layer: int) -> bool:
    """MoE layers: all when the model has experts, or those listed in ``moe_layers``."""
    if not c["num_experts"]:
        return False
    listed = c.get("moe_layers")
    return True if listed is None else layer in listed


def _is_deepseek(c: Mapping[str, Any]) -> bool:
    """DeepSeek-V3's MoE names (``shared_experts``, no shared-expert gate): GLM-4.5 too."""
    return c.get("family") in ("deepseek_v3", "glm4_moe")


def _float32_param(c: Mapping[str, Any], name: str) -> bool:
    """Params vLLM holds in float32 whatever the model dtype."""
    return name.endswith(("e_score_correction_bias", ".linear_attn.A_log")) or (
        c.get("family") == "glm4_moe" and name.endswith(".mlp.gate.weight"))


def _shared_prefix(c: Mapping[str, Any]) -> str:
    return "shared_experts" if _is_deepseek(c) else "shared_expert"


def _mla_shapes(c: Mapping[str, Any], p: str, T: int, full: bool) -> dict[str, tuple[int, ...]]:
    """MLA params of one layer: vLLM's per-rank names/shapes (``full=False``) or HF's."""
    H, nh = c["hidden_size"], c["num_attention_heads"]
    ql, kvl = c.get("q_lora_rank"), c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    t = 1 if full else T
    a = f"{p}.self_attn"
    out: dict[str, tuple[int, ...]] = {}
    if ql and not full:
        out[f"{a}.fused_qkv_a_proj.weight"] = (ql + kvl + rope, H)
    elif ql:
        out[f"{a}.q_a_proj.weight"] = (ql, H)
    if ql:
        out[f"{a}.q_a_layernorm.weight"] = (ql,)
        out[f"{a}.q_b_proj.weight"] = (nh * (nope + rope) // t, ql)
    else:
        out[f"{a}.q_proj.weight"] = (nh * (nope + rope) // t, H)
    if full or not ql:
        out[f"{a}.kv_a_proj_with_mqa.weight"] = (kvl + rope, H)
    out[f"{a}.kv_a_layernorm.weight"] = (kvl,)
    out[f"{a}.kv_b_proj.weight"] = (nh * (nope + vd) // t, kvl)
    out[f"{a}.o_proj.weight"] = (H, nh * vd // t)
    return out


def _padded_vocab(v: int) -> int:
    return (v + VOCAB_PADDING - 1) // VOCAB_PADDING * VOCAB_PADDING


def _my_experts(num_experts: int, ep_rank: int, ep_size: int) -> list[int]:
    """Expert ids on ``ep_rank``: contiguous, the first ``E % ep`` ranks get one more."""
    counts = [num_experts // ep_size + (1 if i < num_experts % ep_size else 0) for i in range(ep_size)]
    start = sum(counts[:ep_rank])
    return list(range(start, start + counts[ep_rank]))


def vllm_param_shapes(hf_config: Mapping[str, Any], tp_rank: int, tp_size: int, ep_size: int = 1,
                      ep_rank: Optional[int] = None, routed_experts_nesting: bool = False
                      ) -> dict[str, tuple[int, ...]]:
    """vLLM per-rank parameter names and shapes for ``hf_config`` on one TP rank."""
    c = _cfg(hf_config)
    T = tp_size
    ep_rank = tp_rank % ep_size if ep_rank is None else ep_rank
    if c.get("family") == "gpt_oss":
        return _gpt_oss_shapes(c, T, ep_rank, ep_size)
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    kv_per_rank = 1 if T >= nkv else nkv // T
    vocab_rows = _padded_vocab(c["vocab_size"]) // T
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_rows, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (H,)
        if _is_linear_attention(c, i):
            shapes.update(_gated_delta_net_shapes(c, p, T))
        elif c.get("kv_lora_rank"):
            shapes.update(_mla_shapes(c, p, T, full=False))
        else:
            q_heads = nh * (2 if c.get("attn_output_gate") else 1)  # the gate rows count as heads
            shapes[f"{p}.self_attn.qkv_proj.weight"] = ((q_heads // T + 2 * kv_per_rank) * hd, H)
            if c.get("attention_bias"):
                shapes[f"{p}.self_attn.qkv_proj.bias"] = ((nh // T + 2 * kv_per_rank) * hd,)
            shapes[f"{p}.self_attn.o_proj.weight"] = (H, nh * hd // T)
        if c["qk_norm"] and not c.get("kv_lora_rank") and not _is_linear_attention(c, i):
            shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (H,)
        if _is_moe_layer(c, i):
            E, I = c["num_experts"], c["moe_intermediate_size"]
            e_local = len(_my_experts(E, ep_rank, ep_size)) if ep_size > 1 else E
            ip = I if ep_size > 1 else I // T
            experts = f"{p}.mlp.experts" + (".routed_experts" if routed_experts_nesting else "")
            shapes[f"{p}.mlp.gate.weight"] = (E, H)
            if c.get("router_expert_bias"):
                shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (E,)
            shapes[f"{experts}.w13_weight"] = (e_local, (2 if c["gated"] else 1) * ip, H)
            shapes[f"{experts}.w2_weight"] = (e_local, H, ip)
            fs = c.get("shared_expert_intermediate_size")
            if fs:
                se = _shared_prefix(c)
                shapes[f"{p}.mlp.{se}.gate_up_proj.weight"] = (2 * fs // T, H)
                shapes[f"{p}.mlp.{se}.down_proj.weight"] = (H, fs // T)
                if not _is_deepseek(c):
                    shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, H)
        else:
            F = c["intermediate_size"]
            if c["gated"]:
                shapes[f"{p}.mlp.gate_up_proj.weight"] = (2 * F // T, H)
            else:
                shapes[f"{p}.mlp.up_proj.weight"] = (F // T, H)
            shapes[f"{p}.mlp.down_proj.weight"] = (H, F // T)
    shapes["model.norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab_rows, H)
    return shapes


# A vLLM FP8 model's params: linear and expert weights in float8_e4m3fn (this pattern),
# each with its scales (per format: scale suffix, scale dtype, tile (rows, cols)); the
# quantizers that fill them: ``testing.fp8_reference``
VLLM_FP8_PARAM_RE = re.compile(r"(?:_proj\.weight|\.w13_weight|\.w2_weight)$")
TILE = 128
MX_BLOCK = 32
FORMATS = {"block_fp8": ("_scale_inv", torch.float32, (TILE, TILE)),
           "mxfp8": ("_scale", torch.uint8, (1, MX_BLOCK))}


def vllm_fp8_param_specs(hf_config: Mapping[str, Any], tp_rank: int, tp_size: int, ep_size: int = 1,
                         ep_rank: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                         fmt: str = "block_fp8") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of an FP8 vLLM model's params on one rank: linear and expert
    weights in float8_e4m3fn plus their scales (block FP8: ``<name>_scale_inv``, fp32, one per
    128x128 tile; MXFP8: ``<name>_scale``, uint8 E8M0, one per 32 elements of a row); the rest
    in ``dtype``."""
    suffix, sdtype, (tr, tc) = FORMATS[fmt]
    out = {}
    for name, shape in vllm_param_shapes(hf_config, tp_rank, tp_size, ep_size, ep_rank).items():
        if VLLM_FP8_PARAM_RE.search(name):
            out[name] = (shape, torch.float8_e4m3fn)
            tiles = (*shape[:-2], math.ceil(shape[-2] / tr), math.ceil(shape[-1] / tc))
            out[name + suffix] = (tiles, sdtype)
        else:
            out[name] = (shape, dtype)
    return out


def build_vllm_like_model(hf_config: Mapping[str, Any], tp_rank: int, tp_size: int, ep_size: int = 1,
                          dtype: torch.dtype = torch.bfloat16, *, ep_rank: Optional[int] = None,
                          routed_experts_nesting: bool = False,
                          device: Optional[torch.device] = None,
                          quant: Optional[str] = None) -> nn.Module:
    """An ``nn.Module`` with vLLM's per-rank parameter names and shapes, filled with NaN.

    ``quant="block_fp8"``: linear and expert weights in float8_e4m3fn with their fp32
    ``_scale_inv`` (``vllm_fp8_param_specs``), the rest in ``dtype``.
    ``hf_config``: a map, or a payload's ``wire.HFConfig``.
    """
    hf_config = _as_map(hf_config)
    root = nn.Module()
    shapes = vllm_param_shapes(hf_config, tp_rank, tp_size, ep_size, ep_rank, routed_experts_nesting)
    dtypes = {name: dtype for name in shapes}
    if quant in ("block_fp8", "mxfp8"):
        specs = vllm_fp8_param_specs(hf_config, tp_rank, tp_size, ep_size, ep_rank, dtype, quant)
        shapes = {name: shape for name, (shape, _) in specs.items()}
        dtypes = {name: d for name, (_, d) in specs.items()}
    elif quant is not None:
        raise ValueError(f"build_vllm_like_model: quant={quant!r}; expected None, 'block_fp8' or "
                         f"'mxfp8'")
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        # vLLM keeps DeepSeek's score-correction bias (and GLM's router) in float32
        pdtype = torch.float32 if _float32_param(hf_config, name) else dtypes[name]
        data = torch.empty(shape, dtype=pdtype, device=device)
        data.fill_(float("nan") if pdtype.is_floating_point else -1)
        module.register_parameter(leaf, nn.Parameter(data, requires_grad=False))
    return root


def hf_param_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full HF parameter names and shapes (per-expert names for MoE)."""
    c = _cfg(hf_config)
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    V = c["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (H,)
        if _is_linear_attention(c, i):
            shapes.update(_gated_delta_net_shapes(c, p, 1))
            if c.get("family") in ("qwen3_5_text", "qwen3_5_moe_text"):
                shapes.update(_flat_in_proj_shapes(shapes, c, p))
        elif c.get("kv_lora_rank"):
            shapes.update(_mla_shapes(c, p, 1, full=True))
        else:
            q_rows = nh * hd * (2 if c.get("attn_output_gate") else 1)  # [q_h; gate_h] per head
            for proj, rows in (("q", q_rows), ("k", nkv * hd), ("v", nkv * hd)):
                shapes[f"{p}.self_attn.{proj}_proj.weight"] = (rows, H)
                if c.get("attention_bias"):
                    shapes[f"{p}.self_attn.{proj}_proj.bias"] = (rows,)
            shapes[f"{p}.self_attn.o_proj.weight"] = (H, nh * hd)
        if c["qk_norm"] and not c.get("kv_lora_rank") and not _is_linear_attention(c, i):
            shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (H,)
        if _is_moe_layer(c, i):
            I = c["moe_intermediate_size"]
            shapes[f"{p}.mlp.gate.weight"] = (c["num_experts"], H)
            if c.get("router_expert_bias"):
                shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (c["num_experts"],)
            for e in range(c["num_experts"]):
                if c["gated"]:
                    shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (I, H)
                shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (I, H)
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (H, I)
            fs = c.get("shared_expert_intermediate_size")
            if fs:
                se = _shared_prefix(c)
                shapes[f"{p}.mlp.{se}.gate_proj.weight"] = (fs, H)
                shapes[f"{p}.mlp.{se}.up_proj.weight"] = (fs, H)
                shapes[f"{p}.mlp.{se}.down_proj.weight"] = (H, fs)
                if not _is_deepseek(c):
                    shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, H)
        else:
            F = c["intermediate_size"]
            if c["gated"]:
                shapes[f"{p}.mlp.gate_proj.weight"] = (F, H)
            shapes[f"{p}.mlp.up_proj.weight"] = (F, H)
            shapes[f"{p}.mlp.down_proj.weight"] = (H, F)
    shapes["model.norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def random_hf_state_dict(hf_config: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16,
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """Full HF tensors for ``hf_config`` with distinct random values."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(
                torch.float32 if name.endswith("e_score_correction_bias") else dtype)
            for name, shape in hf_param_shapes(hf_config).items()}


_EXPERTS_RE = re.compile(r"^(?P<layer>.*)\.mlp\.experts(?:\.routed_experts)?\.(?P<w>w13_weight|w2_weight)$")


def expected_vllm_shard(hf_config: Mapping[str, Any], vllm_name: str,
                        full_hf_tensors: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int,
                        ep_size: int = 1, ep_rank: Optional[int] = None) -> torch.Tensor:
    """What vLLM parameter ``vllm_name`` holds on ``tp_rank`` given full HF tensors."""
    c = _cfg(hf_config)
    T, r = tp_size, tp_rank
    ep_rank = tp_rank % ep_size if ep_rank is None else ep_rank
    hf = full_hf_tensors
    nkv, hd = c["num_key_value_heads"], c["head_dim"]
    if c.get("family") == "gpt_oss":
        return _gpt_oss_expected(c, vllm_name, hf, r, T, ep_rank, ep_size)

    def rows(t: torch.Tensor) -> torch.Tensor:  # column parallel: output rows split
        return torch.chunk(t, T, dim=0)[r]

    def cols(t: torch.Tensor) -> torch.Tensor:  # row parallel: input columns split
        return torch.chunk(t, T, dim=1)[r]

    if vllm_name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = hf[vllm_name]
        pad = torch.zeros((_padded_vocab(full.shape[0]) - full.shape[0], *full.shape[1:]), dtype=full.dtype)
        return rows(torch.cat([full, pad]))
    m = _EXPERTS_RE.match(vllm_name)
    if m:
        layer = m["layer"]
        ids = _my_experts(c["num_experts"], ep_rank, ep_size) if ep_size > 1 else range(c["num_experts"])
        split_rows = (lambda t: t) if ep_size > 1 else rows
        split_cols = (lambda t: t) if ep_size > 1 else cols
        per_expert = []
        for e in ids:
            base = f"{layer}.mlp.experts.{e}"
            if m["w"] == "w2_weight":
                per_expert.append(split_cols(hf[f"{base}.down_proj.weight"]))
            elif c["gated"]:
                per_expert.append(torch.cat([split_rows(hf[f"{base}.gate_proj.weight"]),
                                             split_rows(hf[f"{base}.up_proj.weight"])]))
            else:
                per_expert.append(split_rows(hf[f"{base}.up_proj.weight"]))
        return torch.stack(per_expert)
    if ".linear_attn." in vllm_name:
        part = _gated_delta_net_expected(c, vllm_name, hf, r, T)
        return part.float() if _float32_param(c, vllm_name) else part
    if vllm_name.endswith("qkv_proj.weight") or vllm_name.endswith("qkv_proj.bias"):
        base, kind = vllm_name.rsplit(".qkv_proj.", 1)
        q, k, v = (hf[f"{base}.{x}_proj.{kind}"] for x in "qkv")
        if T >= nkv:
            head = r // (T // nkv)
            k_r, v_r = k[head * hd:(head + 1) * hd], v[head * hd:(head + 1) * hd]
        else:
            k_r, v_r = rows(k), rows(v)
        return torch.cat([rows(q), k_r, v_r])
    if vllm_name.endswith("fused_qkv_a_proj.weight"):  # MLA with q LoRA: replicated
        base = vllm_name[: -len("fused_qkv_a_proj.weight")]
        return torch.cat([hf[f"{base}q_a_proj.weight"], hf[f"{base}kv_a_proj_with_mqa.weight"]])
    if c.get("kv_lora_rank") and vllm_name.endswith(("q_b_proj.weight", "kv_b_proj.weight",
                                                      "self_attn.q_proj.weight")):
        return rows(hf[vllm_name])  # heads split over TP
    if vllm_name.endswith("gate_up_proj.weight"):
        base = vllm_name[: -len("gate_up_proj.weight")]
        return torch.cat([rows(hf[f"{base}gate_proj.weight"]), rows(hf[f"{base}up_proj.weight"])])
    if vllm_name.endswith(("o_proj.weight", "down_proj.weight")):
        return cols(hf[vllm_name])
    if vllm_name.endswith("mlp.up_proj.weight"):
        return rows(hf[vllm_name])
    if _float32_param(c, vllm_name):
        return hf[vllm_name].float()  # widened as vLLM's load_weights copies it
    return hf[vllm_name]  # replicated: norms, router, shared_expert_gate


# ---- Qwen3-Next (Qwen3NextForCausalLM): Gated-DeltaNet layers where ``layer_types`` says
# "linear_attention": in_proj_qkvz / in_proj_ba split on rows as the checkpoint holds them,
# conv1d's q, k, v segments each split, A_log (float32) / dt_bias per value head, the gated
# norm replicated, out_proj row parallel. Gated attention: q_proj rows [q_h; gate_h] per head.
def _is_linear_attention(c: Mapping[str, Any], layer: int) -> bool:
    types = c.get("layer_types")
    return bool(types) and types[layer] == "linear_attention"


def _gated_delta_net_shapes(c: Mapping[str, Any], p: str, T: int) -> dict[str, tuple[int, ...]]:
    H = c["hidden_size"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    nv = c["linear_num_value_heads"]
    la = f"{p}.linear_attn"
    return {f"{la}.in_proj_qkvz.weight": ((2 * kd + 2 * vd) // T, H), f"{la}.in_proj_ba.weight": (2 * nv // T, H),
            f"{la}.conv1d.weight": ((2 * kd + vd) // T, 1, c["linear_conv_kernel_dim"]),
            f"{la}.A_log": (nv // T,), f"{la}.dt_bias": (nv // T,),
            f"{la}.norm.weight": (c["linear_value_head_dim"],), f"{la}.out_proj.weight": (H, vd // T)}


def _flat_in_proj_shapes(shapes: dict, c: Mapping[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's checkpoint: in_proj_qkvz / in_proj_ba (dropped from ``shapes``) as the flat
    in_proj_qkv [q; k; v], in_proj_z, in_proj_b, in_proj_a."""
    la, H = f"{p}.linear_attn", c["hidden_size"]
    del shapes[f"{la}.in_proj_qkvz.weight"], shapes[f"{la}.in_proj_ba.weight"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd, nv = c["linear_num_value_heads"] * c["linear_value_head_dim"], c["linear_num_value_heads"]
    return {f"{la}.in_proj_qkv.weight": (2 * kd + vd, H), f"{la}.in_proj_z.weight": (vd, H),
            f"{la}.in_proj_b.weight": (nv, H), f"{la}.in_proj_a.weight": (nv, H)}


def _gated_delta_net_expected(c: Mapping[str, Any], name: str, hf: Mapping[str, torch.Tensor],
                              r: int, T: int) -> torch.Tensor:
    la = name.rsplit(".", 2)[0]
    if name.endswith("in_proj_qkvz.weight") and name not in hf:
        # Qwen3.5: flat q, k, v, z streams, each split over TP: rank r holds [q_r; k_r; v_r; z_r]
        kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        qkv = hf[f"{la}.in_proj_qkv.weight"]
        streams = (qkv[:kd], qkv[kd:2 * kd], qkv[2 * kd:], hf[f"{la}.in_proj_z.weight"])
        return torch.cat([torch.chunk(t, T)[r] for t in streams])
    if name.endswith("in_proj_ba.weight") and name not in hf:  # Qwen3.5: [b_r; a_r]
        return torch.cat([torch.chunk(hf[f"{la}.in_proj_{w}.weight"], T)[r] for w in "ba"])
    full = hf[name]
    if name.endswith("conv1d.weight"):
        kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        q, k, v = full[:kd], full[kd:2 * kd], full[2 * kd:]
        return torch.cat([torch.chunk(t, T)[r] for t in (q, k, v)])
    if name.endswith("norm.weight"):
        return full
    if name.endswith("out_proj.weight"):
        return torch.chunk(full, T, dim=1)[r]
    return torch.chunk(full, T)[r]  # A_log widened by the caller (_float32_param)


# ---- gpt-oss (GptOssForCausalLM): vLLM renames embed_tokens -> embedding and self_attn ->
# attn, holds per-head sinks, biases on qkv / o_proj / router / experts; w13 holds each
# expert's gate_up_proj [H, 2I] transposed with gate and up interleaved as in the checkpoint
# (TP: its columns 2*r*I_p .. 2*(r+1)*I_p), w2 down_proj [I, H] transposed, w2_bias only on
# MoE TP rank 0 (zero elsewhere).


def _gpt_oss_shapes(c: Mapping[str, Any], T: int, ep_rank: int, ep_size: int) -> dict[str, tuple[int, ...]]:
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, I = c["num_experts"], c["moe_intermediate_size"]
    e_local = len(_my_experts(E, ep_rank, ep_size)) if ep_size > 1 else E
    ip = I if ep_size > 1 else I // T
    qkv_rows = (nh // T + 2 * (1 if T >= nkv else nkv // T)) * hd
    vocab_rows = _padded_vocab(c["vocab_size"]) // T
    shapes: dict[str, tuple[int, ...]] = {"model.embedding.weight": (vocab_rows, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (H,), f"{p}.attn.sinks": (nh // T,),
                       f"{p}.attn.qkv_proj.weight": (qkv_rows, H), f"{p}.attn.qkv_proj.bias": (qkv_rows,),
                       f"{p}.attn.o_proj.weight": (H, nh * hd // T), f"{p}.attn.o_proj.bias": (H,),
                       f"{p}.post_attention_layernorm.weight": (H,),
                       f"{p}.mlp.router.weight": (E, H), f"{p}.mlp.router.bias": (E,),
                       f"{p}.mlp.experts.w13_weight": (e_local, 2 * ip, H),
                       f"{p}.mlp.experts.w13_bias": (e_local, 2 * ip),
                       f"{p}.mlp.experts.w2_weight": (e_local, H, ip),
                       f"{p}.mlp.experts.w2_bias": (e_local, H)})
    shapes["model.norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab_rows, H)
    return shapes


def _gpt_oss_expected(c: Mapping[str, Any], name: str, hf: Mapping[str, torch.Tensor], r: int, T: int,
                      ep_rank: int, ep_size: int) -> torch.Tensor:
    hf_name = name.replace("model.embedding.", "model.embed_tokens.").replace(".attn.", ".self_attn.")
    m = re.match(r"^(?P<layer>.*)\.mlp\.experts(?:\.routed_experts)?\.(?P<w>w13|w2)_(?P<k>weight|bias)$", name)
    if m is None:
        if name.endswith(".qkv_proj.weight") or name.endswith(".qkv_proj.bias"):
            return expected_vllm_shard({**c, "family": None}, hf_name, hf, r, T)
        if name.endswith("attn.sinks"):
            return torch.chunk(hf[hf_name], T)[r]  # the rank's heads
        if name.endswith("attn.o_proj.weight") or name in ("model.embedding.weight", "lm_head.weight"):
            key = "model.embed_tokens.weight" if name == "model.embedding.weight" else hf_name
            return expected_vllm_shard({**c, "family": None}, key, hf, r, T)
        return hf[hf_name]  # o_proj bias, router, norms: whole on every rank
    moe_tp, moe_r = (1, 0) if ep_size > 1 else (T, r)
    ids = _my_experts(c["num_experts"], ep_rank, ep_size) if ep_size > 1 else range(c["num_experts"])
    ip = c["moe_intermediate_size"] // moe_tp
    out = []
    for e in ids:
        base = f"{m['layer']}.mlp.experts.{e}"
        if m["w"] == "w13" and m["k"] == "weight":
            out.append(hf[f"{base}.gate_up_proj"][:, 2 * moe_r * ip:2 * (moe_r + 1) * ip].t())
        elif m["w"] == "w13":
            out.append(hf[f"{base}.gate_up_proj_bias"][2 * moe_r * ip:2 * (moe_r + 1) * ip])
        elif m["k"] == "weight":
            out.append(hf[f"{base}.down_proj"][moe_r * ip:(moe_r + 1) * ip].t())
        else:
            bias = hf[f"{base}.down_proj_bias"]
            out.append(bias if moe_r == 0 else torch.zeros_like(bias))
    return torch.stack(out)
# ---- end gpt-oss


# ------------------------------------------------------------------ plain test payloads


def grouped_hf_tensors(full_hf_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors stacked into the grouped names the refit payload uses
    (``<P>.experts.<proj>.weight [E, ...]``); other tensors unchanged."""
    from megatron_reshard.wire.expert_names import PER_EXPERT_RE, grouped_name

    groups: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in full_hf_tensors.items():
        m = PER_EXPERT_RE.match(name)
        if m:
            groups.setdefault(grouped_name(name), {})[int(m["index"])] = t
        else:
            out[name] = t
    for name, by_index in groups.items():
        out[name] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def build_plain_payload(hf_config: Mapping[str, Any], full_hf_tensors: Mapping[str, torch.Tensor],
                        train: Mapping[str, int], gen: Mapping[str, int], train_world_size: int,
                        gen_world_size: int, layer_to_pp_stage: Optional[Mapping[str, int]] = None
                        ) -> dict:
    """A wire-form refit payload for full HF tensors, built without Megatron through the
    train side's own code (``wire.codec.build_payload``: schema version and every key).

    Bulk params (``is_nccl_reshard_param``) go through ``build_nccl_reshard_refit_info``;
    the rest are listed in ``other_params`` (``[{name, shape, dtype, pp_stage}]``, the train
    side's form) in the order given, ``pp_stage`` looked up by layer key in
    ``layer_to_pp_stage`` (0 without PP). Training ranks in Megatron's default order (PP
    outermost: stage ``s`` holds ranks ``s*T/pp .. (s+1)*T/pp - 1``).
    """
    from megatron_reshard.wire.codec import build_payload
    from megatron_reshard.wire.extras import GenLayout, TrainLayout
    from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info, extract_layer_name
    from megatron_reshard.wire.placement_rules import is_nccl_reshard_param
    from megatron_reshard.wire.records import MiscRecord

    pp = int(train.get("pp_size", 1))
    bulk = {n: {"shape": list(t.shape), "dtype": str(t.dtype)}
            for n, t in full_hf_tensors.items() if is_nccl_reshard_param(n)}
    info = build_nccl_reshard_refit_info(bulk, dict(train), dict(gen), train_world_size,
                                         gen_world_size, dict(layer_to_pp_stage or {}) or None)
    other = [MiscRecord(n, tuple(t.shape), str(t.dtype),
                        int(layer_to_pp_stage[extract_layer_name(n)]) if pp > 1 else 0)
             for n, t in full_hf_tensors.items() if not is_nccl_reshard_param(n)]
    stage_world = train_world_size // pp
    return build_payload(
        info, hf_config=dict(hf_config), other_params=other,
        train_layout=TrainLayout.of({"tp": int(train.get("tp_size", 1)),
                                     "ep": int(train.get("ep_size", 1)), "pp": pp,
                                     "world_size": train_world_size}),
        gen_layout=GenLayout.of({"tp": int(gen.get("tp_size", 1)), "ep": int(gen.get("ep_size", 1)),
                                 "pp": 1, "world_size": gen_world_size}),
        train_stage_ranks=[list(range(s * stage_world, (s + 1) * stage_world)) for s in range(pp)],
        rank_order="tp-dp-pp")
