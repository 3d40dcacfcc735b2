"""A repeated call's fast lane: the call that went through last, matched in one C++ pass.

A refit loop calls the same batch with the same tensors again and again (``agree=False``
from its second refit on). The warm path still derives, per call, what the last call
derived already: the local checks' verdict (shapes, dtypes, devices, types), the program
key (strides), and the kept copies' addresses (``program.py``). On one H200 that host
work ran before the first copy of every call: ~35 µs for one tensor, ~85 µs for a rank's
128 experts given as a list, against copies of ~0.2-0.3 ms (docs/MEASUREMENTS.md).

A ``Lane`` keeps, per batch, what the last call that skipped its vote was given: one
torch ``TensorGuards`` (torch.compile's C++ check of tensor metadata, members.py) built
from every tensor it held, every member of its lists and the storage and term tables of
its permuted-row destinations, in order, the places of its ``None``s and lists (and the
boxes' scalars), and, where its program is local copies only, every tensor's address and
the kept batch of copies. A call that matches all of it (same types, shapes, strides,
dtypes, devices, dispatch keys and ``requires_grad``, same addresses) would pass every
check and resolve to the same program and the same views: it runs them at once. Any
difference misses the lane and takes the full path, whose checks raise the usual errors
(a miss costs one guard check; the lane is rebuilt once such a call goes through).
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_
from typing import NamedTuple, Optional

import torch

from megatron_reshard.layout.permuted_rows import PermutedRows
from .members import LISTS, tensor_guards

_NOT_TENSORS = LISTS | {PermutedRows}

_SRC, _DST = attrgetter("src"), attrgetter("dst")
_DATA_PTR = torch.Tensor.data_ptr


def call_tensors(transfers) -> list:
    """The call's tensors, two per transfer (src, dst), as ``checks.local_ok`` lists them."""
    tensors = [None] * (2 * len(transfers))
    tensors[0::2] = map(_SRC, transfers)
    tensors[1::2] = map(_DST, transfers)
    return tensors


def _flatten(held) -> tuple[list, list]:
    """``held`` with every list's members in its place and every permuted-row destination's
    storage and term tables in its place, and per held item what else must match: a
    list's length, a permuted-row box's scalars, -1 for a tensor (a loop: ~5x faster
    than chaining for the few items a call holds)."""
    flat, structure = [], []
    for x in held:
        kind = type(x)
        if kind in LISTS:
            flat += x
            structure.append(len(x))
        elif kind is PermutedRows:  # as its key(): addresses, sizes (the guard) and these
            flat += (x.storage, x.outer, x.inner)
            structure.append((x.first, x.width, x.apart, x.cols))
        else:
            flat.append(x)
            structure.append(-1)
    return flat, structure


class Lane(NamedTuple):
    """What a batch's last skipped call was given, and what it ran (see the module doc)."""

    guard: object              # TensorGuards of the flat tensors (held, members in place)
    structure: Optional[list]  # per held item, what _flatten says must match; None:
                               # tensors only
    sched: object              # the batch's schedule it ran under
    program: object            # the program it ran (for the strides the guard holds)
    device: torch.device
    addresses: Optional[tuple]  # local copies only: data_ptr of each flat tensor
    copies: object             # local copies only: the program's kept batch it ran

    def flat(self, tensors: list, expect) -> Optional[list]:
        """The flat tensors of a call whose ``tensors`` match the lane's (None: a miss)."""
        held = expect.held(tensors)
        absent = expect.absent(tensors)
        if absent and not all(map(is_, absent, repeat(None))):
            return None
        if self.structure is None:
            flat = held
        else:
            flat, structure = _flatten(held)
            if structure != self.structure:
                return None
        try:
            return flat if self.guard.check(*flat) else None
        except Exception:  # noqa: BLE001 - an object the guard cannot read: a miss
            return None

    def same_copies(self, flat) -> bool:
        """Whether the kept copies it ran are the program's still, for these addresses."""
        kept = self.program.kept_local()
        return (kept is self.copies and kept is not None
                and tuple(map(_DATA_PTR, flat)) == self.addresses)


def lane_for(tensors: list, expect, sched, program, device,
             old: Optional[Lane] = None) -> Optional[Lane]:
    """The lane of a call that went through with ``tensors`` (checked) and ran
    ``program``, or None where a held object is no tensor, list of them or permuted-row
    box, or this torch has no usable guard. ``old``: the lane of the same program, whose
    guard is reused where it matches these tensors (only addresses changed)."""
    guards = tensor_guards()
    if guards is None:
        return None
    held = expect.held(tensors)
    types = set(map(type, held))
    structure = None
    if types.isdisjoint(_NOT_TENSORS):
        flat = list(held)
    else:
        flat, structure = _flatten(held)
        types = set(map(type, flat))
    if not flat or not all(issubclass(k, torch.Tensor) for k in types):
        return None
    if (old is not None and old.structure == structure
            and old.flat(tensors, expect) is not None):
        guard = old.guard
    else:
        try:
            guard = guards(*flat, dynamic_dims_sizes=[list(x.shape) for x in flat],
                           dynamic_dims_strides=[list(x.stride()) for x in flat])
            if not guard.check(*flat):
                return None
        except Exception:  # noqa: BLE001 - no lane, the full path
            return None
    copies = program.kept_local()
    addresses = tuple(map(_DATA_PTR, flat)) if copies is not None else None
    return Lane(guard, structure, sched, program, device, addresses, copies)
