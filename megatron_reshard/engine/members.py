"""A local shard held as many tensors, one per index of its dim 0 (a rank's experts).

A training rank keeps each expert's weight as its own tensor, while the global HF param
stacks them (``[E, ...]``). Stacking them for the transfer would copy the whole projection
(hundreds of MiB), so a ``Transfer`` may give, for either side, a list (or tuple) of
tensors instead of one: member ``e`` holds index ``e`` of the local shard's dim 0 and has
the local shape without that dim. The schedule is unchanged (it is plain data, alike on
every rank); the rank's program cuts each box it reads or writes into one box per index
of dim 0 and views the members, which are appended to the call's tensor list
(``with_members``) so that every copy names its tensor by index as usual. A list counts
as a non-standard tensor in the agreement's stride vote, so no message is sent straight
from it unless its box lies in one member.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter
from typing import NamedTuple, Optional

import torch

from megatron_reshard.layout.geometry import box_numel

from megatron_reshard.layout.permuted_rows import PermutedRows


def is_members(x) -> bool:
    return isinstance(x, (list, tuple))


def stride_key(x) -> Optional[tuple]:
    """What a program's cache key records of a tensor: its stride, or its members', or
    that it is a destination in a kernel's permuted-row order (``kernel_copies``)."""
    if x is None:
        return None
    if is_members(x):
        return ("members",) + tuple(map(torch.Tensor.stride, x))
    if isinstance(x, PermutedRows):
        return ("rows",)
    return x.stride()


LISTS = frozenset((list, tuple))
_NOT_TENSORS = LISTS | {PermutedRows}


def stride_keys(tensors: list, known: Optional[dict] = None) -> tuple:
    """What a program's cache key records of the call's tensors (``stride_key`` of each).
    Without lists or permuted rows among them, only the strides of the tensors held,
    mapped in C: within one batch the places of None are fixed (the local checks passed),
    and a key with a "members" or "rows" entry differs from any of these. ``known``:
    id of a list -> its key, found by this call's checks (``KnownMembers``)."""
    if not _NOT_TENSORS.isdisjoint(map(type, tensors)):
        if known:
            return tuple([known[id(x)] if id(x) in known else stride_key(x)
                          for x in tensors])
        return tuple([stride_key(x) for x in tensors])
    return tuple(map(torch.Tensor.stride, [x for x in tensors if x is not None]))


def any_members(items) -> bool:
    """Whether any item is a list of members (the types mapped in C, no call per item)."""
    return not LISTS.isdisjoint(map(type, items))


def with_members(tensors: list) -> list:
    """The call's tensors followed by the members of every list among them, in order
    (the order ``Program`` numbers them in)."""
    if not any_members(tensors):
        return tensors
    return tensors + list(chain.from_iterable([x for x in tensors if type(x) in LISTS]))


def unit_boxes(box: tuple) -> list:
    """``box`` cut into one box per index of its dim 0."""
    (s, e), rest = box[0], box[1:]
    return [((g, g + 1),) + rest for g in range(s, e)]


def local_shape(x) -> tuple:
    """The local shard's shape of a list of members (``(len, *member shape)``)."""
    return (len(x), *x[0].shape) if len(x) else (0,)


_SHAPE, _DTYPE, _DEVICE = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")


def members_problem(x, shape: tuple, dtype: torch.dtype, device_type: str) -> Optional[str]:
    """Why a list of members cannot be the local shard of ``shape`` (None: it can). Every
    call checks every member: the usual answer (none) is found by attribute getters mapped
    in C (a rank's 128 experts: ~0.1 ms of Python per call otherwise), the reason by the
    loop below."""
    n = len(x)
    if (n and shape and n == shape[0] and all(map(isinstance, x, repeat(torch.Tensor)))
            and x[0].device.type == device_type
            and list(map(_SHAPE, x)) == [torch.Size(shape[1:])] * n
            and list(map(_DTYPE, x)) == [dtype] * n
            and list(map(_DEVICE, x)) == [x[0].device] * n):
        return None
    if not all(isinstance(m, torch.Tensor) for m in x):
        return f"a list of torch.Tensor members, found {[type(m).__name__ for m in x]}"
    if len(x) != (shape[0] if shape else -1):
        return (f"{shape[0] if shape else 'no'} members (one per index of dim 0 of the local "
                f"shape {shape}), found {len(x)}")
    for e, m in enumerate(x):
        if tuple(m.shape) != tuple(shape[1:]) or m.dtype != dtype:
            return (f"member {e} of shape {tuple(shape[1:])} and dtype {dtype}, found "
                    f"{tuple(m.shape)} {m.dtype}")
        if m.device.type != device_type or m.device != x[0].device:
            return f"members on one {device_type} device, found member {e} on {m.device}"
    return None


