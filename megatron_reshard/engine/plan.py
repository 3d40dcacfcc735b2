"""The plan cache of one refit session (``Planner``) and the layout keys it is indexed by.

A plan (``param_plan.build_plan``) depends only on the layout key ``(global_shape, src
mesh, src placements, dst mesh, dst placements)`` as plain tuples, never on tensors, so
every rank computes the same plan and the same op order; the ``Planner`` builds each
plan once, proves it (``plan_check``) and also keeps the per-batch state the engine
reuses from call to call (see ``Planner``).
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.layout.geometry import placement_dims
from .link_costs import LinkCosts
from .param_plan import LayoutKey, ParamPlan, build_plan
from .plan_check import check_writes_exactly_once
from .sequence import CallSequence


def layout_key(global_shape: Sequence[int], src_mesh, src_placements, dst_mesh,
               dst_placements, where: str = "xfer") -> LayoutKey:
    """Plain-data key of a layout pair; validates placements against shape and meshes."""
    shape = tuple(int(n) for n in global_shape)
    if any(n < 0 for n in shape):
        raise BadInputError(f"{where}: global_shape must be non-negative, found {shape}")
    parts = []
    for side, mesh, placements in (("src", src_mesh, src_placements),
                                   ("dst", dst_mesh, dst_placements)):
        mshape, ranks = mesh_key(mesh)
        if len(placements) != len(mshape):
            raise BadInputError(f"{where}: {side} placement count != mesh ndim: expected "
                             f"{len(mshape)} placements for mesh shape {mshape}, found "
                             f"{len(placements)} ({list(placements)})")
        parts += [mshape, ranks, placement_dims(placements, len(shape), f"{where}: {side}")]
    return LayoutKey(shape, *parts)


def mesh_key(mesh) -> tuple:
    """A mesh as plain data: (its shape, its ranks in row-major order)."""
    if hasattr(mesh, "key"):
        return mesh.key()
    t = mesh.mesh if hasattr(mesh, "mesh") else mesh
    return (tuple(t.shape), tuple(int(r) for r in t.flatten().tolist()))


@contextmanager
def gc_paused():
    """Pause Python's cyclic GC inside: the engine allocates many small acyclic tuples
    (plans, batch keys, views), and the GC passes they trigger walk every object the
    caches hold: ~40% of cold planning time, and ~90 ms of a warm 10,000-param lookup that
    takes 10 ms without them. Garbage is collected as usual once it is resumed."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _RowsBatch(NamedTuple):
    """A batch remembered under its head, with the layout rows it was built from."""

    batch: object
    rows: list


class PerGroup:
    """A planner's table of one kind of state per group, keyed by the group object itself
    (never by ``id()``, which a later group may reuse): weakly where the object allows it
    (a ``RefitGroup``, a torch process group), so a dropped group drops its entries and a
    planner never keeps a group alive; any other hashable scope is kept until ``clear``."""

    def __init__(self) -> None:
        self._weak: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._strong: dict = {}

    def get(self, group: Any, default: Any = None) -> Any:
        try:
            return self._weak.get(group, default)
        except TypeError:  # not weakly referenceable
            return self._strong.get(group, default)

    def setdefault(self, group: Any, value: Any) -> Any:
        try:
            return self._weak.setdefault(group, value)
        except TypeError:
            return self._strong.setdefault(group, value)

    def values(self) -> list:
        return [*self._weak.values(), *self._strong.values()]

    def clear(self) -> None:
        self._weak.clear()
        self._strong.clear()


_STAGING_STREAMS = 4  # streams with kept staging slots per Planner (see staging_slots)


