"""Where each HF parameter lands in vLLM's per-rank storage.

Torch + stdlib only. ``VllmTargets`` wraps a model's ``named_parameters()`` (vLLM per-rank
names and shapes) with this rank's TP/EP coordinates. ``resolve`` answers, for one HF name
and its global shape, which boxes of which target tensors receive which boxes of the HF
tensor on this rank (plus rows to zero, for vocab padding). Both receive paths use it:

- the bulk path (``build_receiver_param_map``) checks that the region the payload delivers
  to this rank is exactly the one vLLM expects, and exposes that target box as the
  engine's destination (a view in place; a ``pre`` buffer + ``post`` copy-back only when
  asked to avoid strided destinations);
- the misc path (``full_weights.load_full_weights``) slices full HF tensors into the targets.

The layout facts (qkv_proj, gate_up_proj, vocab padding, FusedMoE w13/w2 and vLLM's
expert blocks) come from ``megatron_reshard.vllm_layout``; this module only matches HF
names to target tensors and checks shapes.

Boxes of a target are in checkpoint order. Where vLLM's post-load step stored a target in
a kernel's order (``orders``: ``receiver.kernel_layouts``), ``view`` / ``write`` go through
that order: a strided view where the box stays one (the FlashInfer CUTLASS [up; gate]
swap), else a scatter (FlashInfer TRTLLM's block layout); the padding such a backend adds
to the expert intermediate dim is left as vLLM keeps it (``TargetPlan.kept``).

Targets are chosen by the tensors' shapes, never by model family name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from megatron_reshard.layout.geometry import Box, box_index, box_numel, box_shape
from megatron_reshard.receiver.gpt_oss_targets import oss_expert_plan, oss_wire_plan
from megatron_reshard.receiver.mamba_targets import nemotron_h_plan
from megatron_reshard.receiver.target_plan import Piece, TargetError, TargetPlan, full_region
from megatron_reshard.errors import BadInputError, BadInputTypeError
from megatron_reshard.wire.expert_names import EXPERT_WEIGHT_RE
from megatron_reshard.wire.extras import HFConfig
from megatron_reshard.wire.spec import LocalParamSpec, RefitCtx
from megatron_reshard.vllm_layout import gated_delta_net, gpt_oss, mamba, mla
from megatron_reshard.vllm_layout import moe as vllm_moe
from megatron_reshard.vllm_layout.dense import (GATE_UP_RE, QKV_RE, VOCAB_PADDING,
                                                AttentionHeads, gate_up_rows,
                                                padded_vocab_rows, vocab_rows_of_rank)
from megatron_reshard.vllm_layout.kernel_order import PADDING, KernelOrder
from megatron_reshard.vllm_layout.float32_params import may_widen
from megatron_reshard.vllm_layout.moe import expert_block


def _as_dict(named: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
             ) -> dict[str, torch.Tensor]:
    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise BadInputTypeError(f"target {name!r} is a {type(tensor).__name__}, not a tensor")
        out[name] = tensor.detach()  # same storage; writes land in the parameter
    return out


@dataclass
class VllmTargets:
    """A vLLM model's per-rank parameters plus the coordinates that decide their contents."""

    params: dict[str, torch.Tensor]
    hf_config: HFConfig
    tp_rank: int
    tp_size: int
    ep_rank: int = 0
    ep_size: int = 1
    label: str = ""  # how errors name this rank, e.g. "gen rank 3"
    # targets vLLM stores in a kernel's order (receiver.kernel_layouts), by param name
    orders: dict[str, KernelOrder] = field(default_factory=dict)
    # FP8 targets of layers vLLM quantizes online (``receiver.online_quant.OnlineBlockFp8``:
    # ``name in quantizers``), written from BF16 by vLLM's own function; empty: none
    quantizers: Any = field(default_factory=dict)
    _renames: Optional[bool] = field(default=None, repr=False)  # gpt-oss's vLLM names
    _oss_experts = oss_expert_plan  # gpt-oss's experts (receiver.gpt_oss_targets)
    _oss_wire_experts = oss_wire_plan
    _nemotron_h = nemotron_h_plan  # Nemotron-H's names and Mamba-2 mixers (receiver.mamba_targets)

    @classmethod
    def from_named_parameters(cls, named, hf_config: Union[HFConfig, Mapping[str, Any], None],
                              tp_rank: int, tp_size: int,
                              ep_size: int = 1, ep_rank: Optional[int] = None,
                              label: str = "", orders: Optional[Mapping[str, KernelOrder]] = None,
                              quantizers: Any = None) -> "VllmTargets":
        if not 0 <= tp_rank < tp_size:
            raise BadInputError(f"tp_rank={tp_rank} is not in 0..{tp_size - 1}")
        ep_rank = tp_rank % ep_size if ep_rank is None else ep_rank
        if not 0 <= ep_rank < ep_size:
            raise BadInputError(f"ep_rank={ep_rank} is not in 0..{ep_size - 1}")
        return cls(_as_dict(named), HFConfig.of(hf_config), tp_rank, tp_size, ep_rank, ep_size, label,
                   dict(orders or {}), quantizers if quantizers is not None else {})

    def where(self) -> str:
        """This rank as error messages name it."""
        coords = f"tp_rank {self.tp_rank} of {self.tp_size}, ep_rank {self.ep_rank} of {self.ep_size}"
        return f"{self.label} ({coords})" if self.label else coords

    def strided_view(self, piece: Piece) -> Optional[torch.Tensor]:
        """The target box as a view of the storage; None where a kernel's order scatters it."""
        order = self.orders.get(piece.target)
        target = self.params[piece.target]
        if piece.target_shape is not None:  # no kernel order: refused by _oss_wire_experts
            target = target.view(piece.target_shape)
        if order is None:
            return target[box_index(piece.target_region)]
        return order.view(target, piece.target_region)

    def permuted_rows(self, piece: Piece):
        """The target box (three dims) as an ``layout.permuted_rows.PermutedRows`` of the
        storage where a kernel's order keeps it in permuted rows, else None."""
        order = self.orders.get(piece.target)
        if order is None or len(piece.target_region) != 3:
            return None
        return order.permuted_rows(self.params[piece.target], piece.target_region)

    def view(self, piece: Piece) -> torch.Tensor:
        view = self.strided_view(piece)
        if view is None:
            raise TargetError(f"{piece.target}: box {list(piece.target_region)} is stored in "
                              f"{self.orders[piece.target].backend}'s order on {self.where()}, "
                              f"not as a strided view; write it with VllmTargets.write")
        return view

    def write(self, piece: Piece, values: torch.Tensor) -> None:
        """Write ``values`` (the box's checkpoint-order elements) into the target box."""
        if piece.transform is not None:
            values = mamba.TRANSFORMS[piece.transform](values)
        view = self.strided_view(piece)
        if view is not None:
            view.copy_(values.reshape(view.shape))
            return
        box_dims = box_shape(piece.target_region)
        self.orders[piece.target].scatter(self.params[piece.target], piece.target_region,
                                          values.reshape(box_dims))

    # -- resolution --------------------------------------------------------------------

    def resolve(self, hf_name: str, hf_shape: Sequence[int]) -> TargetPlan:
        """Which target boxes ``hf_name`` (global shape ``hf_shape``) fills on this rank."""
        if hf_name.startswith(mamba.BACKBONE):  # Nemotron-H's checkpoint names (vllm_layout.mamba)
            return self._nemotron_h(hf_name, hf_shape)  # receiver.mamba_targets
        if self._renames is None:
            self._renames = gpt_oss.renames_names(self.params)
        if not self._renames:
            return self._resolve(hf_name, hf_shape)
        # gpt-oss: vLLM's names (vllm_layout.gpt_oss), the plan keeps the HF name
        m = gpt_oss.EXPERT_RE.match(hf_name)
        wire = gpt_oss.WIRE_RE.match(hf_name)
        if m:
            plan = self._oss_experts(hf_name, tuple(int(s) for s in hf_shape), m)
        elif wire:
            plan = self._oss_wire_experts(hf_name, tuple(int(s) for s in hf_shape), wire)
        else:
            plan = self._resolve(gpt_oss.vllm_name(hf_name), hf_shape)
        plan.hf_name = hf_name
        return plan

    def _resolve(self, hf_name: str, hf_shape: Sequence[int]) -> TargetPlan:
        shape = tuple(int(s) for s in hf_shape)
        heads_problem = mla.heads_split_problem(hf_name, self.hf_config, self.tp_size)
        if heads_problem:
            raise TargetError(f"{hf_name}: {heads_problem} (on {self.where()})")
        linear_problem = gated_delta_net.split_problem(hf_name, self.hf_config, self.tp_size)
        if linear_problem:
            raise TargetError(f"{hf_name}: {linear_problem} (on {self.where()})")
        if hf_name in self.params and gated_delta_net.CONV1D_RE.search(hf_name):
            return self._conv1d(hf_name, shape)
        stream = gated_delta_net.conv1d_stream_piece(hf_name, self.hf_config, self.tp_size, self.tp_rank)
        if stream and stream[0] in self.params:
            return self._conv1d_stream(hf_name, shape, *stream)
        flat = gated_delta_net.flat_in_proj_pieces(hf_name, self.hf_config, self.tp_size, self.tp_rank)
        if flat and flat[0] in self.params:
            return self._flat_in_proj(hf_name, shape, *flat)
        if hf_name in self.params:
            return self._direct(hf_name, shape)
        m = EXPERT_WEIGHT_RE.match(hf_name)
        if m:
            return self._experts(hf_name, shape, m)
        m = QKV_RE.match(hf_name)
        if m and f"{m['prefix']}.qkv_proj.{m['kind']}" in self.params:
            return self._qkv(hf_name, shape, m)
        m = GATE_UP_RE.match(hf_name)
        if m and f"{m['prefix']}.gate_up_proj.{m['kind']}" in self.params:
            return self._gate_up(hf_name, shape, m)
        fused_a = mla.fused_a_rows(hf_name, self.hf_config)
        if fused_a and fused_a[0] in self.params:
            return self._mla_fused_a(hf_name, shape, *fused_a)
        if hf_name.endswith("lm_head.weight") and self.hf_config.tie_word_embeddings:
            return TargetPlan(hf_name, shape, note="tied to the input embedding; nothing to write")
        fused = self._fused_candidate(hf_name)
        if fused:
            raise TargetError(f"{hf_name}: missing target on {self.where()}: expected vLLM param "
                              f"{fused!r} (or {hf_name!r}) in the model")
        raise TargetError(f"{hf_name}: unknown HF name on {self.where()}: no vLLM param of that "
                          f"name and no fused layout (qkv_proj, gate_up_proj, experts.w13/w2) "
                          f"takes it")

    def _fused_candidate(self, hf_name: str) -> str:
        fused_a = mla.fused_a_rows(hf_name, self.hf_config)
        if fused_a:
            return fused_a[0]
        m = QKV_RE.match(hf_name)
        if m:
            return f"{m['prefix']}.qkv_proj.{m['kind']}"
        m = GATE_UP_RE.match(hf_name)
        if m:
            return f"{m['prefix']}.gate_up_proj.{m['kind']}"
        return ""

    def _shape_error(self, hf_name: str, target: str, expected: Sequence[int], why: str) -> TargetError:
        return TargetError(f"{hf_name}: shape mismatch on {self.where()}: vLLM param {target!r} has "
                           f"shape {list(self.params[target].shape)}, expected {list(expected)} "
                           f"({why})")

    def _direct(self, name: str, shape: tuple[int, ...]) -> TargetPlan:
        """A target of the same name: replicated, or split evenly along the one dim that differs."""
        target = self.params[name]
        tshape = tuple(target.shape)
        plan = TargetPlan(name, shape)
        if tshape == shape:
            plan.pieces.append(Piece(name, full_region(tshape), full_region(shape)))
            return plan
        differ = [d for d in range(len(shape)) if len(tshape) == len(shape) and tshape[d] != shape[d]]
        if len(differ) != 1:
            raise self._shape_error(name, name, shape, "neither the full HF shape nor one dim split "
                                    f"over tp_size={self.tp_size}")
        d = differ[0]
        chunk, total, r = tshape[d], shape[d], self.tp_rank
        if chunk * self.tp_size == total:
            hf = list(full_region(shape))
            hf[d] = (r * chunk, (r + 1) * chunk)
            plan.pieces.append(Piece(name, full_region(tshape), tuple(hf)))
            return plan
        if d == 0 and chunk * self.tp_size == padded_vocab_rows(total) and len(shape) >= 1:
            # vocab rows padded to a multiple of 64, split evenly; padding rows are zero
            (lo, hi), _ = vocab_rows_of_rank(total, self.tp_size, r)
            if hi > lo:
                plan.pieces.append(Piece(name, ((0, hi - lo),) + full_region(tshape[1:]),
                                         ((lo, hi),) + full_region(shape[1:])))
            if hi - lo < chunk:
                plan.zero.append((name, ((hi - lo, chunk),) + full_region(tshape[1:])))
            return plan
        expected = list(shape)
        expected[d] = f"{total}/{self.tp_size}"
        raise self._shape_error(name, name, expected, f"dim {d} split evenly over tp_size="
                                f"{self.tp_size}, or vocab padded to {VOCAB_PADDING}")

    def _mla_fused_a(self, name: str, shape: tuple[int, ...], target: str, lo: int, hi: int
                     ) -> TargetPlan:
        """MLA ``q_a_proj`` / ``kv_a_proj_with_mqa`` into rows ``[lo, hi)`` of vLLM's
        replicated ``fused_qkv_a_proj`` (see ``vllm_layout.mla``)."""
        expected = mla.fused_a_shape(self.hf_config)
        if tuple(self.params[target].shape) != expected:
            raise self._shape_error(name, target, expected, "[q_a_proj ; kv_a_proj_with_mqa], "
                                    "replicated")
        if shape != (hi - lo, expected[1]):
            raise TargetError(f"{name}: HF shape {list(shape)} does not match rows {lo}..{hi} "
                              f"of {target!r} (q_lora_rank, kv_lora_rank, qk_rope_head_dim "
                              f"of hf_config)")
        plan = TargetPlan(name, shape)
        plan.pieces.append(Piece(target, ((lo, hi), (0, shape[1])), full_region(shape)))
        return plan

    def _conv1d(self, name: str, shape: tuple[int, ...]) -> TargetPlan:
        """Qwen3-Next's conv1d: three segments split over TP (``vllm_layout.gated_delta_net``)."""
        pieces = gated_delta_net.conv1d_pieces(self.hf_config, self.tp_size, self.tp_rank)
        if pieces is None:
            raise TargetError(f"{name}: hf_config lacks the linear_* dims, or a segment does not "
                              f"split over tp_size={self.tp_size} (on {self.where()})")
        expected = (pieces[-1][0][1],) + shape[1:]
        if tuple(self.params[name].shape) != expected:
            raise self._shape_error(name, name, expected, "[q_r; k_r; v_r] conv channels")
        plan = TargetPlan(name, shape)
        for t_rows, h_rows in pieces:
            plan.pieces.append(Piece(name, (t_rows,) + full_region(shape[1:]), (h_rows,) + full_region(shape[1:])))
        return plan

    def _conv1d_stream(self, name: str, shape: tuple[int, ...], target: str,
                       t_rows: tuple[int, int], h_rows: tuple[int, int]) -> TargetPlan:
        """One conv1d segment sent apart into its rows of vLLM's conv1d (Qwen3-Next, Qwen3.5)."""
        if shape[0] != (h_rows[1] - h_rows[0]) * self.tp_size or \
                tuple(self.params[target].shape[1:]) != shape[1:]:
            raise TargetError(f"{name}: HF shape {list(shape)} does not match the linear_* dims "
                              f"of hf_config or {target!r} {list(self.params[target].shape)} "
                              f"(on {self.where()})")
        plan = TargetPlan(name, shape)
        plan.pieces.append(Piece(target, (t_rows,) + full_region(shape[1:]),
                                 (h_rows,) + full_region(shape[1:])))
        return plan

    def _flat_in_proj(self, name: str, shape: tuple[int, ...], target: str, rows: int,
                      pieces: list) -> TargetPlan:
        """Qwen3.5's flat in_proj streams into their output shards of ``in_proj_qkvz`` /
        ``in_proj_ba`` (``vllm_layout.gated_delta_net``)."""
        expected = (rows,) + shape[1:]
        if tuple(self.params[target].shape) != expected:
            raise self._shape_error(name, target, expected, "[q_r; k_r; v_r; z_r] / [b_r; a_r]")
        if shape[0] != sum(h[1] - h[0] for _, h in pieces) * self.tp_size:
            raise TargetError(f"{name}: HF shape {list(shape)} does not match the linear_* dims "
                              f"of hf_config (on {self.where()})")
        plan = TargetPlan(name, shape)
        for t_rows, h_rows in pieces:
            plan.pieces.append(Piece(target, (t_rows,) + full_region(shape[1:]), (h_rows,) + full_region(shape[1:])))
        return plan

    def _heads(self, name: str) -> AttentionHeads:
        try:
            return gated_delta_net.attention_heads(self.hf_config)
        except KeyError as err:
            raise TargetError(f"{name}: hf_config lacks {err} needed to slice qkv_proj") from None

    def _qkv(self, name: str, shape: tuple[int, ...], m: re.Match) -> TargetPlan:
        target = f"{m['prefix']}.qkv_proj.{m['kind']}"
        heads = self._heads(name)
        T, r = self.tp_size, self.tp_rank
        problem = heads.tp_problem(T)
        if problem:
            raise TargetError(f"{name}: {problem}")
        which = m["which"]
        full_rows = heads.hf_rows(which)
        if shape[0] != full_rows:
            raise TargetError(f"{name}: HF shape {list(shape)} does not have {full_rows} rows "
                              f"({full_rows // heads.head_dim} heads x head_dim {heads.head_dim}) "
                              f"per hf_config")
        tshape = tuple(self.params[target].shape)
        expected = (heads.qkv_proj_rows(T),) + shape[1:]
        if tshape != expected:
            k0, k1 = heads.kv_heads_of_rank(T, r)
            raise self._shape_error(name, target, expected,
                                    f"[q_r | k_r | v_r] with {heads.num_heads // T} q heads and "
                                    f"{k1 - k0} KV heads of dim {heads.head_dim}")
        t_rows, h_rows = heads.qkv_piece(which, T, r)
        plan = TargetPlan(name, shape)
        plan.pieces.append(Piece(target, (t_rows,) + full_region(shape[1:]), (h_rows,) + full_region(shape[1:])))
        return plan

    def _gate_up(self, name: str, shape: tuple[int, ...], m: re.Match) -> TargetPlan:
        target = f"{m['prefix']}.gate_up_proj.{m['kind']}"
        T, r = self.tp_size, self.tp_rank
        rows = shape[0]
        if rows % T:
            raise TargetError(f"{name}: {rows} rows do not split over tp_size={T}")
        expected = (2 * (rows // T),) + shape[1:]
        if tuple(self.params[target].shape) != expected:
            raise self._shape_error(name, target, expected, "[gate_r ; up_r]")
        t_rows, h_rows = gate_up_rows(m["which"], rows, T, r)
        plan = TargetPlan(name, shape)
        plan.pieces.append(Piece(target, (t_rows,) + full_region(shape[1:]), (h_rows,) + full_region(shape[1:])))
        return plan

    def _expert_target(self, name: str, prefix: str, proj: str) -> str:
        candidates = vllm_moe.expert_target_candidates(prefix, proj)
        found = [c for c in candidates if c in self.params]
        if not found:
            raise TargetError(f"{name}: missing target on {self.where()}: expected vLLM param "
                              f"{candidates[0]!r} or {candidates[1]!r}")
        if len(found) == 2 and self.params[found[0]].data_ptr() != self.params[found[1]].data_ptr():
            raise TargetError(f"{name}: ambiguous target on {self.where()}: both {found[0]!r} and "
                              f"{found[1]!r} exist as separate tensors")
        return found[0]

    def _experts(self, name: str, shape: tuple[int, ...], m: re.Match) -> TargetPlan:
        proj, index = m["proj"], m["index"]
        target = self._expert_target(name, m["prefix"], proj)
        grouped = index is None
        per_expert = shape[1:] if grouped else shape
        if len(per_expert) != 2:
            raise TargetError(f"{name}: expected a 2-D expert weight (3-D when grouped), got shape "
                              f"{list(shape)}")
        if grouped:
            num_experts = shape[0]
        else:
            num_experts = int(self.hf_config.num_experts or 0)
            if not num_experts:
                raise TargetError(f"{name}: per-expert HF name needs hf_config's num_experts")
        if self.ep_size > 1:
            e_lo, e_hi = expert_block(num_experts, self.ep_rank, self.ep_size)
        else:
            e_lo, e_hi = 0, num_experts
        tp_parts, tp_r = vllm_moe.expert_tp_split(self.ep_size, self.tp_size, self.tp_rank)
        # the intermediate (I) dim of the per-expert weight: rows of gate/up, cols of down
        i_dim = 1 if proj == "down_proj" else 0
        inter = per_expert[i_dim]
        if inter % tp_parts:
            raise TargetError(f"{name}: expert intermediate size {inter} does not split over "
                              f"tp_size={tp_parts}")
        ip = inter // tp_parts
        i_rows = (tp_r * ip, (tp_r + 1) * ip)
        tshape = tuple(self.params[target].shape)
        local_e = e_hi - e_lo
        plan = TargetPlan(name, shape)
        alloc = self._padded_inter(name, target, proj, ip)  # vLLM's per-rank I with a kernel's padding
        if proj == "down_proj":
            expected = (local_e, per_expert[0], alloc)
            if tshape != expected:
                raise self._shape_error(name, target, expected,
                                        f"w2 [E_local, H, I_p] with E={num_experts}, ep_size={self.ep_size}")
            t_mid = ((0, per_expert[0]), (0, ip))
            h_mid = ((0, per_expert[0]), i_rows)
            pad = ((0, per_expert[0]), (ip, alloc))
        else:
            if tshape == (local_e, 2 * alloc, per_expert[1]):
                off = vllm_moe.w13_offset(proj, alloc)
            elif tshape == (local_e, alloc, per_expert[1]):
                if proj == "gate_proj":
                    raise TargetError(f"{name}: vLLM param {target!r} of shape {list(tshape)} holds "
                                      f"non-gated experts (up_proj only), but a gate_proj arrived")
                off = 0
            else:
                raise self._shape_error(name, target, (local_e, 2 * ip, per_expert[1]),
                                        f"w13 [E_local, 2*I_p, H] (or [E_local, I_p, H] non-gated) "
                                        f"with E={num_experts}, ep_size={self.ep_size}")
            t_mid = ((off, off + ip), (0, per_expert[1]))
            h_mid = (i_rows, (0, per_expert[1]))
            pad = ((off + ip, off + alloc), (0, per_expert[1]))
        if grouped:
            experts = (0, local_e)
            plan.pieces.append(Piece(target, (experts,) + t_mid, ((e_lo, e_hi),) + h_mid))
        else:
            e = int(index)
            if not e_lo <= e < e_hi:
                plan.note = f"expert {e} lives on another EP rank (this rank: {e_lo}..{e_hi - 1})"
                return plan
            experts = (e - e_lo, e - e_lo + 1)
            plan.pieces.append(Piece(target, (experts,) + t_mid, h_mid))
        if alloc > ip:
            plan.kept.append((target, (experts,) + pad))
        order = self.orders.get(target)
        problem = order.padding_problem(plan.pieces[0].target_region) if order else ""
        if problem:
            raise TargetError(f"{name}: {problem} in {target!r} on {self.where()}")
        return plan

    def _padded_inter(self, name: str, target: str, proj: str, ip: int) -> int:
        """The per-rank intermediate size vLLM allocated for ``target``: ``ip``, or rounded
        up where its kernel order marks the rows past ``ip`` as padding (FlashInfer TRTLLM)."""
        order = self.orders.get(target)
        if order is None:
            return ip
        dim = 2 if proj == "down_proj" else 1
        terms = order.terms[dim]
        pads = torch.nonzero(terms == PADDING).view(-1)
        if not pads.numel():
            return ip
        first = int(pads[0])
        gated = proj != "down_proj" and terms.numel() - pads.numel() == 2 * ip  # [gate; up] halves
        alloc = terms.numel() // 2 if gated else terms.numel()
        if first != ip:
            raise TargetError(f"{name}: vLLM's {order.backend} storage {target!r} on "
                              f"{self.where()} pads its intermediate dim from row {first}, but "
                              f"this rank holds {ip} rows of the checkpoint (allocated {alloc})")
        return alloc
# ------------------------------------------------------------------------- bulk mapping


def receive_spec(targets: VllmTargets, piece: Piece, strided_in_place: bool = True,
                 wire_dtype: Optional[torch.dtype] = None) -> LocalParamSpec:
    """The receive recipe for one target box: in place when possible, else buffer + copy-back
    (a strided box the caller wants contiguous, a box a kernel's order scatters that no
    permuted-row destination describes, or a target wider than the wire dtype: the buffer
    holds the wire dtype). A box a kernel's order keeps in permuted rows (FlashInfer
    TRTLLM's experts) is handed to the engine as an ``layout.permuted_rows.PermutedRows``:
    it unpacks and copies into the order in one pass, no buffer."""
    view = targets.strided_view(piece)
    if view is None:
        target = targets.params[piece.target]
        rows = targets.permuted_rows(piece)
        if rows is not None and (wire_dtype is None or wire_dtype == target.dtype):
            return LocalParamSpec(base=rows)

        def pre_scatter(_base) -> RefitCtx:
            return RefitCtx(buf=torch.empty(box_shape(piece.target_region),
                                            dtype=wire_dtype or target.dtype, device=target.device))

        def post_scatter(ctx: RefitCtx) -> None:
            targets.write(piece, ctx.buf.to(target.dtype))

        return LocalParamSpec(base=target, pre=pre_scatter, post=post_scatter)
    if wire_dtype is not None and wire_dtype != view.dtype:
        def pre_wide(region: torch.Tensor) -> RefitCtx:
            buf = torch.empty(region.shape, dtype=wire_dtype, device=region.device)
            return RefitCtx(buf=buf, extra={"region": region})

        def post_wide(ctx: RefitCtx) -> None:
            ctx.extra["region"].copy_(ctx.buf)

        return LocalParamSpec(base=view, pre=pre_wide, post=post_wide)
    if view.is_contiguous() or strided_in_place:
        return LocalParamSpec(base=view)

    def pre(region: torch.Tensor) -> RefitCtx:
        buf = torch.empty(region.shape, dtype=region.dtype, device=region.device)
        return RefitCtx(buf=buf, extra={"region": region})

    def post(ctx: RefitCtx) -> None:
        ctx.extra["region"].copy_(ctx.buf)

    return LocalParamSpec(base=view, pre=pre, post=post)


def check_wire_dtype(targets: VllmTargets, plan: TargetPlan, wire_dtype: torch.dtype) -> None:
    for piece in plan.pieces:
        tdtype = targets.params[piece.target].dtype
        if tdtype == torch.float8_e4m3fn and wire_dtype.is_floating_point and wire_dtype.itemsize > 1:
            continue  # a block-FP8 target: quantized on write (receiver.fp8_targets)
        if may_widen(plan.hf_name, str(wire_dtype), str(tdtype)):
            continue  # held in float32 by vLLM: widened exactly on write (``receive_spec``)
        if tdtype != wire_dtype:
            raise TargetError(f"{plan.hf_name}: dtype mismatch on {targets.where()}: wire dtype "
                              f"{wire_dtype}, vLLM param {piece.target!r} has dtype {tdtype}")


def bulk_receive_plan(targets: VllmTargets, hf_name: str, global_shape: Sequence[int],
                      region: Box, wire_dtype: torch.dtype, padded: bool = False) -> TargetPlan:
    """Check that the payload's region for this rank is what vLLM holds there; return the plan.

    ``region`` is the box of the HF tensor the engine delivers to this rank (from the
    payload's destination mesh and placements). ``padded``: the payload sends a padded
    shard (vocab), so the target may also hold padding rows (``plan.zero``) after it.
    """
    shape = tuple(int(s) for s in global_shape)
    plan = targets.resolve(hf_name, shape)
    check_wire_dtype(targets, plan, wire_dtype)
    if any(p.transposed or p.transform for p in plan.pieces):
        raise TargetError(f"{hf_name}: vLLM holds it transposed or transformed on "
                          f"{targets.where()}; it can only arrive as a full tensor (packed "
                          f"path), not shard to shard")
    zero_only = box_numel(region) == 0  # an empty block: the target holds zero (gpt-oss's w2_bias)
    if (plan.zero and not (padded or zero_only)) or len(plan.pieces) != 1 \
            or plan.pieces[0].hf_region != tuple(region):
        want = [list(p.hf_region) for p in plan.pieces]
        raise TargetError(
            f"{hf_name}: the payload delivers region {list(region)} to {targets.where()}, but "
            f"vLLM's layout on this rank expects {want or 'nothing'}"
            f"{' plus zero padding' if plan.zero else ''}")
    piece = plan.pieces[0]
    if box_shape(piece.target_region) != box_shape(region):
        raise TargetError(f"{hf_name}: target box {list(piece.target_region)} of {piece.target!r} "
                          f"does not have the shape of region {list(region)}")
    return plan
