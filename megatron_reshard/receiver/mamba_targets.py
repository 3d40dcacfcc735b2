"""Nemotron-H on one generation rank: vLLM's names for the checkpoint's ``backbone.*`` ones,
the Mamba-2 mixer's fused ``in_proj`` / ``conv1d`` (whole, or one stream sent apart) and
``A`` written as vLLM's ``-exp(A_log)`` (the layout facts: ``vllm_layout.mamba``).

Torch + stdlib only. ``self`` is the rank's ``receiver.targets.VllmTargets`` (these are its
methods, kept here to hold that module to one job per family).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from megatron_reshard.receiver.target_plan import Piece, TargetError, TargetPlan, full_region
from megatron_reshard.vllm_layout import mamba


def nemotron_h_plan(self, hf_name: str, hf_shape: Sequence[int]) -> TargetPlan:
    """A Nemotron-H param under vLLM's name; ``A_log`` written as vLLM's ``A = -exp(A_log)``."""
    problem = mamba.split_problem(hf_name, self.hf_config, self.tp_size)
    if problem:
        raise TargetError(f"{hf_name}: {problem} (on {self.where()})")
    name = mamba.vllm_name(hf_name)
    shape = tuple(int(s) for s in hf_shape)
    fused = mamba.MIXER_FUSED_RE.match(name)
    stream = mamba.stream_piece(name, self.hf_config, self.tp_size, self.tp_rank)
    if fused and name in self.params:
        plan = _fused_plan(self, name, shape, fused["which"])
    elif stream and stream[0] in self.params:
        plan = _stream_plan(self, name, shape, *stream)
    else:
        plan = self._resolve(name, hf_shape)
    if mamba.A_LOG_RE.search(hf_name):
        plan.pieces = [replace(p, transform=mamba.NEG_EXP) for p in plan.pieces]
    plan.hf_name = hf_name
    return plan


def _fused_plan(self, name: str, shape: tuple[int, ...], which: str) -> TargetPlan:
    """A Mamba-2 ``in_proj`` / ``conv1d``: each segment split over TP (a single group's B
    and C whole on every rank), as vLLM's loader fills it (``vllm_layout.mamba``)."""
    found = mamba.fused_pieces(which, self.hf_config, self.tp_size, self.tp_rank)
    if found is None:
        raise TargetError(f"{name}: hf_config lacks the Mamba dims (mamba_num_heads, "
                          f"mamba_head_dim, n_groups, ssm_state_size) on {self.where()}")
    rows, hf_rows, pieces = found
    if shape[0] != hf_rows:
        raise TargetError(f"{name}: HF shape {list(shape)} does not have the {hf_rows} rows the "
                          f"Mamba dims of hf_config give (on {self.where()})")
    if tuple(self.params[name].shape) != (rows,) + shape[1:]:
        raise self._shape_error(name, name, (rows,) + shape[1:],
                                "[z_r; x_r; B_r; C_r; dt_r] rows" if which == "in_proj.weight"
                                else "[x_r; B_r; C_r] channels")
    plan = TargetPlan(name, shape)
    rest = full_region(shape[1:])
    for t_rows, h_rows in pieces:
        plan.pieces.append(Piece(name, (t_rows,) + rest, (h_rows,) + rest))
    return plan


def _stream_plan(self, name: str, shape: tuple[int, ...], target: str, rows: int,
                 t_rows: tuple[int, int], h_rows: tuple[int, int], stream_rows: int) -> TargetPlan:
    """One stream of a Mamba-2 ``in_proj`` / ``conv1d`` sent apart into its rows of vLLM's
    fused tensor (``vllm_layout.mamba.stream_piece``)."""
    if shape[0] != stream_rows:
        raise TargetError(f"{name}: HF shape {list(shape)} does not have the {stream_rows} rows "
                          f"the Mamba dims of hf_config give (on {self.where()})")
    if tuple(self.params[target].shape) != (rows,) + shape[1:]:
        raise self._shape_error(name, target, (rows,) + shape[1:], "the rank's Mamba streams")
    plan = TargetPlan(name, shape)
    rest = full_region(shape[1:])
    plan.pieces.append(Piece(target, (t_rows,) + rest, (h_rows,) + rest))
    return plan
