"""Train-side meshes and the layer → PP stage map, from live ``megatron.core.parallel_state``.

Every train rank reports its coordinates (TP, CP, DP, PP, EP, expert-TP, expert-DP); the
meshes are built from those reports, not from a formula, so a non-default Megatron rank
order is described exactly instead of being assumed.

Per PP stage:

- *stage-local rank* = position of a global rank among the stage's global ranks sorted
  ascending (the refit group numbering of ``build_nccl_reshard_refit_info``: stage ranks
  ``0..T/pp-1``, generation ranks after);
- non-expert mesh ``[DP·CP, TP]`` (TP shards, DP and CP replicate), expert mesh
  ``[EDP, EP]`` (EP shards, expert-DP replicates); rows are ordered by their smallest
  member, columns by the TP / EP coordinate; size-1 axes are dropped exactly as
  ``placements.build_mesh_info`` drops them, so under the default order ``tp-cp-ep-dp-pp``
  both meshes equal ``build_mesh_info``'s.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.placements import MeshInfo, build_mesh_info


@dataclass(frozen=True)
class RankCoords:
    """One train rank's coordinates in every Megatron parallel group."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


@dataclass(frozen=True)
class TrainParallelism:
    """Parallel sizes of the training world, as read from ``parallel_state``."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    cp: int
    edp: int
    world_size: int
    vpp: int = 1

    def as_plain(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.etp, "dp": self.dp,
                "cp": self.cp, "world_size": self.world_size}

    def problems(self, has_experts: bool = True) -> list[str]:
        """What this project cannot serve with these sizes (empty if supported).

        Expert TP matters only where there are experts: Megatron's default sets it to the TP
        size, and a dense model's params never use it."""
        out = []
        if self.etp > 1 and has_experts:
            out.append(f"expert tensor parallel size {self.etp} > 1 is not supported yet for a "
                       "model with experts (Megatron's default is the TP size: pass "
                       "initialize_model_parallel(..., expert_tensor_parallel_size=1))")
        if self.vpp > 1:
            out.append(f"virtual pipeline parallel size {self.vpp} > 1 is not supported yet")
        product = self.tp * self.cp * self.dp * self.pp
        if product != self.world_size:
            out.append(f"parallel_state covers tp·cp·dp·pp = {self.tp}·{self.cp}·{self.dp}·{self.pp} "
                       f"= {product} ranks but the default torch.distributed world has {self.world_size}")
        return out


def read_parallel_state(has_experts: bool = True
                        ) -> tuple[Optional[TrainParallelism], Optional[RankCoords], list[str]]:
    """This rank's parallel sizes and coordinates from ``parallel_state``, plus what is wrong
    (no collective); ``has_experts``: whether the model has experts (see ``problems``)."""
    import torch.distributed as dist

    problems: list[str] = []
    if not (dist.is_available() and dist.is_initialized()):
        return None, None, ["torch.distributed is not initialised (init_process_group first)"]
    try:
        from megatron.core import parallel_state as ps
    except ImportError as err:  # pragma: no cover - the package depends on megatron-core
        return None, None, [f"megatron.core cannot be imported: {err}"]
    if not ps.model_parallel_is_initialized():
        return None, None, ["megatron.core.parallel_state is not initialised "
                            "(call parallel_state.initialize_model_parallel(...) first)"]
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    par = TrainParallelism(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        edp=ps.get_expert_data_parallel_world_size(),
        world_size=dist.get_world_size(),
        vpp=vpp,
    )
    coords = RankCoords(
        rank=dist.get_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
        edp=ps.get_expert_data_parallel_rank(),
    )
    problems.extend(par.problems(has_experts))
    return par, coords, problems


def coords_to_plain(coords: RankCoords) -> dict[str, int]:
    return asdict(coords)


def coords_from_plain(plain: dict[str, int]) -> RankCoords:
    return RankCoords(**plain)


@dataclass(frozen=True)
class StageMeshes:
    """Meshes of one PP stage over stage-local ranks, and the global ranks behind them."""

    stage: int
    ranks: tuple[int, ...]  # global ranks in stage-local order
    dense: MeshInfo
    dense_dims: dict
    expert: MeshInfo
    expert_dims: dict

    def local_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


