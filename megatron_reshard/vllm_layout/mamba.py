"""vLLM's per-rank layout of Nemotron-H (``NemotronHForCausalLM``): names and Mamba-2 mixers.

Torch + stdlib only. Facts (vLLM 0.34, ``models/nemotron_h.py``,
``layers/mamba/mamba_mixer2.py``):

- Names: vLLM's ``hf_to_vllm_mapper`` maps the checkpoint's ``backbone.`` to ``model.``,
  ``embeddings`` to ``embed_tokens`` and ``A_log`` to ``A``; attention ``q/k/v_proj`` stack
  into ``mixer.qkv_proj``; the rest keeps the checkpoint's name (``norm_f``, ``mixer.up_proj``).
- ``A [H/T]`` (float32 whatever the model dtype) holds ``-exp(A_log)``: its loader splits the
  checkpoint's ``A_log`` on dim 0, widens it into the float32 param, then writes
  ``-torch.exp(param.float())`` (``composed_weight_loader``). The receiver computes the same
  on write (``NEG_EXP``); nothing else is derived from it after loading.
- ``in_proj.weight`` and ``conv1d.weight [C/T, 1, K]`` / ``conv1d.bias`` hold the
  checkpoint's segments (``[z, x, B, C, dt]``, ``[x, B, C]``) each split over TP, rank r
  holding ``[z_r, x_r, B_r, C_r, dt_r]``: a MergedColumnParallelLinear when T divides
  ``n_groups``; else (only ``n_groups == 1`` is allowed) ``mamba_v2_sharded_weight_loader``
  gives every rank the one group's B and C whole (the group replicated to follow the head
  shards) in a shard of ``N`` rows. ``in_proj_pieces`` restates that loader's arithmetic.
- ``D``, ``dt_bias`` (per head), the gated norm's ``weight`` (``Mixer2RMSNormGated``,
  ``d_inner / T``) split on dim 0; ``out_proj`` row parallel; ``conv_weights`` is a buffer
  viewing ``conv1d.weight`` (written with it).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

BACKBONE = "backbone."
MIXER_FUSED_RE = re.compile(r"^(?P<prefix>.*\.mixer)\.(?P<which>in_proj\.weight|conv1d\.weight|conv1d\.bias)$")
A_LOG_RE = re.compile(r"\.mixer\.A_log$")
NEG_EXP = "neg_exp"  # a Piece's transform: vLLM's A = -exp(A_log)


def vllm_name(hf_name: str) -> str:
    """vLLM's name of a Nemotron-H checkpoint param (``backbone.`` names; others as they are)."""
    if not hf_name.startswith(BACKBONE):
        return hf_name
    name = "model." + hf_name[len(BACKBONE):]
    name = name.replace(".embeddings.", ".embed_tokens.")
    return A_LOG_RE.sub(".mixer.A", name)


def neg_exp(values: torch.Tensor) -> torch.Tensor:
    """What vLLM's loader stores in ``A`` for checkpoint values ``A_log``."""
    return -torch.exp(values.float())


TRANSFORMS = {NEG_EXP: neg_exp}


def _dims(hf_config: Any) -> Optional[tuple[int, int, int, int]]:
    """(heads, head_dim, groups, state size), or None when hf_config lacks one."""
    try:
        return (int(hf_config.mamba_num_heads), int(hf_config.mamba_head_dim),
                int(hf_config.n_groups), int(hf_config.ssm_state_size))
    except TypeError:
        return None


def split_problem(hf_name: str, hf_config: Any, tp_size: int) -> Optional[str]:
    """Why vLLM cannot hold a Mamba-2 mixer param over ``tp_size`` ranks (None: it can):
    MambaMixer2 asserts that TP divides the heads, and divides ``n_groups`` or ``n_groups``
    is 1."""
    if ".mixer." not in hf_name or not hf_name.startswith(BACKBONE) or _dims(hf_config) is None:
        return None
    heads, _, groups, _ = _dims(hf_config)
    if heads % tp_size:
        return f"its {heads} Mamba heads do not split over tp_size={tp_size}"
    if groups % tp_size and groups != 1:
        return (f"its {groups} Mamba groups neither split over tp_size={tp_size} nor are one "
                f"group (vLLM replicates only a single group)")
    return None


