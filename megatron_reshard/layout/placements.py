"""Meshes and placements: the vocabulary every layer states a layout in.

Torch + stdlib only, below everything else of the library (the engine, ``vllm_layout``,
``wire`` and both sides import it; it imports none of them). A mesh is a tensor of ranks
(any shape); a parameter's placements on a mesh are one torch placement (``Shard(d)`` /
``Replicate()``, or the two extensions below) per mesh axis, as in DTensor. Which
placements a parameter gets is decided elsewhere: by HF name in ``wire.placement_rules``
(the seed's rules), by vLLM's layout in ``vllm_layout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.errors import BadInputError, BadInputTypeError

# Order in which parallel dims are emitted by build_mesh_info (first = innermost axis).
MESH_DIM_ORDER = ("tp", "ep", "dp", "pp")


class MeshInfo:
    """A mesh of ranks that needs no process group (ranks may span two torch worlds).

    Compatible with the part of ``DeviceMesh`` that the transfer engine reads: ``.mesh``
    (and ``._mesh``) is the rank tensor, ``.ndim`` its number of axes.
    """

    def __init__(self, rank_tensor: torch.Tensor):
        mesh = torch.as_tensor(rank_tensor, dtype=torch.int64).detach().cpu()
        if mesh.ndim == 0:
            mesh = mesh.reshape(1)
        ranks = mesh.flatten().tolist()
        if not ranks:
            raise BadInputError("MeshInfo: a mesh needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise BadInputError(f"MeshInfo: ranks must be unique, got {ranks}")
        if any(r < 0 for r in ranks):
            raise BadInputError(f"MeshInfo: ranks must be >= 0, got {ranks}")
        self._mesh = mesh
        self._key: Optional[tuple] = None  # the rank tensor is never mutated through MeshInfo

    @property
    def mesh(self) -> torch.Tensor:
        return self._mesh

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._mesh.shape)

    def ranks(self) -> list[int]:
        """All ranks of the mesh in row-major order."""
        return self._mesh.flatten().tolist()

    def coordinate_of(self, rank: int) -> Optional[tuple[int, ...]]:
        """Row-major coordinate of ``rank`` in the mesh, or None if it is not a member."""
        hits = (self._mesh == rank).nonzero()
        return tuple(hits[0].tolist()) if len(hits) else None

    def key(self) -> tuple:
        """Plain-data identity (shape + ranks), usable as a cache key (computed once)."""
        if self._key is None:
            self._key = (self.shape, tuple(self.ranks()))
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshInfo) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"MeshInfo({self._mesh.tolist()})"


class MeshSizeError(BadInputError, AssertionError):
    """Parallel sizes that do not tile the GPU count.

    Also an ``AssertionError`` because the seed asserts this condition, so callers written
    against the seed (``except AssertionError``) still catch it.
    """


def build_mesh_info(
    num_gpus: int, rank_offset: int, tp_size: int = 1, ep_size: int = 1, pp_size: int = 1
) -> tuple[MeshInfo, dict[str, int]]:
    """Build a mesh of ``num_gpus`` consecutive ranks from ``rank_offset`` and its dim map.

    Dims are taken in the order (tp, ep, dp, pp), size-1 dims dropped, and the survivors
    reversed, so the first survivor (tp, or ep in an expert mesh) is the innermost axis.
    Raises ``MeshSizeError`` (a ValueError and AssertionError) if the sizes do not tile
    ``num_gpus``, ValueError for sizes that are not positive ints.
    """
    sizes = {"tp": tp_size, "ep": ep_size, "pp": pp_size}
    for name, size in {**{f"{k}_size": v for k, v in sizes.items()}, "num_gpus": num_gpus}.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise BadInputError(f"build_mesh_info: {name} must be a positive int, got {size!r}")
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
        raise BadInputError(f"build_mesh_info: rank_offset must be a non-negative int, got {rank_offset!r}")
    model_parallel = tp_size * ep_size * pp_size
    dp_size = num_gpus // model_parallel
    if dp_size * model_parallel != num_gpus:
        raise MeshSizeError(
            f"build_mesh_info: num_gpus={num_gpus} (ranks {rank_offset}..{rank_offset + num_gpus - 1}) "
            f"is not divisible by tp_size*ep_size*pp_size={tp_size}*{ep_size}*{pp_size}={model_parallel}; "
            f"expected a multiple of {model_parallel}"
        )
    sizes["dp"] = dp_size
    survivors = [name for name in MESH_DIM_ORDER if sizes[name] > 1]
    ranks = torch.arange(rank_offset, rank_offset + num_gpus, dtype=torch.int64)
    if not survivors:
        return MeshInfo(ranks), {}
    outer_to_inner = list(reversed(survivors))
    mesh = ranks.reshape([sizes[name] for name in outer_to_inner])
    return MeshInfo(mesh), {name: axis for axis, name in enumerate(outer_to_inner)}


@dataclass(frozen=True)
class PaddedShard:
    """Shard ``dim`` as if it had ``padded_size`` entries, split evenly over the mesh axis.

    This is how both sides hold vocabularies: Megatron pads the vocab to a multiple of
    128·TP, vLLM to a multiple of 64, and each rank keeps ``padded_size / m`` rows, of
    which only those below the real size belong to the global (HF) tensor; the rest is
    padding that never travels. Wire form: ``{"dim": d, "padded": padded_size}``.
    """

    dim: int
    padded_size: int


@dataclass(frozen=True)
class BlockShard:
    """Shard ``dim`` into contiguous blocks of explicit sizes, one per coordinate of the
    mesh axis (an uneven split; a block may be empty).

    This is how splits that ``torch.chunk`` rules cannot state are held: vLLM's expert
    blocks when the experts do not divide over EP (the first ranks get one more), and
    Megatron's q/k/v rows when a TP rank cuts a KV group (a rank holds the tail of the q
    rows of a group, or its k/v rows, or nothing of one of them). The sizes add up to the
    dim's size. Wire form: ``{"dim": d, "blocks": [sizes]}``.
    """

    dim: int
    sizes: tuple

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if not self.sizes or any(s < 0 for s in self.sizes):
            raise BadInputError(f"BlockShard({self.dim}): block sizes must be >= 0, one per mesh "
                             f"coordinate; found {list(self.sizes)}")


def placements_to_plain(placements: Sequence) -> list[dict]:
    """Placements as plain dicts: ``Shard(d)`` → ``{"dim": d}``, ``Replicate()`` → ``{}``,
    ``PaddedShard(d, n)`` → ``{"dim": d, "padded": n}``, ``BlockShard(d, sizes)`` →
    ``{"dim": d, "blocks": [sizes]}``."""
    out = []
    for p in placements:
        if isinstance(p, BlockShard):
            out.append({"dim": int(p.dim), "blocks": list(p.sizes)})
        elif isinstance(p, PaddedShard):
            out.append({"dim": int(p.dim), "padded": int(p.padded_size)})
        elif isinstance(p, Shard):
            out.append({"dim": int(p.dim)})
        elif isinstance(p, Replicate):
            out.append({})
        else:
            raise BadInputTypeError(f"unsupported placement {p!r}: only Shard, PaddedShard, "
                            "BlockShard and Replicate are supported")
    return out


def restore_placement(p):
    """A placement back from its wire form: instances kept, ``{"dim": d}`` → Shard, else Replicate.

    Extensions beyond the seed: ``{"dim": d, "padded": n}`` → ``PaddedShard(d, n)``,
    ``{"dim": d, "blocks": [sizes]}`` → ``BlockShard(d, sizes)``.
    """
    if isinstance(p, (Shard, Replicate, PaddedShard, BlockShard)):
        return p
    if isinstance(p, dict) and "dim" in p:
        if p.get("blocks") is not None:
            return BlockShard(int(p["dim"]), tuple(p["blocks"]))
        if p.get("padded") is not None:
            return PaddedShard(int(p["dim"]), int(p["padded"]))
        return Shard(int(p["dim"]))
    return Replicate()


