"""vLLM's per-rank layout of gpt-oss (``GptOssForCausalLM``): the names it renames and its
experts.

Facts (vLLM ``model_executor/models/gpt_oss.py``, BF16 weights; MXFP4 is a different
storage, see the README):

- Names: HF ``model.embed_tokens`` is vLLM's ``model.embedding``, ``.self_attn.`` is
  ``.attn.``; ``attn.sinks [nh/T]`` holds the rank's heads; ``qkv_proj`` / ``o_proj`` /
  norms / ``mlp.router.{weight,bias}`` as in the dense layout (biases follow their rows;
  ``o_proj.bias`` and the router are whole on every rank).
- Experts (FusedMoE, ``routed_experts`` nested in vLLM 0.33): ``w13_weight [E_l, 2*I_p, H]``
  holds the rows of the checkpoint's ``gate_up_proj [H, 2I]`` transposed, gate and up still
  interleaved (vLLM's ``swigluoai`` activation reads them so); without EP rank r takes the
  columns ``[2*r*I_p, 2*(r+1)*I_p)``, with EP whole experts. ``w13_bias [E_l, 2*I_p]`` the
  same columns of ``gate_up_proj_bias``. ``w2_weight [E_l, H, I_p]`` is ``down_proj [I, H]``
  rows ``[r*I_p, (r+1)*I_p)`` transposed. ``w2_bias [E_l, H]`` is ``down_proj_bias`` on MoE
  TP rank 0 and zero on the others (the TP all-reduce would add it T times).
- Expert blocks with EP: vLLM's contiguous blocks (``moe.expert_block``).
- Padding: where a backend rounds the per-rank intermediate size up (``I_alloc``; on
  ROCm's AITER only: CUDA runs gpt-oss's BF16 ``swigluoai`` on Triton, unpadded), vLLM's
  per-expert loader (``GptOssRoutedExperts``) gives rank r the checkpoint's intermediate
  range ``[r*I_alloc, ...)``, and the rows past it stay as allocated (zero).

The exact path's wire form (``WIRE_RE``, one record per layer and tensor, every expert):
vLLM's own tensors over all experts and the whole intermediate dim, ``w13_weight`` seen
as ``[E, I, 2, H]`` (a row-major reshape of ``[E, 2I, H]``: gate and up of intermediate
row i side by side), ``w13_bias [E, I, 2]``, ``w2_weight [E, H, I]``, ``w2_bias [E, H]``.
In that form each generation rank's share is one box (``gen_placements``), and its
storage a view (``wire_piece``); Megatron's ``[gate ; up]`` rows are a view of it too
(``megatron.gpt_oss``), so the experts travel shard to shard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.layout.placements import BlockShard
from megatron_reshard.vllm_layout.moe import expert_gen_placement

# HF name fragment -> vLLM's, for the models that rename (GptOssModel)
RENAMES = (("model.embed_tokens.", "model.embedding."), (".self_attn.", ".attn."))

EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$")

# HF name -> TP dim on both sides (None: whole on every rank), for the direct params of
# gpt-oss beyond the dense ones (read by ``dense.tp_dim_of``)
TP_DIM_RULES = (
    (re.compile(r"\.self_attn\.sinks$"), 0),
    (re.compile(r"\.self_attn\.o_proj\.bias$"), None),
    (re.compile(r"\.mlp\.router\.(?:weight|bias)$"), None),
)


def renames_names(param_names: Collection[str]) -> bool:
    """Whether a model's params use gpt-oss's vLLM names: attention under ``.attn.`` with a
    fused ``qkv_proj`` and nothing under ``.self_attn.``."""
    return (any(".attn.qkv_proj." in n for n in param_names)
            and not any(".self_attn." in n for n in param_names))


def vllm_name(hf_name: str) -> str:
    for old, new in RENAMES:
        hf_name = hf_name.replace(old, new)
    return hf_name


def expert_targets(prefix: str, proj: str, bias: bool) -> list[str]:
    """vLLM param names (flat, then nested) holding ``<prefix>.<e>.<proj>[_bias]``."""
    leaf = ("w13" if proj == "gate_up_proj" else "w2") + ("_bias" if bias else "_weight")
    return [f"{prefix}.{leaf}", f"{prefix}.routed_experts.{leaf}"]


def inter_columns(proj: str, inter_per_rank: int, tp_index: int) -> tuple[int, int]:
    """The checkpoint's intermediate range ``[lo, hi)`` one rank holds: interleaved gate/up
    columns (``gate_up_proj``: twice the rows) or ``down_proj`` rows."""
    width = 2 * inter_per_rank if proj == "gate_up_proj" else inter_per_rank
    return tp_index * width, (tp_index + 1) * width


def down_bias_is_zero(tp_index: int) -> bool:
    """``w2_bias`` of MoE TP rank ``tp_index`` is zero (not the checkpoint's bias) when > 0."""
    return tp_index > 0


# ---- the exact path's wire form of the experts (see the module doc)
WIRE_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<leaf>w13_weight|w13_bias|w2_weight|w2_bias)$")
LEAF_OF = {("gate_up_proj", False): "w13_weight", ("gate_up_proj", True): "w13_bias",
           ("down_proj", False): "w2_weight", ("down_proj", True): "w2_bias"}
