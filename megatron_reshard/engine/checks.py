"""Local checks of a call: its layouts (meshes against the group) and this rank's tensors.

Nothing here raises at the caller: a check returns the rank's first ``Problem``, which the
agreement step (``agree.py``) turns into an error on every rank of the group before any
data moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from megatron_reshard.layout.permuted_rows import PermutedRows
from .members import LISTS, is_members, known_members, members_problem

from megatron_reshard.errors import BadInputError


@dataclass(frozen=True)
class Problem:
    """A rank's first problem with a call: which transfer (None: the call as a whole) and
    what. ``message`` may need the global shape, which a rank given no tensors learns
    only from its peers' votes: it is then a function of that shape (None: unknown)."""

    index: Optional[int]
    message: Union[str, Callable[[Optional[tuple]], str]]

    def text(self, agreed_shape: Optional[tuple] = None) -> str:
        return self.message if isinstance(self.message, str) else self.message(agreed_shape)


def check_mesh_ranks(side: str, mesh_shape: tuple, ranks: Sequence[int], world: int,
                     where: str) -> None:
    """A mesh's ranks must be distinct ranks of the group, whatever object carried them
    (MeshInfo, a rank tensor, a DeviceMesh-like ``.mesh``): raises ValueError otherwise."""
    expected = f"expected distinct ranks in [0, {world}) (group size {world})"
    bad = sorted({r for r in ranks if r < 0 or r >= world})
    if bad:
        raise BadInputError(f"{where}: {side} mesh has ranks outside the group: {expected}, "
                         f"found {bad} in mesh {list(ranks)} of shape {mesh_shape}")
    seen, dup = set(), []
    for r in ranks:
        if r in seen and r not in dup:
            dup.append(r)
        seen.add(r)
    if dup:
        raise BadInputError(f"{where}: {side} mesh has duplicate ranks: {expected}, found "
                         f"{dup} more than once in mesh {list(ranks)} of shape {mesh_shape}")


def check_layout_ranks(key: tuple, world: int, where: str) -> None:
    """Both meshes of a layout key checked with ``check_mesh_ranks``."""
    _, src_shape, src_ranks, _, dst_shape, dst_ranks, _ = key
    check_mesh_ranks("src", src_shape, src_ranks, world, where)
    check_mesh_ranks("dst", dst_shape, dst_ranks, world, where)


def describe_tensor(t) -> str:
    return "None" if t is None else (f"tensor{tuple(t.shape)} {t.dtype} on {t.device}"
                                     if isinstance(t, torch.Tensor) else repr(type(t)))


def check_local(transfers, plans, me: int, device_type: str, permuted_dst: bool = False
                ) -> tuple[Optional[Problem], Optional[torch.device]]:
    """This rank's first problem with its tensors (side membership, shape, dtype, device),
    and the device of its tensors. ``permuted_dst``: a destination may also be a
    ``layout.permuted_rows.PermutedRows`` (the colocated transport writes those)."""
    device = None
    for i, (t, plan) in enumerate(zip(transfers, plans)):
        for side, tensor, owns in (("src", t.src, plan.src), ("dst", t.dst, plan.dst)):
            own = owns.get(me)
            where = f"param {t.name!r} on rank {me}"
            if own is None and tensor is not None:
                return Problem(i, f"{where}: {side} given on a non-{side} rank (rank {me} is "
                               f"not in the {side} mesh {sorted(owns)}): expected None, "
                               f"found {describe_tensor(tensor)}"), device
            if own is None:
                continue
            if tensor is None:
                return Problem(i, f"{where}: {side} missing on a {side} rank: expected a "
                               f"local tensor of shape {own.local_shape}, found None"), device
            if is_members(tensor):  # one tensor per index of dim 0 (members.py)
                why = members_problem(tensor, own.local_shape, t.dtype, device_type)
                if why is not None:
                    return Problem(i, f"{where}: wrong {side} members: expected {why}"), device
                if device is None and len(tensor):
                    device = tensor[0].device
                elif len(tensor) and tensor[0].device != device:
                    return Problem(i, f"{where}: wrong {side} device: expected {device} (as "
                                   f"the batch's other tensors on this rank), found "
                                   f"{tensor[0].device}"), device
                continue
            permuted = permuted_dst and side == "dst" and isinstance(tensor, PermutedRows)
            if not isinstance(tensor, torch.Tensor) and not permuted:
                return Problem(i, f"{where}: {side} must be a torch.Tensor or a list of "
                               f"them, found {type(tensor)}"), device
            if tuple(tensor.shape) != own.local_shape:
                return Problem(i, f"{where}: wrong local {side} shape: expected "
                               f"{own.local_shape}, found {tuple(tensor.shape)}"), device
            if tensor.dtype != t.dtype:
                return Problem(i, f"{where}: wrong {side} dtype: expected {t.dtype}, found "
                               f"{tensor.dtype}"), device
            if tensor.device.type != device_type:
                return Problem(i, f"{where}: wrong {side} device for this group's backend: "
                               f"expected a {device_type} tensor, found {tensor.device}"), device
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                return Problem(i, f"{where}: wrong {side} device: expected {device} (as the "
                               f"batch's other tensors on this rank), found "
                               f"{tensor.device}"), device
    return None, device


