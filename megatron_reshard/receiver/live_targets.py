"""What the receiver writes into must still be vLLM's storage: targets checked every refit.

Torch + stdlib only. A session binds its targets (views into vLLM's params) at
``prepare_refit``. vLLM may re-allocate a param afterwards: ``param.data = ...`` in a
post-load step, an offload and onload around sleep and wake, ``model.to()`` (all through
``model._apply`` or ``.data``), or a new ``Parameter`` put in the module. The targets then
still point at the old storage (they keep it alive), and every later refit would write
into a tensor vLLM no longer reads while reporting a consistent commit.

So each refit starts with ``LiveTargets.check()``: vLLM's params read again by name (from
their modules' tables when the model is known, else the objects the session was given:
a ``param.data = ...`` shows in the same object) and compared with those the targets were
bound to, in one ``==`` of tuples gathered by ``map`` (object, address, shape, stride,
dtype, device of every param). Equal: the targets alias vLLM's storage (the old storage is
alive while the targets hold it, so no new tensor can take its address). Different:

- moved, same shape, dtype and device, and the session writes into the param itself:
  re-bound (``Changed.moved``; the session maps the payload onto the new storage again);
- anything else (a param gone, another shape, dtype or device, or a param the session
  receives through a view of its own or a staging tensor): refused before any byte moves
  (``Changed.refusals``), voted with the version so every rank of every group refuses alike.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Mapping, NamedTuple, Optional, Sequence

import torch

_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")


def _signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    """Each tensor's object, address, shape, stride, dtype and device, as one tuple of
    tuples (one ``==`` compares them all); None where a tensor is gone."""
    if any(t is None for t in tensors):
        return (tuple(map(id, tensors)),)
    return (tuple(map(id, tensors)), tuple(map(_PTR, tensors)), tuple(map(_SIZE, tensors)),
            tuple(map(_STRIDE, tensors)), tuple(map(_DTYPE, tensors)),
            tuple(map(_DEVICE, tensors)))


def _aliases(target: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether writing ``target`` writes ``param`` whole (a ``detach()`` of it)."""
    return (target.data_ptr() == param.data_ptr() and target.shape == param.shape
            and target.stride() == param.stride() and target.dtype == param.dtype
            and target.device == param.device)


class Changed(NamedTuple):
    """vLLM params that changed since the targets were bound: ``moved`` (name -> the
    param now: re-bindable), ``refused`` (names) and ``refusals`` (one line for each)."""

    moved: Mapping[str, torch.Tensor]
    refused: tuple[str, ...]
    refusals: tuple[str, ...]


class LiveTargets:
    """The vLLM params a session's targets were bound to, checked at each refit.

    ``bound``: name -> the tensor the session writes into (the param itself, or a view or
    staging tensor of the session's own); ``given``: name -> the object the caller passed
    (a ``Parameter`` shows ``param.data = ...``); ``model``: vLLM's model, whose module
    tables are read where they hold the name (a replaced ``Parameter`` is seen too)."""

    def __init__(self, bound: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor],
                 model: Optional[torch.nn.Module] = None, where: str = ""):
        self.where = where
        self._names = list(bound)
        self._slots = _slots(model, given, self._names)
        now = self.current()
        self._signature = _signature(now)
        # the session writes into the param itself: a move can be followed by re-binding
        self._direct = [_aliases(bound[n], t) for n, t in zip(self._names, now)]
        self.rebinds = 0  # how many refits found moved params and re-bound the targets

    def current(self) -> list[Optional[torch.Tensor]]:
        """vLLM's params now, by name (``_parameters`` / ``_buffers`` of their modules, or
        the objects given): no walk over the model."""
        return [table.get(key) for table, key in self._slots]

    def check(self) -> Optional[Changed]:
        """None when every target still aliases vLLM's storage, else what changed."""
        now = self.current()
        got = _signature(now)
        if got == self._signature:
            return None
        was = list(zip(*self._signature))  # per param: (id, address, shape, stride, dtype, device)
        moved, refused, refusals = {}, [], []
        for i, (name, new) in enumerate(zip(self._names, now)):
            if new is None:
                refused.append(name)
                refusals.append(f"{name}: gone from vLLM's model on {self.where}")
                continue
            if tuple(zip(*_signature([new])))[0] == was[i]:
                continue
            _, _, shape, _, dtype, device = was[i]
            if tuple(new.shape) != tuple(shape) or new.dtype != dtype or new.device != device:
                refused.append(name)
                refusals.append(f"{name} on {self.where}: vLLM now holds {new.dtype} "
                                f"{list(new.shape)} on {new.device}, but the refit was prepared "
                                f"for {dtype} {list(shape)} on {device}")
            elif not self._direct[i]:
                refused.append(name)
                refusals.append(f"{name} on {self.where}: vLLM re-allocated it, and this rank "
                                f"receives it through a tensor of its own (a view of the old "
                                f"storage, or a staging tensor)")
            else:
                moved[name] = new
        return Changed(moved, tuple(refused), tuple(refusals))

    def accept(self) -> None:
        """The targets were re-bound to vLLM's params as they are now."""
        self._signature = _signature(self.current())
        self.rebinds += 1

    def followed(self, names) -> None:
        """The caller re-bound these params itself (a staged session's live params behind
        its staging tensors, ``receiver.staging``): their state now is the bound one."""
        names = set(names)
        if not names:
            return
        now = self.current()
        per_param = list(zip(*self._signature))
        for i, name in enumerate(self._names):
            if name in names and now[i] is not None:
                per_param[i] = tuple(zip(*_signature([now[i]])))[0]
        self._signature = tuple(map(tuple, zip(*per_param)))


def _slots(model: Optional[torch.nn.Module], given: Mapping[str, torch.Tensor],
           names: Sequence[str]) -> list[tuple[dict, str]]:
    """Per name: a table that holds vLLM's param and its key there: the module's own
    (``_parameters`` / ``_buffers``) where the model holds the name, else a table of one
    holding the object given."""
    out = []
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        module = None
        if model is not None:
            try:
                module = model.get_submodule(prefix) if prefix else model
            except AttributeError:
                module = None
        if module is not None and leaf in module._parameters:
            out.append((module._parameters, leaf))
        elif module is not None and leaf in module._buffers:
            out.append((module._buffers, leaf))
        else:
            out.append(({leaf: given[name]}, leaf))
    return out


__all__ = ["Changed", "LiveTargets"]
