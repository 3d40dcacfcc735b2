"""Public verbs and value types of the transfer engine (see docs/DESIGN.md, Engine API)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch

from .checks import Problem
from .execute import run_batch
from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import shard_ownerships
from .plan import Planner, mesh_key, layout_key
from megatron_reshard.groups.collectives import resolve_group


@dataclass
class DTensorRef:
    """A rank's local shard together with the global shape of the tensor it belongs to."""

    local: torch.Tensor
    global_shape: tuple

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(n) for n in self.global_shape)

    # The names a torch DTensor offers, which NeMo-RL's callers read.
    @property
    def _local_tensor(self) -> torch.Tensor:
        return self.local

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return torch.Size(self.global_shape)


@dataclass
class Transfer:
    """One parameter of a batch: global shape, dtype, both layouts, this rank's tensors.

    ``src``/``dst`` are this rank's local source shard / destination storage (any strides;
    ``dst`` is written in place), ``None`` on a rank outside that side. Either may also be
    a list of tensors, one per index of the local shard's dim 0 (a rank's experts, read
    and written where they are: ``members.py``).
    """

    name: str
    global_shape: tuple
    dtype: torch.dtype
    src_mesh: Any
    src_placements: list
    dst_mesh: Any
    dst_placements: list
    src: Optional[torch.Tensor] = None
    dst: Optional[torch.Tensor] = None


def xferdtensor(src, src_mesh, src_placements: Sequence, dst, dst_mesh,
                dst_placements: Sequence, group, stream=None, *,
                planner: Optional[Planner] = None, name: str = "<xferdtensor>",
                agree: bool = True) -> None:
    """Reshard one tensor: ``xfer_batch`` of a single ``Transfer``.

    ``src``/``dst``: a torch ``DTensor``, a ``DTensorRef`` or any object with
    ``._local_tensor`` (the local shard) and ``.shape`` (the global shape); ``None`` on a
    rank outside that side. Only the local shard and the global shape are read: the
    layouts are the meshes and placements given. A rank holding neither side still calls
    (it takes part in the agreement step) but, not knowing the dtype, does not vote on
    the batch fingerprint. Bad input raises on every rank of the group.

    ``agree=False`` (with one ``planner`` across calls) skips the agreement vote for
    calls that repeat the group's sequence, as ``xfer_batch`` describes; where a rank of
    the group lies outside both meshes it cannot tell one such call from another, so
    every call votes.
    """
    where = f"param {name!r} on rank {_group_rank(group)}"
    problem = None
    try:
        s, d = _unwrap(src, "src", where), _unwrap(dst, "dst", where)
    except ValueError as exc:
        s = d = None
        problem = Problem(0, str(exc))
    refs = [r for r in (s, d) if r is not None]
    if problem is None and len(refs) == 2 and s.global_shape != d.global_shape:
        problem = Problem(0, f"{where}: src and dst global shapes differ: expected the "
                          f"src's {s.global_shape} for dst as well, found {d.global_shape}")
    if refs:
        shape, dtype, described = refs[0].global_shape, refs[0].tensor.dtype, True
    else:
        # Outside both meshes: no bytes to move here; the shape only needs to be valid.
        shape, dtype, described = _placeholder_shape(src_placements, dst_placements), \
            torch.uint8, False
        if problem is None:
            problem = _member_without_tensors(src_mesh, src_placements, dst_mesh,
                                              dst_placements, group, where)
    t = Transfer(name, shape, dtype, src_mesh, list(src_placements), dst_mesh,
                 list(dst_placements), s.tensor if s is not None else None,
                 d.tensor if d is not None else None)
    agree = agree or _some_rank_outside(src_mesh, dst_mesh, group)  # alike on every rank
    run_batch([t], group, stream=stream, planner=planner, described=described,
              problem=problem, agree=agree)


def _group_rank(group) -> int:
    return resolve_group(group).rank()


def _some_rank_outside(src_mesh, dst_mesh, group) -> bool:
    """Whether a rank of ``group`` is in neither mesh (True where a mesh is unreadable:
    the call then votes, and the description step reports it)."""
    try:
        ranks = set(mesh_key(src_mesh)[1]) | set(mesh_key(dst_mesh)[1])
    except Exception:
        return True
    return not ranks.issuperset(range(resolve_group(group).size()))


class _Local(NamedTuple):
    tensor: torch.Tensor
    global_shape: tuple


def _unwrap(x, side: str, where: str) -> Optional[_Local]:
    """The local tensor and global shape of a DTensor, DTensorRef or look-alike; None."""
    if x is None:
        return None
    local, shape = getattr(x, "_local_tensor", None), getattr(x, "shape", None)
    if not isinstance(local, torch.Tensor) or shape is None:
        raise BadInputError(f"{where}: {side} must be a DTensor, a DTensorRef or an object with "
                         f"._local_tensor (a torch.Tensor) and .shape (the global shape), "
                         f"found {type(x).__name__}")
    return _Local(local, tuple(int(n) for n in shape))


def _member_without_tensors(src_mesh, src_placements, dst_mesh, dst_placements, group,
                            where: str) -> Optional[Problem]:
    """A rank of a mesh that passes neither tensor: its problem, whose message gives the
    expected local shape once the agreement step brings the global shape from its peers."""
    me = _group_rank(group)
    for side, mesh, placements in (("src", src_mesh, src_placements),
                                   ("dst", dst_mesh, dst_placements)):
        try:
            _, ranks = mesh_key(mesh)
        except Exception:
            return None  # the description step reports an unreadable mesh
        if me not in ranks:
            continue

        def message(shape, side=side) -> str:
            expected = "a local tensor (no rank of the group knows the global shape)"
            if shape is not None:
                try:
                    key = layout_key(shape, src_mesh, src_placements, dst_mesh,
                                     dst_placements, where)
                    mesh_of = ((key.src_mesh_shape, key.src_ranks, key.src_dims)
                               if side == "src" else
                               (key.dst_mesh_shape, key.dst_ranks, key.dst_dims))
                    own = shard_ownerships(key.global_shape, *mesh_of)[me]
                    expected = f"a local tensor of shape {own.local_shape}"
                except (ValueError, KeyError):
                    pass  # the layout's own error is voted by the ranks that know it
            return f"{where}: {side} missing on a {side} rank: expected {expected}, found None"

        return Problem(0, message)
    return None


def _placeholder_shape(*placement_lists: Sequence) -> tuple:
    ndim = 1
    for pl in placement_lists:
        for p in pl:
            d = getattr(p, "dim", None) if not isinstance(p, dict) else p.get("dim")
            if d is not None and d >= 0:
                ndim = max(ndim, d + 1)
    return (0,) * ndim