# the intermediate dim of each wire tensor (w2_bias has none)
INTER_DIM = {"w13_weight": 1, "w13_bias": 1, "w2_weight": 2}


def wire_shape(leaf: str, num_experts: int, hf_shape: Sequence[int]) -> tuple[int, ...]:
    """The wire shape of ``leaf`` from one expert's checkpoint shape (``gate_up_proj [H, 2I]``,
    its bias ``[2I]``, ``down_proj [I, H]``, its bias ``[H]``)."""
    s = [int(n) for n in hf_shape]
    return {"w13_weight": lambda: (num_experts, s[1] // 2, 2, s[0]),
            "w13_bias": lambda: (num_experts, s[0] // 2, 2),
            "w2_weight": lambda: (num_experts, s[1], s[0]),
            "w2_bias": lambda: (num_experts, s[0])}[leaf]()


def gen_placements(leaf: str, shape: Sequence[int], mesh_shape: Sequence[int], dims: dict) -> list:
    """Placements of a wire tensor on vLLM's mesh (``dims``: axis of "ep" / "tp"): vLLM's
    expert blocks on the EP axis (whole experts); without EP the intermediate dim split
    over TP, and ``w2_bias`` on TP rank 0 alone (an empty block on the others, which hold
    zero: ``down_bias_is_zero``)."""
    placements: list = [Replicate() for _ in mesh_shape]
    if "ep" in dims:
        placements[dims["ep"]] = expert_gen_placement(int(shape[0]), int(mesh_shape[dims["ep"]]))
    elif "tp" in dims:
        tp = int(mesh_shape[dims["tp"]])
        if leaf == "w2_bias":
            placements[dims["tp"]] = BlockShard(1, (int(shape[1]),) + (0,) * (tp - 1))
        else:
            placements[dims["tp"]] = Shard(INTER_DIM[leaf])
    return placements


@dataclass(frozen=True)
class WirePiece:
    """Where one rank's box of a wire tensor lies in vLLM's storage: the target seen as
    ``view_shape`` (a row-major reshape of it), ``target_box`` of that view receives
    ``wire_box``; ``kept``: the box of the view a backend's padding fills (never written);
    ``zero``: the target holds zero here (``wire_box`` is empty)."""

    view_shape: tuple
    target_box: tuple
    wire_box: tuple
    kept: Optional[tuple] = None
    zero: bool = False


def wire_piece(leaf: str, shape: Sequence[int], target_shape: Sequence[int],
               experts: tuple[int, int], tp_parts: int, tp_index: int) -> "WirePiece | str":
    """This rank's ``WirePiece`` of wire tensor ``leaf`` (global ``shape``) in a target of
    ``target_shape``, holding ``experts`` ``[lo, hi)`` and part ``tp_index`` of
    ``tp_parts`` of the intermediate dim; a string saying why not where the shapes do not fit."""
    lo, hi = experts
    n = hi - lo
    tshape = tuple(int(s) for s in target_shape)
    E_box = ((0, n),)
    if leaf == "w2_bias":
        H = int(shape[1])
        if tshape != (n, H):
            return f"expected [E_local={n}, H={H}]"
        if down_bias_is_zero(tp_index):
            return WirePiece(tshape, E_box + ((0, 0),), ((lo, hi), (H, H)), zero=True)
        return WirePiece(tshape, E_box + ((0, H),), ((lo, hi), (0, H)))
    inter = int(shape[INTER_DIM[leaf]])
    if inter % tp_parts:
        return f"the intermediate size {inter} does not split over {tp_parts} ranks"
    ip = inter // tp_parts
    rows = (tp_index * ip, (tp_index + 1) * ip)
    if leaf == "w2_weight":
        H = int(shape[1])
        alloc = tshape[2] if len(tshape) == 3 else -1
        if len(tshape) != 3 or tshape[:2] != (n, H) or alloc < ip:
            return f"expected [E_local={n}, H={H}, I_p>={ip}]"
        view, t_box, w_box = tshape, E_box + ((0, H), (0, ip)), ((lo, hi), (0, H), rows)
        pad = E_box + ((0, H), (ip, alloc))
    else:
        rest = shape[3:]  # (H,) for the weight, () for the bias
        alloc = tshape[1] // 2 if len(tshape) == 2 + len(rest) else -1
        if (len(tshape) != 2 + len(rest) or tshape[0] != n or tshape[1] % 2 or alloc < ip
                or tuple(tshape[2:]) != tuple(rest)):
            return f"expected [E_local={n}, 2*I_p>={2 * ip}{''.join(f', {r}' for r in rest)}]"
        tail = tuple((0, int(r)) for r in rest)
        view = (n, alloc, 2, *(int(r) for r in rest))
        t_box, w_box = E_box + ((0, ip), (0, 2)) + tail, ((lo, hi), rows, (0, 2)) + tail
        pad = E_box + ((ip, alloc), (0, 2)) + tail
    if alloc > ip and tp_parts > 1:  # vLLM's loader: rank r from r*I_alloc, not r*I_p
        return (f"vLLM pads the per-rank intermediate size {ip} to {alloc}, and then splits the "
                f"checkpoint in chunks of {alloc}; supported only with whole experts per rank")
    return WirePiece(view, t_box, w_box, kept=pad if alloc > ip else None)