class Planner:
    """Owns the caches of one refit session: plans (layout key -> ParamPlan), validated
    layout keys, per-batch state per group (fingerprint, schedule, execution programs),
    each group's call history (``sequence.CallSequence``) and the CUDA staging slots.

    Everything cached is computed from plain data (layout tuples, names, dtypes,
    placements, tensor strides, the ranks' agreed stride signatures; never from tensors'
    contents or mesh object identity), so a cache hit gives exactly what recomputing
    would. One planner per refit session; ``clear()`` drops everything deterministically.
    """

    def __init__(self, costs: Optional[LinkCosts] = None) -> None:
        self.costs = costs  # None: the default plans (no link model)
        self._plans: dict[LayoutKey, ParamPlan] = {}
        self._layouts: dict[tuple, LayoutKey] = {}
        self._batches = PerGroup()  # group -> batch key -> batch
        self._by_rows = PerGroup()  # group -> head -> _RowsBatch
        self._staging: dict[tuple, list] = {}  # (device index, stream) -> two CUDA slots
        self._sequences = PerGroup()  # group -> its call history (CallSequence)

    def plan(self, key: LayoutKey) -> ParamPlan:
        got = self._plans.get(key)
        if got is None:
            got = build_plan(key, self.costs)
            check_writes_exactly_once(got)
            self._plans[key] = got
        return got

    def plan_all(self, keys: Sequence[LayoutKey]) -> list[ParamPlan]:
        """Plans for many keys (with the cyclic GC paused, see ``gc_paused``)."""
        with gc_paused():
            return [self.plan(k) for k in keys]

    def layout(self, light: tuple, build) -> LayoutKey:
        """The validated layout key for ``light`` (a hashable description of the layout
        made of plain keys and placement objects), from ``build()`` on first use. ``build``
        raises on invalid layouts, so only valid ones are cached."""
        got = self._layouts.get(light)
        if got is None:
            got = build()
            self._layouts[light] = got
        return got

    def call_sequence(self, scope: Any) -> CallSequence:
        """The history of calls that went through on one group (``agree=False`` skips the
        vote for the call it predicts). ``scope``, here and below: the group itself."""
        got = self._sequences.get(scope)
        if got is None:
            got = self._sequences.setdefault(scope, CallSequence())
        return got

    def forget_calls(self) -> None:
        """Drop the call histories: the next calls vote. Every rank of a group does this at
        the same point (a peer that joined anew has no history to predict from)."""
        self._sequences.clear()

    def batch(self, scope: Any, key: tuple) -> Optional[object]:
        """Cached per-batch state for ``key`` in ``scope`` (one group), or None."""
        return self._batches.get(scope, {}).get(key)

    def remember_batch(self, scope: Any, key: tuple, value: object) -> None:
        # One cache per group, bounded against callers whose batches never repeat. Every
        # rank of a group calls the same batches on it in the same order, so its ranks
        # clear their caches at the same call: a batch is then rebuilt (and agreed) on all
        # of them at once, whatever other groups a rank also serves. Generous: a refit loop
        # cycles through all its batches (one per ~512 MiB of weights), and a bound below
        # that count would clear the cache before any batch came round again.
        batches = self._batches.setdefault(scope, {})
        if len(batches) >= 1024:
            batches.clear()
        batches[key] = value

    def batch_by_rows(self, scope: Any, head: tuple, rows: list) -> Optional[object]:
        """The batch remembered under ``head`` if it was built from these ``rows``
        (``batch.layout_rows``), else None."""
        got = self._by_rows.get(scope, {}).get(head)
        return got.batch if got is not None and got.rows == rows else None

    def remember_rows(self, scope: Any, head: tuple, batch: object, rows: list) -> None:
        """Remember ``batch`` with the rows it was built from; bounded and cleared like
        ``remember_batch``; a miss only costs the light key."""
        known = self._by_rows.setdefault(scope, {})
        if len(known) >= 1024:
            known.clear()
        known[head] = _RowsBatch(batch, rows)

    def staging_slots(self, device: torch.device, nbytes: int) -> list:
        """The two CUDA staging slots (uint8, at least ``nbytes`` each) of calls on the
        current stream, kept across calls.

        Kept, not allocated per call: NCCL holds every buffer it sends or receives until
        its stream is past it (``recordStream``), so slots freed at the end of each call
        stay unusable while the host queues the next calls, and a caller that never syncs
        (the refit loop's generation side) made the allocator reserve new ones for every
        batch in flight: 2.1 GiB for a 256 MiB budget (docs/MEASUREMENTS.md). Reusing the
        same slots in the same stream's order is safe without any sync: each call joins
        its side stream and NCCL's work into the current stream before it returns. One
        pair per stream (at most ``_STAGING_STREAMS``, least recently used dropped);
        ``release_staging()`` gives them back."""
        stream = torch.cuda.current_stream(device)
        key = (stream.device_index, stream.cuda_stream)
        got = self._staging.pop(key, None)
        if got is not None and got[0].numel() < nbytes:
            got = None  # the smaller pair goes back to the allocator before the new one
        if got is None:
            got = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self._staging[key] = got  # most recently used last
        while len(self._staging) > _STAGING_STREAMS:
            del self._staging[next(iter(self._staging))]
        return got

    def release_staging(self) -> None:
        """Drop the kept CUDA staging slots (the allocator reuses them once the streams
        that used them are past) and the programs' kept local-copy views and the batches'
        lanes, which hold the last call's tensors."""
        self._staging.clear()
        for batches in self._batches.values():  # the batches found by rows are here too
            for batch in batches.values():
                batch.lane = None  # it holds a kept batch of copies too (lane.py)
                for program in batch.programs.values():
                    program.release()

    def clear(self) -> None:
        self._plans.clear()
        self._layouts.clear()
        self._batches.clear()
        self._by_rows.clear()
        self._staging.clear()
        self._sequences.clear()

    def __len__(self) -> int:
        return len(self._plans)


def batch_fingerprint(items: Sequence[tuple]) -> str:
    """Stable hash of a batch description: (name, dtype string, plan fingerprint) items."""
    h = hashlib.blake2b(digest_size=12)
    for name, dtype, fp in items:
        h.update(f"{name}\x00{dtype}\x00{fp}\x01".encode())
    return h.hexdigest()
