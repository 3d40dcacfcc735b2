"""The source views of a colocated refit, as they travel between its two sides.

Torch + stdlib only. A training rank shares the storages under its source views once
(``shared_memory``) and publishes the views' description (storage handle, dtype, offset,
size, stride per tensor or member) in the refit group's store under a generation number
(``PublishedViews``); a generation rank maps that description (``MappedViews``), keeping
every opened storage across refits, so a training storage is opened again only when it
changes. The store key and the description's form are shared by the two classes here and
by nothing else.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

import torch

from megatron_reshard.groups.faults import RefitError

from .host_flags import PAYLOAD_BITS
from .members import is_members
from .shared_memory import StorageHandle, export_storage, open_storage, view_of

_KEY = "colocated"   # prefix of these keys in the group's store


def _store_key(rank: int, fp: int, generation: int) -> str:
    return f"{_KEY}/{rank}/{fp:x}/{generation}"


class PublishedViews:
    """A training rank's side: its shared storages and the views it published, per batch."""

    def __init__(self, store: Any, me: int):
        self.store, self.me = store, me
        self._generation = 0         # the last generation number given out on this rank
        self._handles: dict = {}     # storage key -> StorageHandle (shared once)
        self._published: dict = {}   # batch fp -> (signature, description, generation)
        self._keep: dict = {}        # batch fp -> storages under the published views

    def of(self, fp: int) -> Optional[tuple]:
        """(signature, description, generation) last published for batch ``fp``, or None."""
        return self._published.get(fp)

    def publish(self, fp: int, transfers, signature) -> int:
        """Share this rank's source storages and publish the batch's views when they
        changed; returns the generation of the views now in force for this batch.

        Unchanged views are recognised by this rank's tensors' signature (the transport's
        ``_signature``: address, size, stride, dtype, device of every tensor and member),
        not by describing every view again: the storages under the published views are
        kept alive here (``_keep``), so a view at the same address with the same geometry
        reads the same memory as the one the generation ranks mapped."""
        published = self._published.get(fp)
        if published is not None and signature is not None and published[0] == signature:
            return published[2]
        storages, handles = [], {}
        views = tuple(self._describe(t.src, storages, handles) for t in transfers)
        if published is not None and published[1] == views:
            self._published[fp] = (signature, views, published[2])
            return published[2]
        self._generation += 1
        if self._generation >> (PAYLOAD_BITS - 1):  # it travels in a barrier word
            raise RefitError("colocated refit: more than 2**30 source layouts published on "
                             "this group; create a new refit group")
        self.store.set(_store_key(self.me, fp, self._generation), pickle.dumps((views, handles)))
        self._published[fp] = (signature, views, self._generation)
        self._keep[fp] = storages  # alive while a reader may map them
        return self._generation

    def clear(self) -> None:
        self._published.clear()
        self._keep.clear()

    def _describe(self, x, storages: list, handles: dict):
        if x is None:
            return None
        if is_members(x):
            return ("members", tuple(self._describe_tensor(m, storages, handles) for m in x))
        return ("tensor", self._describe_tensor(x, storages, handles))

    def _describe_tensor(self, t: torch.Tensor, storages: list, handles: dict) -> tuple:
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())
        handle = self._handles.get(key)
        if handle is None:
            handle = export_storage(storage)  # on CPU: moved into shared memory, in place
            key = (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())
            self._handles[key] = handle
        handles[handle.key] = handle
        storages.append(storage)
        return (handle.key, str(t.dtype).removeprefix("torch."), t.storage_offset(),
                tuple(t.shape), tuple(t.stride()))


class MappedViews:
    """A generation rank's side: the training ranks' published views, mapped here."""

    def __init__(self, store: Any):
        self.store = store
        self._opened: dict = {}  # (train rank, handle key) -> opened storage
        self._mapped: dict = {}  # (train rank, batch fp) -> (generation, per-transfer views)

    def of(self, rank: int, fp: int, generation: int) -> list:
        """Training rank ``rank``'s source views of batch ``fp`` (generation
        ``generation``) as mapped here: per transfer None, a tensor or a list of members."""
        cached = self._mapped.get((rank, fp))
        if cached is not None and cached[0] == generation:
            return cached[1]
        views, handles = pickle.loads(self.store.get(_store_key(rank, fp, generation)))
        for hkey, handle in handles.items():
            if (rank, hkey) not in self._opened:
                self._opened[(rank, hkey)] = open_storage(StorageHandle(*handle))
        mapped = [None if v is None else self._rebuild(rank, v) for v in views]
        self._mapped[(rank, fp)] = (generation, mapped)
        self._forget_unused(rank)
        return mapped

    def clear(self) -> None:
        self._mapped.clear()
        self._opened.clear()

    def _rebuild(self, rank: int, view: tuple):
        kind, body = view
        if kind == "members":
            return [self._tensor(rank, m) for m in body]
        return self._tensor(rank, body)

    def _tensor(self, rank: int, entry: tuple) -> torch.Tensor:
        hkey, dtype, offset, size, stride = entry
        return view_of(self._opened[(rank, hkey)], getattr(torch, dtype), offset, size, stride)

    def _forget_unused(self, rank: int) -> None:
        """Close the storages of ``rank`` that no mapped batch uses any more (a training
        storage that changed: a pre hook's fresh buffer)."""
        used = set()
        for (r, _), (_, mapped) in self._mapped.items():
            if r == rank:
                for x in mapped:
                    for t in (x if isinstance(x, list) else [x]):
                        if t is not None:
                            used.add(t.untyped_storage().data_ptr())
        for key in [k for k in self._opened if k[0] == rank]:
            if self._opened[key].data_ptr() not in used:
                del self._opened[key]