def _squeeze_mesh(grid: torch.Tensor, names: tuple[str, str]) -> tuple[MeshInfo, dict[str, int]]:
    """Drop size-1 axes of a 2-D ``[outer, inner]`` grid the way ``build_mesh_info`` does."""
    kept = [(axis, name) for axis, name in enumerate(names) if grid.shape[axis] > 1]
    if not kept:
        return MeshInfo(grid.reshape(-1)), {}
    mesh = grid.reshape([grid.shape[axis] for axis, _ in kept])
    return MeshInfo(mesh), {name: i for i, (_, name) in enumerate(kept)}


def _grid(members: dict[int, tuple[Any, int]], n_cols: int, what: str, stage: int) -> torch.Tensor:
    """``{stage_local_rank: (row_key, col)}`` → ``[rows, n_cols]`` tensor of stage-local ranks.

    Rows are ordered by their smallest member; every row must hold each column exactly once.
    """
    rows: dict[Any, dict[int, int]] = {}
    for local, (row_key, col) in members.items():
        row = rows.setdefault(row_key, {})
        if col in row:
            raise BadInputError(f"{what} mesh of PP stage {stage}: stage-local ranks {row[col]} and {local} "
                             f"both claim row {row_key} column {col}")
        row[col] = local
    for row_key, row in rows.items():
        if sorted(row) != list(range(n_cols)):
            raise BadInputError(f"{what} mesh of PP stage {stage}: row {row_key} has columns {sorted(row)}, "
                             f"expected 0..{n_cols - 1}")
    ordered = sorted(rows.values(), key=lambda row: min(row.values()))
    return torch.tensor([[row[c] for c in range(n_cols)] for row in ordered], dtype=torch.int64)


def build_stage_meshes(all_coords: Sequence[RankCoords], par: TrainParallelism) -> list[StageMeshes]:
    """Per-stage non-expert and expert meshes from every train rank's reported coordinates."""
    if len(all_coords) != par.world_size:
        raise BadInputError(f"got coordinates of {len(all_coords)} ranks, the train world has {par.world_size}")
    out = []
    for stage in range(par.pp):
        members = sorted((c for c in all_coords if c.pp == stage), key=lambda c: c.rank)
        expected = par.world_size // par.pp
        if len(members) != expected:
            raise BadInputError(f"PP stage {stage} has {len(members)} ranks {[c.rank for c in members]}, "
                             f"expected world_size/pp = {expected}")
        ranks = tuple(c.rank for c in members)
        dense = _grid({i: ((c.dp, c.cp), c.tp) for i, c in enumerate(members)}, par.tp, "non-expert", stage)
        # expert TP > 1 only reaches here for a dense model (no expert param reads this mesh):
        # the expert-TP coordinate then splits rows that share an expert-DP rank
        expert = _grid({i: ((c.edp, c.etp), c.ep) for i, c in enumerate(members)}, par.ep,
                       "expert", stage)
        dense_mesh, dense_dims = _squeeze_mesh(dense, ("dp", "tp"))
        expert_mesh, expert_dims = _squeeze_mesh(expert, ("dp", "ep"))
        out.append(StageMeshes(stage, ranks, dense_mesh, dense_dims, expert_mesh, expert_dims))
    return out


def describe_rank_order(all_coords: Sequence[RankCoords], par: TrainParallelism) -> str:
    """The Megatron ``order`` string (size-1 dims omitted) that explains the non-expert ranks,
    or ``"unrecognised"``; used in messages and recorded in the payload."""
    sizes = {"tp": par.tp, "cp": par.cp, "dp": par.dp, "pp": par.pp}
    active = [n for n in ("tp", "cp", "dp", "pp") if sizes[n] > 1]
    if not active:
        return "tp-cp-ep-dp-pp"
    for perm in itertools.permutations(active):
        ok = True
        for c in all_coords:
            rank, stride = 0, 1
            for name in perm:
                rank += getattr(c, name) * stride
                stride *= sizes[name]
            if rank != c.rank:
                ok = False
                break
        if ok:
            return "-".join(perm)
    return "unrecognised"


def is_default_rank_order(stages: Sequence[StageMeshes], par: TrainParallelism) -> bool:
    """True iff the meshes are exactly what ``build_mesh_info`` makes under Megatron's default order."""
    per_stage = par.world_size // par.pp
    for s in stages:
        dense, dense_dims = build_mesh_info(per_stage, 0, tp_size=par.tp)
        expert, expert_dims = build_mesh_info(per_stage, 0, ep_size=par.ep)
        if (s.dense, s.dense_dims, s.expert, s.expert_dims) != (dense, dense_dims, expert, expert_dims):
            return False
        if s.ranks != tuple(range(s.stage * per_stage, (s.stage + 1) * per_stage)):
            return False
    return True