def _segments(which: str, heads: int, head_dim: int, groups: int, state: int, tp: int
              ) -> list[tuple[int, int, bool]]:
    """vLLM's ``shard_spec`` of ``which``: (full dim, extra rows, duplicated) per segment."""
    d_inner = heads * head_dim
    if groups % tp == 0:
        group = (groups * state, 0, False)
    else:  # n_groups == 1: extended to tp groups, the extra ones copies (extra_groups_for_head_shards)
        group = (tp * state, (tp - 1) * state, True)
    inner = (d_inner, 0, False)
    if which.startswith("in_proj"):
        return [inner, inner, group, group, (heads, 0, False)]
    return [inner, group, group]


def fused_pieces(which: str, hf_config: Any, tp_size: int, tp_rank: int
                 ) -> Optional[tuple[int, int, list[tuple[tuple[int, int], tuple[int, int]]]]]:
    """(rows of this rank's target, rows of the checkpoint tensor, [(target rows, checkpoint
    rows)]) of ``in_proj.weight`` /
    ``conv1d.weight`` / ``conv1d.bias``, as ``mamba_v2_sharded_weight_loader`` (and the
    MergedColumnParallelLinear split, which it equals when TP divides the groups) fills
    them; None when hf_config lacks the Mamba dims."""
    dims = _dims(hf_config)
    if dims is None:
        return None
    pieces, boundary, loaded = [], 0, 0
    for full, extra, duplicated in _segments(which, *dims, tp_size):
        shard = full // tp_size
        skip = 0 if duplicated else tp_rank * shard
        take = min(shard, full - extra - skip)
        pieces.append(((boundary, boundary + take), (loaded + skip, loaded + skip + take)))
        boundary += shard
        loaded += full - extra
    return boundary, loaded, pieces


# HF name -> the dim vLLM splits over TP (None: replicated), for the Nemotron-H params that
# Megatron-Core splits the same way (``dense.TP_DIM_RULES``): they travel shard to shard.
# A_log is not listed (vLLM holds -exp(A_log): full tensors only), nor in_proj / conv1d whole.
TP_DIM_RULES: tuple[tuple[re.Pattern, Optional[int]], ...] = (
    (re.compile(r"^backbone\.layers\.\d+\.norm\.weight$"), None),
    (re.compile(r"^backbone\.norm_f\.weight$"), None),
    (re.compile(r"^backbone\.layers\.\d+\.mixer\.(?:D|dt_bias|norm\.weight)$"), 0),
    (re.compile(r"^backbone\.layers\.\d+\.mixer\.(?:out_proj|o_proj)\.weight$"), 1),
    # the streams of in_proj / conv1d sent apart (megatron.mamba.stream_names)
    (re.compile(r"^backbone\.layers\.\d+\.mixer\.in_proj_(?:z|x|B|C|dt)\.weight$"), 0),
    (re.compile(r"^backbone\.layers\.\d+\.mixer\.conv1d_(?:x|B|C)\.(?:weight|bias)$"), 0),
)
STREAM_RE = re.compile(r"^(?P<prefix>.*\.mixer)\.(?P<what>in_proj|conv1d)_(?P<which>z|x|B|C|dt)\.(?P<leaf>weight|bias)$")
_STREAM_INDEX = {"in_proj": ("z", "x", "B", "C", "dt"), "conv1d": ("x", "B", "C")}


def stream_piece(name: str, hf_config: Any, tp_size: int, tp_rank: int
                 ) -> Optional[tuple[str, int, tuple[int, int], tuple[int, int], int]]:
    """One stream of ``in_proj`` / ``conv1d`` sent apart (vLLM name, ``in_proj_B.weight``):
    (vLLM's fused target, its rows on this rank, the target rows the stream fills, the
    stream's rows this rank receives, the stream's total rows); None for any other name or
    where hf_config lacks the Mamba dims."""
    m = STREAM_RE.match(name)
    found = fused_pieces(f"{m['what']}.{m['leaf']}" if m else "", hf_config, tp_size, tp_rank) if m else None
    if found is None:
        return None
    rows, _, pieces = found
    index = _STREAM_INDEX[m["what"]].index(m["which"])
    if index >= len(pieces):
        return None  # conv1d has no z / dt stream
    segments = _segments(f"{m['what']}.{m['leaf']}", *_dims(hf_config), tp_size)
    start = sum(full - extra for full, extra, _ in segments[:index])
    t_rows, (lo, hi) = pieces[index]
    full, extra, _ = segments[index]
    return f"{m['prefix']}.{m['what']}.{m['leaf']}", rows, t_rows, (lo - start, hi - start), full - extra
