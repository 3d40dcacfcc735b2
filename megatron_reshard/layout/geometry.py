"""Which part of a global tensor each rank owns, as boxes mapped onto local storage.

Torch + stdlib only, plain data throughout. A *box* is a tuple of half-open intervals
``((start, stop), ...)``, one per tensor dim, of the global tensor. A rank's ownership is
a set of *pieces*: each piece is a box plus where that box lives in the rank's local
tensor (per local dim: a start index and a step, so a box may map onto a strided view).

``Shard``/``Replicate`` placements on a mesh are the first producer of ownerships
(one piece per rank, the whole local tensor). Later producers (interleaved QKV: one piece
per KV group; vocab padding: a box shorter than the local tensor) build the same values.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.placements import BlockShard, PaddedShard

Box = tuple  # tuple[tuple[int, int], ...]
REPLICATE = -1  # plain form of Replicate() in a placement tuple


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(e - s for s, e in box)


def box_index(box: Box) -> tuple[slice, ...]:
    """The box as an index into the global tensor (``full[box_index(box)]``)."""
    return tuple(slice(a, b) for a, b in box)


def box_numel(box: Box) -> int:
    n = 1
    for s, e in box:
        n *= e - s
    return n


def box_intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or None when it is empty."""
    out = []
    for (s0, e0), (s1, e1) in zip(a, b):
        s, e = (s0 if s0 > s1 else s1), (e0 if e0 < e1 else e1)
        if s >= e:
            return None
        out.append((s, e))
    return tuple(out)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


class Piece(NamedTuple):
    """A box of the global tensor and where it lies in the local tensor.

    ``local[d] = (start, step)``: global index ``g`` of box dim ``d`` is local index
    ``start + (g - box[d][0]) * step`` of local dim ``d``.
    """

    box: Box
    local: tuple  # tuple[tuple[int, int], ...]

    def index(self, sub: Box) -> tuple:
        """Slices of the local tensor that hold ``sub`` (a box inside ``self.box``)."""
        idx = []
        for (s, e), (b0, _), (l0, step) in zip(sub, self.box, self.local):
            start = l0 + (s - b0) * step
            idx.append(slice(start, start + (e - s - 1) * step + 1, step))
        return tuple(idx)

    def view(self, local_tensor: torch.Tensor, sub: Box) -> torch.Tensor:
        return local_tensor[self.index(sub)]


class Ownership(NamedTuple):
    """What one rank holds: its local tensor shape and the (non-empty) pieces in it.

    ``boxes`` repeats the pieces' boxes in piece order (the key for grouping replicas);
    build values with ``Ownership.of`` to have it filled in.
    """

    local_shape: tuple
    pieces: tuple  # tuple[Piece, ...]
    boxes: tuple

    @classmethod
    def of(cls, local_shape: Sequence[int], pieces: Sequence[Piece]) -> "Ownership":
        return cls(tuple(local_shape), tuple(pieces), tuple(p.box for p in pieces))


def placement_dims(placements: Sequence, ndim: int, where: str = "placements") -> tuple[int, ...]:
    """Placements as plain data (shard dim, ``(dim, padded size)``, ``(dim, block sizes)``
    or REPLICATE).

    Accepts torch ``Shard``/``Replicate``, ``PaddedShard``, ``BlockShard`` and their wire
    forms ``{"dim": d}`` / ``{"dim": d, "padded": n}`` / ``{"dim": d, "blocks": [..]}`` /
    ``{}``; negative dims are normalised. Raises ValueError for anything else or a shard
    dim outside the tensor.
    """
    out = []
    for p in placements:
        padded = None  # an int (padded size) or a tuple (block sizes)
        if isinstance(p, BlockShard):
            d, padded = int(p.dim), tuple(p.sizes)
        elif isinstance(p, PaddedShard):
            d, padded = int(p.dim), int(p.padded_size)
        elif isinstance(p, Shard):
            d = int(p.dim)
        elif isinstance(p, Replicate):
            out.append(REPLICATE)
            continue
        elif isinstance(p, dict):
            if "dim" not in p:
                out.append(REPLICATE)
                continue
            d = int(p["dim"])
            padded = None if p.get("padded") is None else int(p["padded"])
            if p.get("blocks") is not None:
                padded = tuple(int(n) for n in p["blocks"])
        else:
            raise BadInputError(f"{where}: unsupported placement {p!r} (only Shard, PaddedShard, "
                             "BlockShard and Replicate)")
        if not -ndim <= d < ndim:
            raise BadInputError(f"{where}: invalid shard dim: Shard({d}) on a tensor of {ndim} "
                             f"dims (expected a dim in [{-ndim}, {ndim}))")
        out.append(d % ndim if padded is None else (d % ndim, padded))
    dims = [e[0] if isinstance(e, tuple) else e for e in out]
    for e in out:
        if isinstance(e, tuple) and dims.count(e[0]) > 1:
            raise BadInputError(f"{where}: a padded or block shard of dim {e[0]} must be the only "
                             f"placement sharding that dim, found {list(placements)}")
    return tuple(out)


