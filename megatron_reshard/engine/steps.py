"""The plain-data steps of a rank's program: local copies, staged segments, posts, rounds.

Tensors are numbered ``k = 2 * ti + side`` (side 0: src, 1: dst), as in the call's
``tensors`` list (members of lists after them, see members.py). Every record here is
built once per program (``resolve.py``) and read by name on every call (``program.py``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .copies import FlatRef, Strided, TypedRef


class LocalStep(NamedTuple):
    """A local copy: as bytes (``flat``: FlatRefs) or as typed views (TypedRefs)."""

    flat: bool
    dst: tuple
    src: tuple
    nbytes: int
    words: int
    skew: int        # the bits of both views' byte offsets in their tensors (OR-ed)


class StagedSegment(NamedTuple):
    """A segment copied into (pack) or out of (unpack) a round's staging buffer."""

    offset: int       # in the buffer
    nbytes: int
    dtype: torch.dtype            # the transfer's
    shape: Optional[tuple]        # typed segments: the buffer side's shape
    flat: bool
    ref: tuple        # the tensor side: FlatRef or TypedRef
    words: int        # the buffer side is contiguous: words whenever the tensor's are


class FlatCopy(NamedTuple):
    """Piece ``piece`` of the staging buffer and the bytes of a contiguous view."""

    piece: int
    ref: FlatRef
    nbytes: int


class TypedCopy(NamedTuple):
    """Piece ``piece`` of the staging buffer, seen as ``dtype`` of ``shape``, and a typed
    view; ``skew``: the view's byte offset in its tensor (for the word decision)."""

    piece: int
    dtype: torch.dtype
    shape: tuple
    ref: TypedRef
    words: int
    skew: int


class StagePlan(NamedTuple):
    """A round's segments of one direction (pack or unpack), ready to copy: the buffer is
    cut into pieces by one ``split_with_sizes`` call (gaps and the other direction's bytes
    are pieces too), and each copy pairs a piece with a view of a tensor."""

    nbytes: int      # the buffer bytes the sizes cover
    sizes: tuple     # piece sizes, in buffer order
    flat: tuple      # tuple[FlatCopy, ...]: byte copies
    typed: tuple     # tuple[TypedCopy, ...]: typed copies
    whole: bool      # byte copies only, back to back from offset 0 to ``nbytes``
    # Every copy a whole 1-D tensor of one dtype: the buffer is cut in that dtype
    # (``elements``: the sizes in elements) and the tensors are copied as they are, with
    # no per-tensor byte view (~0.6 µs each on the host).
    dtype: Optional[torch.dtype]
    elements: Optional[tuple]
    ks: tuple        # ``elements`` set: the tensors' k, in the order of ``flat``


def stage_plan(segs: list, total: int) -> Optional[StagePlan]:
    """The StagePlan of ``segs`` (StagedSegments in buffer order) in a buffer of ``total``
    bytes; None when there are none."""
    if not segs:
        return None
    sizes, flat, typed, cursor = [], [], [], 0
    for seg in segs:
        if seg.offset > cursor:
            sizes.append(seg.offset - cursor)
        sizes.append(seg.nbytes)
        cursor = seg.offset + seg.nbytes
        piece = len(sizes) - 1
        if seg.flat:
            flat.append(FlatCopy(piece, seg.ref, seg.nbytes))
        else:
            # (a permuted-row destination's ref holds slices: no offset, no words)
            skew = 0 if not isinstance(seg.ref.view, Strided) else \
                seg.ref.view.delta * seg.dtype.itemsize
            typed.append(TypedCopy(piece, seg.dtype, seg.shape, seg.ref, seg.words, skew))
    if cursor < total:
        sizes.append(total - cursor)
    whole = not typed and len(flat) == len(sizes)
    dtypes = {seg.dtype for seg in segs}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    elements, ks = None, ()
    if (dtype is not None and not typed and all(c.ref.numel is None for c in flat)
            and all(n % dtype.itemsize == 0 for n in (total, *sizes))):
        elements = tuple(n // dtype.itemsize for n in sizes)
        ks = tuple(c.ref.k for c in flat)
    return StagePlan(total, tuple(sizes), tuple(flat), tuple(typed), whole, dtype, elements,
                     ks)


class Post(NamedTuple):
    """A send or receive of a round: from/to the tensor (``ref``) or the buffer."""

    is_send: bool
    peer: int
    tag: int
    ref: Optional[FlatRef]  # None: ``nbytes`` of the staging buffer from ``offset``
    offset: int
    nbytes: int


class RoundProgram(NamedTuple):
    phase: int
    nbytes: int      # staging buffer bytes
    posts: tuple     # tuple[Post, ...]
    packs: Optional[StagePlan]    # None: nothing to pack
    unpacks: Optional[StagePlan]
