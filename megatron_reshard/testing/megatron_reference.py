"""The oracle: every HF tensor of the model, gathered whole on every train rank.

Deliberately written without ``converters.py``: plain if/else on Megatron names, explicit
loops for the QKV interleave and the fc1 halves, Megatron's own parameter attributes
(``tensor_model_parallel``, ``partition_dim``) for what is TP-sharded. Slow and simple;
used by the tests and the demo to check views, payload shapes and received tensors.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.distributed as dist

SHARED_EXPERT_PREFIX = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts",
                        "glm4_moe": "shared_experts", "qwen3_next": "shared_expert",
                        "qwen3_5_moe_text": "shared_expert"}
# Qwen3.5 text: Qwen3-Next's layers, its checkpoint's in_proj streams flat and named apart
QWEN3_5_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")


# MLA (DeepSeek-V3 names). The down projections are column-parallel in the local spec: the
# generic TP gather above already made them whole.
MLA_NAMES = {
    "self_attention.linear_q_proj.weight": "q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "kv_b_proj.weight",
    "self_attention.q_layernorm.weight": "q_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "kv_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "q_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "kv_a_layernorm.weight",
}


def _gpt_oss_tensor(out: dict, p: str, rest: str, full: torch.Tensor, first_expert: int) -> bool:
    """gpt-oss's names (HF checkpoint, experts one by one as vLLM streams them); False when
    ``rest`` is not one of them. Gate/up interleaved by an explicit loop over the rows."""
    simple = {"self_attention.linear_proj.bias": "self_attn.o_proj.bias",
              "self_attention.core_attention.softmax_offset": "self_attn.sinks",
              "mlp.router.weight": "mlp.router.weight", "mlp.router.bias": "mlp.router.bias"}
    if rest in simple:
        out[f"{p}.{simple[rest]}"] = full
        return True
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)", rest)
    if e is None:
        return False
    q = f"{p}.mlp.experts.{first_expert + int(e.group(1))}"
    if e.group(2) == "2":
        out[f"{q}.down_proj" + ("_bias" if e.group(3) == "bias" else "")] = \
            full.t().contiguous() if e.group(3) == "weight" else full
        return True
    inter = full.shape[0] // 2  # Megatron: [gate ; up]; HF: gate_0, up_0, gate_1, up_1, ...
    rows = []
    for j in range(inter):
        rows += [full[j], full[inter + j]]
    mixed = torch.stack(rows)
    out[f"{q}.gate_up_proj" + ("_bias" if e.group(3) == "bias" else "")] = \
        mixed.t().contiguous() if e.group(3) == "weight" else mixed
    return True


def _qwen3_next_tensor(out: dict, p: str, rest: str, parts: list, full: torch.Tensor, cfg,
                       flat: bool = False) -> bool:
    """Qwen3-Next's Gated-DeltaNet and gated-attention names (``flat``: Qwen3.5's in_proj
    names); False when ``rest`` is not one of them. Explicit loops over the TP parts and the
    key heads / KV groups."""
    la = f"{p}.linear_attn"
    simple = {"self_attention.A_log": "A_log", "self_attention.dt_bias": "dt_bias",
              "self_attention.out_proj.weight": "out_proj.weight"}
    if rest == "self_attention.out_norm.weight":  # the checkpoint's gated norm is x·w
        zero_centred = getattr(cfg, "layernorm_zero_centered_gamma", False)
        out[f"{la}.norm.weight"] = (full.float() + 1).to(full.dtype) if zero_centred else full
        return True
    if rest in simple:
        out[f"{la}.{simple[rest]}"] = full
        return True
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, tp = cfg.linear_key_head_dim, cfg.linear_value_head_dim, len(parts)
    sizes = [nk * dk // tp, nk * dk // tp, nv * dv // tp, nv * dv // tp, nv // tp, nv // tp]
    if rest in ("self_attention.in_proj.weight", "self_attention.conv1d.weight"):
        streams: list[list[torch.Tensor]] = [[] for _ in sizes]  # q, k, v, z, b, a over all ranks
        for part in parts:  # each TP rank: [q_r, k_r, v_r, z_r, b_r, a_r] (conv1d: q, k, v)
            row = 0
            for i, size in enumerate(sizes if rest.endswith("in_proj.weight") else sizes[:3]):
                streams[i].append(part[row:row + size])
                row += size
            assert row == part.shape[0], (rest, row, part.shape)
        q, k, v, z, b, a = (torch.cat(s) if s else None for s in streams)
        if rest.endswith("conv1d.weight"):
            out[f"{la}.conv1d.weight"] = torch.cat([q, k, v])
            return True
        if flat:  # Qwen3.5: each stream whole, q, k, v stacked
            out[f"{la}.in_proj_qkv.weight"] = torch.cat([q, k, v])
            out[f"{la}.in_proj_z.weight"] = z
            out[f"{la}.in_proj_b.weight"] = b
            out[f"{la}.in_proj_a.weight"] = a
            return True
        per = nv // nk
        qkvz, ba = [], []
        for g in range(nk):  # the checkpoint: per key head [q_g, k_g, v_g, z_g] and [b_g, a_g]
            qkvz += [q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk],
                     v[g * per * dv:(g + 1) * per * dv], z[g * per * dv:(g + 1) * per * dv]]
            ba += [b[g * per:(g + 1) * per], a[g * per:(g + 1) * per]]
        out[f"{la}.in_proj_qkvz.weight"] = torch.cat(qkvz)
        out[f"{la}.in_proj_ba.weight"] = torch.cat(ba)
        return True
    if rest == "self_attention.linear_qkv.weight":
        nh, ng, hd = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        per_group = nh // ng
        q_rows, k_rows, v_rows, row = [], [], [], 0
        for _ in range(ng):  # Megatron, per KV group: [q heads, gate heads, k, v]
            qs = [full[row + j * hd:row + (j + 1) * hd] for j in range(per_group)]
            row += per_group * hd
            gates = [full[row + j * hd:row + (j + 1) * hd] for j in range(per_group)]
            row += per_group * hd
            for qh, gh in zip(qs, gates):  # the checkpoint's q_proj: per head [q_h; gate_h]
                q_rows += [qh, gh]
            k_rows.append(full[row:row + hd])
            v_rows.append(full[row + hd:row + 2 * hd])
            row += 2 * hd
        assert row == full.shape[0], (row, full.shape)
        out[f"{p}.self_attn.q_proj.weight"] = torch.cat(q_rows)
        out[f"{p}.self_attn.k_proj.weight"] = torch.cat(k_rows)
        out[f"{p}.self_attn.v_proj.weight"] = torch.cat(v_rows)
        return True
    return False


def _bare(model: Any) -> torch.nn.Module:
    if isinstance(model, (list, tuple)):
        (model,) = model
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _tp_gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps

    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return parts


def split_qkv(full: torch.Tensor, nh: int, nkv: int, hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_rows, k_rows, v_rows = [], [], []
    heads_per_group = nh // nkv
    row = 0
    for _ in range(nkv):
        for _ in range(heads_per_group):
            q_rows.append(full[row:row + hd])
            row += hd
        k_rows.append(full[row:row + hd])
        row += hd
        v_rows.append(full[row:row + hd])
        row += hd
    assert row == full.shape[0], (row, full.shape)
    return torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows)


@torch.no_grad()
def gather_full_hf_state_dict(model: Any, *, family: str, vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """``{hf_name: full tensor}`` of the whole model on every rank of the default world.

    Collective over the TP group and then the whole world. Replicated copies held by
    several ranks are compared: a disagreement raises (the model is not consistent).
    """
    from megatron.core import parallel_state as ps

    m = _bare(model)
    cfg = m.config
    nh = cfg.num_attention_heads
    nkv = cfg.num_query_groups or nh
    hd = cfg.kv_channels
    gated = cfg.gated_linear_unit
    real_vocab = vocab_size if vocab_size is not None else m.vocab_size
    ep_rank = ps.get_expert_model_parallel_rank()
    n_local = (cfg.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    tied = bool(getattr(m, "share_embeddings_and_output_weights", False))
    mla = bool(getattr(cfg, "multi_latent_attention", False))

    def fc1_halves(parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        gates, ups = [], []
        for part in parts:  # each TP rank holds [gate_r ; up_r]
            rows = part.shape[0] // 2
            gates.append(part[:rows])
            ups.append(part[rows:])
        return torch.cat(gates), torch.cat(ups)

    out: dict[str, torch.Tensor] = {}
    tensors = list(m.named_parameters()) + [(n, b) for n, b in m.named_buffers() if n.endswith("router.expert_bias")]
    for name, param in tensors:
        t = param.detach()
        if getattr(param, "tensor_model_parallel", False) and ".experts." not in name:
            # GatedDeltaNet's conv1d / A_log / dt_bias carry no partition_dim: dim 0
            dim = getattr(param, "partition_dim", 0)
            full_parts = _tp_gather(t, dim)
            full = torch.cat(full_parts, dim=dim)
        elif name.endswith("core_attention.softmax_offset"):
            # gpt-oss sinks: one per local head, no TP attribute (Megatron's sharded_state_dict
            # splits them on dim 0)
            full_parts = _tp_gather(t, 0)
            full = torch.cat(full_parts)
        else:
            full_parts, full = [t], t

        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = full[:real_vocab]
            continue
        if name == "output_layer.weight":
            if not tied:
                out["lm_head.weight"] = full[:real_vocab]
            continue
        if name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = full
            continue
        hit = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
        if hit is None:
            raise KeyError(f"reference: no rule for {name}")
        layer = m.decoder.layers[int(hit.group(1))].layer_number - 1
        rest = hit.group(2)
        p = f"model.layers.{layer}"
        if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
            out[f"{p}.input_layernorm.weight"] = full
        elif rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
            out[f"{p}.post_attention_layernorm.weight"] = full
        elif family in ("qwen3_next", *QWEN3_5_FAMILIES) and _qwen3_next_tensor(
                out, p, rest, full_parts, full, cfg, flat=family in QWEN3_5_FAMILIES):
            pass
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = split_qkv(full, nh, nkv, hd)
            out[f"{p}.self_attn.q_proj.{kind}"] = q
            out[f"{p}.self_attn.k_proj.{kind}"] = k
            out[f"{p}.self_attn.v_proj.{kind}"] = v
        elif rest == "self_attention.linear_proj.weight":
            out[f"{p}.self_attn.o_proj.weight"] = full
        elif family == "gpt_oss" and _gpt_oss_tensor(out, p, rest, full, ep_rank * n_local):
            pass
        elif mla and rest in MLA_NAMES:
            out[f"{p}.self_attn.{MLA_NAMES[rest]}"] = full
        elif rest == "self_attention.q_layernorm.weight":
            out[f"{p}.self_attn.q_norm.weight"] = full
        elif rest == "self_attention.k_layernorm.weight":
            out[f"{p}.self_attn.k_norm.weight"] = full
        elif rest == "mlp.router.weight":
            out[f"{p}.mlp.gate.weight"] = full
        elif rest == "mlp.router.expert_bias":
            out[f"{p}.mlp.gate.e_score_correction_bias"] = full
        elif rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
            mlp = f"{p}.mlp" if rest.startswith("mlp.linear") else f"{p}.mlp.{SHARED_EXPERT_PREFIX[family]}"
            if gated:
                out[f"{mlp}.gate_proj.weight"], out[f"{mlp}.up_proj.weight"] = fc1_halves(full_parts)
            else:
                out[f"{mlp}.up_proj.weight"] = full
        elif rest in ("mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"):
            mlp = f"{p}.mlp" if rest.startswith("mlp.linear") else f"{p}.mlp.{SHARED_EXPERT_PREFIX[family]}"
            out[f"{mlp}.down_proj.weight"] = full
        elif rest == "mlp.shared_experts.gate_weight":
            out[f"{p}.mlp.shared_expert_gate.weight"] = full
        else:
            e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
            if e is None:
                raise KeyError(f"reference: no rule for {name}")
            expert = ep_rank * n_local + int(e.group(1))
            q = f"{p}.mlp.experts.{expert}"
            if e.group(2) == "2":
                out[f"{q}.down_proj.weight"] = full
            elif gated:
                out[f"{q}.gate_proj.weight"], out[f"{q}.up_proj.weight"] = fc1_halves([full])
            else:
                out[f"{q}.up_proj.weight"] = full

    # On CPU before pickling: a CUDA tensor would unpickle onto its sender's device index.
    out = {name: tensor.detach().cpu() for name, tensor in out.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    merged: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(everyone):
        for name, tensor in part.items():
            if name in merged:
                if not torch.equal(merged[name], tensor):
                    raise ValueError(f"reference: rank {rank} holds a different copy of {name}")
            else:
                merged[name] = tensor.clone()
    return merged
