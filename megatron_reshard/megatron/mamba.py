"""Nemotron-H's Mamba-2 mixer tensors: Megatron-Core's per-TP-rank layout to the HF
checkpoint's, from the TP chunks of one parameter.

No Megatron import. Facts, megatron-core 0.16.1 (``ssm/mamba_mixer.py``) against the
Nemotron-H checkpoint (as vLLM's ``MambaMixer2`` loads it, ``vllm_layout.mamba``):

- ``in_proj`` (ColumnParallelLinear of ``2·d_inner + 2·G·N + H`` rows): TP rank r holds
  ``[z_r, x_r, B_r, C_r, dt_r]`` (``MambaMixer.forward`` splits its output so): its heads'
  z and x (``d_inner / T`` rows each), its groups' B and C (``G / T · N`` rows each; Megatron
  asserts ``G % T == 0``) and its heads' dt. The checkpoint's ``in_proj`` holds
  ``[z, x, B, C, dt]`` over all heads and groups.
- ``conv1d.weight [C_r, 1, K]`` / ``conv1d.bias [C_r]``: channels ``[x_r, B_r, C_r]``; the
  checkpoint's ``[x, B, C]``.
- ``A_log``, ``D``, ``dt_bias`` (per head), the gated norm's ``weight`` (per channel of
  d_inner: each rank's groups) and ``out_proj`` (row parallel) are split on one dim alike
  on both sides (kinds ``column`` / ``row``). vLLM holds ``A = -exp(A_log)`` instead of
  ``A_log`` (``vllm_layout.mamba``).

Every stream is a contiguous row block of each rank's tensor split over TP on its rows, so
no reshuffle is needed beyond joining each stream over the TP chunks; on the exact path each
stream travels apart (``stream_metadata``, ``stream_views``; wire names ``in_proj_z`` ...
``in_proj_dt``, ``conv1d_x`` / ``_B`` / ``_C``) shard to shard, where vLLM splits it as
Megatron does (the generation TP divides the groups).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError

KINDS = ("mamba_in_proj", "mamba_conv1d")
TP_DIMS = {kind: 0 for kind in KINDS}
IN_PROJ_STREAMS = ("z", "x", "B", "C", "dt")


@dataclass(frozen=True)
class MambaDims:
    """Mamba-2 geometry (HF ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
    ``ssm_state_size``; Megatron's ``mamba_*`` config fields)."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int

    @classmethod
    def from_config(cls, config: Any) -> Optional["MambaDims"]:
        """From a ``TransformerConfig`` of a model with Mamba layers; None otherwise (a
        config whose ``mamba_num_heads`` is unset: Megatron then derives the heads from
        ``hidden_size``, which a refit does not guess)."""
        heads = getattr(config, "mamba_num_heads", None)
        if not heads:
            return None
        return cls(int(heads), int(config.mamba_head_dim), int(config.mamba_num_groups),
                   int(config.mamba_state_dim))

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    def in_proj_rows(self, tp: int) -> list[int]:
        """Rows of one TP rank's ``in_proj``: z, x, B, C, dt."""
        g = self.num_groups * self.state_size // tp
        return [self.d_inner // tp, self.d_inner // tp, g, g, self.num_heads // tp]

    def conv1d_rows(self, tp: int) -> list[int]:
        """Channels of one TP rank's ``conv1d``: x, B, C."""
        return self.in_proj_rows(tp)[1:4]

    def hf_config_keys(self) -> dict:
        return dict(mamba_num_heads=self.num_heads, mamba_head_dim=self.head_dim,
                    n_groups=self.num_groups, ssm_state_size=self.state_size)


def _join_streams(chunks: Sequence[torch.Tensor], rows: Sequence[int]) -> torch.Tensor:
    """Each TP chunk cut into ``rows``; each stream joined over TP; the streams in order."""
    parts = [c.split(list(rows), dim=0) for c in chunks]
    return torch.cat([torch.cat([p[i] for p in parts], 0) for i in range(len(rows))], 0)


def in_proj_full(chunks: Sequence[torch.Tensor], d: MambaDims) -> torch.Tensor:
    """HF ``in_proj.weight`` ``[z; x; B; C; dt]`` from Megatron's per-rank chunks."""
    return _join_streams(chunks, d.in_proj_rows(len(chunks)))


def conv1d_full(chunks: Sequence[torch.Tensor], d: MambaDims) -> torch.Tensor:
    """HF ``conv1d.weight`` / ``.bias`` ``[x; B; C]`` channels from Megatron's per-rank chunks."""
    return _join_streams(chunks, d.conv1d_rows(len(chunks)))


def full_tensor(kind: str, chunks: Sequence[torch.Tensor], d: Optional[MambaDims], name: str
                ) -> torch.Tensor:
    if d is None:
        raise BadInputError(f"{name}: a Mamba mixer param, but the model config has no "
                            f"mamba_num_heads (the Mamba-2 geometry)")
    return in_proj_full(chunks, d) if kind == "mamba_in_proj" else conv1d_full(chunks, d)


def hf_shape(kind: str, local_shape: Sequence[int], tp: int, d: Optional[MambaDims], name: str
             ) -> list[int]:
    """The global HF shape of one rank's ``in_proj`` / ``conv1d`` tensor."""
    if d is None:
        raise BadInputError(f"{name}: a Mamba mixer param, but the model config has no "
                            f"mamba_num_heads (the Mamba-2 geometry)")
    rows = d.in_proj_rows(tp) if kind == "mamba_in_proj" else d.conv1d_rows(tp)
    if int(local_shape[0]) != sum(rows):
        raise BadInputError(f"{name}: {local_shape[0]} rows on this rank, expected {sum(rows)} "
                            f"({' + '.join(map(str, rows))}: {kind} at TP {tp})")
    return [sum(rows) * tp, *[int(s) for s in local_shape[1:]]]


# ---- the exact path: each stream of in_proj / conv1d sent apart (wire names below), a row
# block of every rank's tensor, split over TP on its rows on both sides (vllm_layout.mamba)
CONV1D_STREAMS = ("x", "B", "C")
_FUSED = re.compile(r"^(?P<prefix>backbone\.layers\.\d+\.mixer)\.(?P<what>in_proj|conv1d)\.(?P<leaf>weight|bias)$")


def stream_names(hf_name: str) -> Optional[list[str]]:
    """The exact path's wire names of ``in_proj.weight`` (``in_proj_z`` ... ``in_proj_dt``) or
    ``conv1d.weight`` / ``.bias`` (``conv1d_x`` / ``_B`` / ``_C``); None for any other name."""
    m = _FUSED.match(hf_name)
    if m is None:
        return None
    streams = IN_PROJ_STREAMS if m["what"] == "in_proj" else CONV1D_STREAMS
    return [f"{m['prefix']}.{m['what']}_{s}.{m['leaf']}" for s in streams]


def streams_travel_apart(d: MambaDims, gen_tp: int) -> bool:
    """Whether vLLM splits every stream over ``gen_tp`` as Megatron does (TP divides the
    groups); with one group over several ranks vLLM replicates B and C: sent whole (packed)."""
    return d.num_groups % gen_tp == 0 and d.num_heads % gen_tp == 0


def stream_metadata(metadata: Mapping[str, dict], d: MambaDims, gen_tp: int,
                    keep_packed: Callable[[str], bool]) -> dict[str, dict]:
    """``metadata`` with each Mamba ``in_proj`` / ``conv1d`` entry replaced (in its place) by
    its streams, where they travel apart and ``keep_packed`` does not match it."""
    if not streams_travel_apart(d, gen_tp):
        return dict(metadata)
    out: dict = {}
    for name, meta in metadata.items():
        names = stream_names(name)
        if names is None or keep_packed(name):
            out[name] = meta
            continue
        rows = d.in_proj_rows(1) if len(names) == len(IN_PROJ_STREAMS) else d.conv1d_rows(1)
        for stream, n in zip(names, rows):
            out[stream] = {**meta, "shape": [n, *meta["shape"][1:]]}
    return out


def stream_views(hf_name: str, tensor: torch.Tensor, d: MambaDims, tp: int) -> dict[str, torch.Tensor]:
    """This rank's streams of Megatron's ``in_proj`` / ``conv1d`` (views), by wire name."""
    names = stream_names(hf_name)
    rows = d.in_proj_rows(tp) if len(names) == len(IN_PROJ_STREAMS) else d.conv1d_rows(tp)
    return dict(zip(names, tensor.split(rows, dim=0)))