@lru_cache(maxsize=1024)  # pure function of plain data
def mesh_coords(mesh_shape: Sequence[int], ranks: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """rank -> row-major coordinate in a mesh of ``mesh_shape`` listing ``ranks`` in order."""
    coords = {}
    for flat, r in enumerate(ranks):
        c = []
        for n in reversed(mesh_shape):
            c.append(flat % n)
            flat //= n
        coords[r] = tuple(reversed(c))
    return coords


def shard_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              dims: Sequence[int]) -> Box:
    """The box a mesh coordinate owns under Shard/Replicate placements (DTensor rules).

    Mesh axes apply in axis order; an axis that shards dim ``d`` splits the interval left
    by earlier axes with ``torch.chunk`` rules: chunk = ceil(n / m), trailing chunks short
    or empty.
    """
    lo = [0] * len(global_shape)
    hi = list(global_shape)
    for axis, d in enumerate(dims):
        if isinstance(d, tuple) and isinstance(d[1], tuple):  # block shard: explicit sizes
            d, sizes = d
            if len(sizes) != mesh_shape[axis] or sum(sizes) != global_shape[d]:
                raise BadInputError(f"block shard of dim {d}: {len(sizes)} block sizes {list(sizes)} "
                                 f"for a mesh axis of {mesh_shape[axis]} and a dim of "
                                 f"{global_shape[d]}: expected one size per coordinate, adding "
                                 f"up to the dim")
            lo[d] = sum(sizes[:coord[axis]])
            hi[d] = lo[d] + sizes[coord[axis]]
            continue
        if isinstance(d, tuple):  # padded shard: equal chunks of the padded size, clipped
            d, padded = d
            chunk = _padded_chunk(global_shape[d], padded, mesh_shape[axis])
            lo[d] = min(coord[axis] * chunk, global_shape[d])
            hi[d] = min(lo[d] + chunk, global_shape[d])
            continue
        if d < 0:
            continue
        n = hi[d] - lo[d]
        chunk = -(-n // mesh_shape[axis])
        s = coord[axis] * chunk
        if s > n:
            s = n
        e = s + chunk
        if e > n:
            e = n
        hi[d] = lo[d] + e
        lo[d] += s
    return tuple(zip(lo, hi))


def _padded_chunk(size: int, padded: int, parts: int) -> int:
    if padded < size or padded % parts:
        raise BadInputError(f"padded shard: padded size {padded} must be >= the real size {size} "
                         f"and divisible by the mesh axis size {parts}")
    return padded // parts


def local_shape_of(global_shape: Sequence[int], mesh_shape: Sequence[int], box: Box,
                   dims: Sequence) -> tuple[int, ...]:
    """Shape of the local tensor that holds ``box``: the box, except that a padded dim has
    its full chunk (the padding rows sit after the owned ones)."""
    shape = list(box_shape(box))
    for axis, d in enumerate(dims):
        if isinstance(d, tuple) and not isinstance(d[1], tuple):
            shape[d[0]] = _padded_chunk(global_shape[d[0]], d[1], mesh_shape[axis])
    return tuple(shape)


def rank_region(global_shape: Sequence[int], mesh, placements: Sequence, rank: int
                ) -> Optional[tuple[Box, tuple[int, ...]]]:
    """(box of the global tensor, local tensor shape) of ``rank`` on ``mesh``; None if absent."""
    coord = mesh.coordinate_of(rank)
    if coord is None:
        return None
    if len(placements) != mesh.ndim:
        raise BadInputError(f"{len(placements)} placements for a {mesh.ndim}-D mesh {mesh!r}")
    shape = tuple(int(n) for n in global_shape)
    dims = placement_dims(placements, len(shape))
    box = shard_box(shape, mesh.shape, coord, dims)
    return box, local_shape_of(shape, mesh.shape, box, dims)


def rank_box(global_shape: Sequence[int], mesh, placements: Sequence, rank: int
             ) -> Optional[Box]:
    """The box of the global tensor that ``rank`` holds on ``mesh``; None if not in the mesh.

    DTensor semantics: mesh axes that shard one tensor dim apply in axis order, each with
    ``torch.chunk`` rules; a ``PaddedShard`` splits its padded size evenly and clips at the
    real size.
    """
    got = rank_region(global_shape, mesh, placements, rank)
    if got is None:
        return None
    box, _local_shape = got
    return box


def shard_ownerships(global_shape: Sequence[int], mesh_shape: Sequence[int],
                     ranks: Sequence[int], dims: Sequence[int]) -> dict[int, Ownership]:
    """rank -> Ownership for every rank of a mesh under Shard/Replicate placements."""
    ownerships = {}
    identity = ((0, 1),) * len(global_shape)
    shape = tuple(int(n) for n in global_shape)
    made: dict = {}  # replicas share one Ownership value
    for r, coord in mesh_coords(mesh_shape, ranks).items():
        box = shard_box(shape, mesh_shape, coord, dims)
        own = made.get(box)
        if own is None:
            local_shape = local_shape_of(shape, mesh_shape, box, dims)
            pieces = (Piece(box, identity),) if box_numel(box) else ()
            own = made[box] = Ownership(local_shape, pieces, (box,) if pieces else ())
        ownerships[r] = own
    return ownerships