class KnownMembers(NamedTuple):
    """A list of members that passed ``members_problem`` once, and what the checks derived
    from it. A later list ``matches`` when its length and every member's Python type,
    dtype, device, shape, strides, dispatch keys and requires_grad equal those seen then:
    everything ``members_problem`` and ``stride_key`` read, so the verdict (none), the
    device and the stride key carry over. Addresses are not in it: a kept batch of copies
    compares them on every call (program.py)."""

    guard: object          # torch's compiled tensor-metadata check, built from the members
    n: int
    device: torch.device
    key: tuple             # stride_key of the list

    def matches(self, x) -> bool:
        try:
            return len(x) == self.n and self.guard.check(*x)
        except Exception:  # a member of a type the guard cannot read: the full checks
            return False


def known_members(x) -> Optional[KnownMembers]:
    """``KnownMembers`` of a list that passed ``members_problem`` (None where this torch
    has no usable guard: every call then checks each member in Python)."""
    guards = tensor_guards()
    if guards is None or not len(x):
        return None
    try:
        guard = _guard(guards, x)
    except Exception:
        return None
    return KnownMembers(guard, len(x), x[0].device, stride_key(x)) if guard.check(*x) else None


def _guard(guards, x):
    return guards(*x, dynamic_dims_sizes=[list(m.shape) for m in x],
                  dynamic_dims_strides=[list(m.stride()) for m in x])


# [TensorGuards or None], decided at the first use. Kept for the process: whether torch's
# private class is there and checks what it must is a fact of the torch build, which does
# not change while the process runs; one entry, no bound needed
_GUARDS: list = []


def tensor_guards():
    """torch's ``TensorGuards`` (torch.compile's check of tensor metadata, in C++: ~0.1 µs
    a member against ~0.3 µs for ``members_problem``'s getters), or None. It is a private
    class: used only after it is seen, here, to accept the same metadata and to refuse a
    changed shape, stride, dtype, device, type and a re-pointed ``.data``."""
    if not _GUARDS:
        _GUARDS.append(_probe_guards())
    return _GUARDS[0]


def _probe_guards():
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:
        return None
    try:
        with torch.inference_mode(False):  # a first use in inference mode decides alike
            return _probed(TensorGuards)
    except Exception:
        return None


def _probed(TensorGuards):
    """``TensorGuards`` if a guard of two [2, 4] bf16 tensors accepts them and refuses,
    in the second place, each change the checks read; else None."""
    bf16 = torch.bfloat16
    base = [torch.zeros(2, 4, dtype=bf16), torch.zeros(2, 4, dtype=bf16)]
    guard = _guard(TensorGuards, base)
    moved = torch.zeros(2, 4, dtype=bf16)
    moved.data = torch.zeros(4, 2, dtype=bf16).t()
    changed = [torch.zeros(4, 2, dtype=bf16).t(), torch.zeros(2, 4), torch.zeros(2, 2, dtype=bf16),
               moved, torch.zeros(2, 4, dtype=bf16, device="meta"),
               torch.nn.Parameter(torch.zeros(2, 4, dtype=bf16)), None]
    if not guard.check(*base) or any(guard.check(base[0], c) for c in changed):
        return None
    return TensorGuards


def per_member_segments(sg, members: bool, itemsize: int) -> list:
    """A segment as it is, or (its tensor a list of members) one per index of dim 0:
    the segment's bytes are row-major, so each one's follow the previous one's."""
    if not members or sg.box[0][1] - sg.box[0][0] == 1:
        return [sg]
    boxes = unit_boxes(sg.box)
    unit = box_numel(boxes[0]) * itemsize
    return [sg._replace(box=b, offset=sg.offset + j * unit, nbytes=unit)
            for j, b in enumerate(boxes)]