def picker(ks: Sequence[int]) -> Callable[[Sequence], tuple]:
    """``f(items) -> tuple(items[k] for k in ks)``, gathered in C (``itemgetter``)."""
    if len(ks) > 1:
        return itemgetter(*ks)
    if ks:
        k = ks[0]
        return lambda items: (items[k],)
    return lambda items: ()


class Expected(NamedTuple):
    """What this rank's tensors of a batch must be (``local_ok``), in the order of the
    call's ``tensors`` (src, dst per transfer)."""

    held: Callable[[Sequence], tuple]    # picks the tensors this rank must hold
    absent: Callable[[Sequence], tuple]  # picks those it must not (None)
    shapes: list                         # local shape of each held tensor
    dtypes: list                         # its dtype
    members: dict                        # place in held -> KnownMembers of the last list there
    dsts: frozenset                      # places in held of destinations (permuted rows)


def expected(shapes: list, dtypes: list) -> Expected:
    """``Expected`` from per-tensor shapes and dtypes (None: no tensor there)."""
    held = [k for k, shape in enumerate(shapes) if shape is not None]
    return Expected(picker(held), picker([k for k, s in enumerate(shapes) if s is None]),
                    [shapes[k] for k in held], [dtypes[k] for k in held], {},
                    frozenset(j for j, k in enumerate(held) if k % 2))


_SRC, _DST = attrgetter("src"), attrgetter("dst")
_LISTS_OR_ROWS = LISTS | {PermutedRows}
_SHAPE, _DTYPE, _IS_CPU, _DEVICE = (attrgetter("shape"), attrgetter("dtype"),
                                    attrgetter("is_cpu"), attrgetter("device"))


def local_ok(transfers, expect: Expected, device_type: str, tensors: list,
             member_keys: Optional[dict] = None) -> tuple[bool, Optional[torch.device]]:
    """Fast form of ``check_local``'s verdict and device (same checks, no messages): each
    check one pass in C (``map`` of an attribute getter, compared as lists). ``tensors``:
    this rank's tensors are appended to it, two per transfer (src, dst). Lists of members
    are checked against the last list that passed at their place (``KnownMembers``; their
    stride keys go into ``member_keys``, by id of the list)."""
    start = len(tensors)
    tensors += [None] * (2 * len(transfers))
    tensors[start::2] = map(_SRC, transfers)
    tensors[start + 1::2] = map(_DST, transfers)
    mine = tensors[start:]
    held, absent = expect.held(mine), expect.absent(mine)
    if absent and set(map(type, absent)) != {type(None)}:
        return False, None
    types = set(map(type, held))
    if not all(issubclass(k, torch.Tensor) for k in types):
        if types.isdisjoint(_LISTS_OR_ROWS):
            return False, None  # a None or another object: check_local names it
        return _with_members(held, expect, device_type, member_keys)
    if list(map(_SHAPE, held)) != expect.shapes or list(map(_DTYPE, held)) != expect.dtypes:
        return False, None
    if not held:
        return True, None
    if device_type == "cpu":  # one CPU device: no device objects to compare
        return all(map(_IS_CPU, held)), held[0].device
    devices = set(map(_DEVICE, held))
    device = devices.pop()
    return not devices and device.type == device_type, device


def _with_members(held: tuple, expect: Expected, device_type: str,
                  member_keys: Optional[dict]) -> tuple[bool, Optional[torch.device]]:
    """``local_ok`` where lists of members or destinations in permuted-row order are held:
    each list matched against the ``KnownMembers`` of its place (one C++ pass over its
    members) or checked in full and remembered; a permuted-row destination by its shape,
    dtype and device, as ``check_local`` checks it; the tensors as ``local_ok`` does.
    False: ``check_local`` decides."""
    devices, rest, shapes, dtypes = set(), [], [], []
    for j, x in enumerate(held):
        if type(x) is PermutedRows:
            if (j not in expect.dsts or tuple(x.shape) != expect.shapes[j]
                    or x.dtype != expect.dtypes[j]):
                return False, None
            devices.add(x.device)
            continue
        if type(x) not in LISTS:
            rest.append(x)
            shapes.append(expect.shapes[j])
            dtypes.append(expect.dtypes[j])
            continue
        known = expect.members.get(j)
        if known is None or not known.matches(x):
            if members_problem(x, expect.shapes[j], expect.dtypes[j], device_type) is not None:
                return False, None
            known = known_members(x)
            if known is None:
                expect.members.pop(j, None)
                return False, None  # no guard for it here: check_local checks it
            expect.members[j] = known
        devices.add(known.device)
        if member_keys is not None:
            member_keys[id(x)] = known.key
    if not all(isinstance(x, torch.Tensor) for x in rest):
        return False, None
    if list(map(_SHAPE, rest)) != shapes or list(map(_DTYPE, rest)) != dtypes:
        return False, None
    devices.update(map(_DEVICE, rest))
    if len(devices) != 1:
        return False, None
    device = devices.pop()
    return device.type == device_type, device
