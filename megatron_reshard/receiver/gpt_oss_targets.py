"""gpt-oss's experts on one generation rank: which boxes of vLLM's w13 / w2 (and their
biases) each HF tensor or wire tensor fills (the layout facts: ``vllm_layout.gpt_oss``).

Torch + stdlib only. Two forms arrive: the checkpoint's per-expert tensors, full (the
packed path; ``oss_expert_plan``), and the exact path's wire tensors over all experts
(``oss_wire_plan``). ``self`` is the rank's ``receiver.targets.VllmTargets`` (these are its
methods, kept here to hold that module to one job per family).
"""

from __future__ import annotations

import re

from megatron_reshard.receiver.target_plan import Piece, TargetError, TargetPlan, full_region
from megatron_reshard.vllm_layout import gpt_oss
from megatron_reshard.vllm_layout import moe as vllm_moe
from megatron_reshard.vllm_layout.moe import expert_block


def oss_expert_plan(self, name: str, shape: tuple[int, ...], m: re.Match) -> TargetPlan:
    """One gpt-oss expert's ``gate_up_proj [H, 2I]`` / ``down_proj [I, H]`` or their biases
    into vLLM's w13 / w2 (``vllm_layout.gpt_oss``): weights transposed, w2_bias zero
    on MoE TP ranks > 0."""
    proj, bias, e = m["proj"], bool(m["bias"]), int(m["index"])
    candidates = gpt_oss.expert_targets(m["prefix"], proj, bias)
    found = [c for c in candidates if c in self.params]
    if not found:
        raise TargetError(f"{name}: missing target on {self.where()}: expected vLLM param "
                          f"{candidates[0]!r} or {candidates[1]!r}")
    target = found[0]
    num_experts = int(self.hf_config.num_experts or 0)
    if not num_experts:
        raise TargetError(f"{name}: per-expert HF name needs hf_config's num_experts")
    e_lo, e_hi = (expert_block(num_experts, self.ep_rank, self.ep_size) if self.ep_size > 1
                  else (0, num_experts))
    plan = TargetPlan(name, shape)
    if not e_lo <= e < e_hi:
        plan.note = f"expert {e} lives on another EP rank (this rank: {e_lo}..{e_hi - 1})"
        return plan
    tp_parts, tp_r = vllm_moe.expert_tp_split(self.ep_size, self.tp_size, self.tp_rank)
    hidden = int(self.hf_config.hidden_size or 0)
    inter = int(self.hf_config.moe_intermediate_size or 0)
    hf_expected = {("gate_up_proj", False): (hidden, 2 * inter), ("gate_up_proj", True): (2 * inter,),
                   ("down_proj", False): (inter, hidden), ("down_proj", True): (hidden,)}[proj, bias]
    if shape != hf_expected:
        raise TargetError(f"{name}: HF shape {list(shape)}, expected {list(hf_expected)} "
                          f"(hidden_size {hidden}, moe_intermediate_size {inter} of hf_config)")
    if not inter or inter % tp_parts:
        raise TargetError(f"{name}: expert intermediate size {inter} does not split over "
                          f"tp_size={tp_parts}")
    ip = inter // tp_parts
    lo, hi = gpt_oss.inter_columns(proj, ip, tp_r)
    local_e = e_hi - e_lo
    el = (e - e_lo, e - e_lo + 1)
    if proj == "gate_up_proj" and not bias:  # [H, 2I] -> w13[e] [2I_p, H]
        expected, t_box, h_box = (local_e, 2 * ip, shape[0]), (el, (0, 2 * ip), (0, shape[0])), \
            ((0, shape[0]), (lo, hi))
    elif proj == "gate_up_proj":  # [2I] -> w13_bias[e] [2I_p]
        expected, t_box, h_box = (local_e, 2 * ip), (el, (0, 2 * ip)), ((lo, hi),)
    elif not bias:  # [I, H] -> w2[e] [H, I_p]
        expected, t_box, h_box = (local_e, shape[1], ip), (el, (0, shape[1]), (0, ip)), \
            ((lo, hi), (0, shape[1]))
    else:  # [H] -> w2_bias[e] [H], zero on MoE TP ranks > 0
        expected, t_box, h_box = (local_e, shape[0]), (el, (0, shape[0])), ((0, shape[0]),)
    if tuple(self.params[target].shape) != expected:
        raise self._shape_error(name, target, expected, f"gpt-oss experts with E={num_experts}, "
                                f"ep_size={self.ep_size}, expert tp_size={tp_parts}")
    if bias and proj == "down_proj" and gpt_oss.down_bias_is_zero(tp_r):
        plan.zero.append((target, t_box))
    else:
        plan.pieces.append(Piece(target, t_box, h_box, transposed=not bias))
    return plan


def oss_wire_plan(self, name: str, shape: tuple[int, ...], m: re.Match) -> TargetPlan:
    """gpt-oss's experts in the exact path's wire form (``vllm_layout.gpt_oss``: vLLM's
    w13 / w2 and their biases over all experts) into this rank's share of them."""
    leaf = m["leaf"]
    candidates = [f"{m['prefix']}.{leaf}", f"{m['prefix']}.routed_experts.{leaf}"]
    found = [c for c in candidates if c in self.params]
    if not found:
        raise TargetError(f"{name}: missing target on {self.where()}: expected vLLM param "
                          f"{candidates[0]!r} or {candidates[1]!r}")
    target = found[0]
    if target in self.orders:
        raise TargetError(f"{name}: vLLM keeps {target!r} in {self.orders[target].backend}'s "
                          f"order on {self.where()}; gpt-oss's experts are refitted only "
                          f"in checkpoint order")
    num_experts = shape[0]
    experts = (expert_block(num_experts, self.ep_rank, self.ep_size) if self.ep_size > 1
               else (0, num_experts))
    tp_parts, tp_r = vllm_moe.expert_tp_split(self.ep_size, self.tp_size, self.tp_rank)
    got = gpt_oss.wire_piece(leaf, shape, self.params[target].shape, experts, tp_parts, tp_r)
    if isinstance(got, str):
        raise self._shape_error(name, target, shape, f"gpt-oss experts in the wire form "
                                f"{list(shape)}, E={num_experts}, ep_size={self.ep_size}, "
                                f"expert tp_size={tp_parts}: {got}")
    plan = TargetPlan(name, shape)
    plan.pieces.append(Piece(target, got.target_box, got.wire_box, target_shape=got.view_shape))
    if got.zero:
        plan.zero.append((target, full_region(self.params[target].shape)))
    if got.kept is not None:
        plan.kept.append((target, got.kept))
    return plan
