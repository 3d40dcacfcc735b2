"""Every refit reads the model's current storage: the sender's views follow moved params.

The sender cuts its HF-named views (``local_specs``) from the model's tensors once, at
construction. Between refits an RL loop may move them: ``Module.to()`` / ``.cuda()`` /
``.cpu()`` (``model._apply``), or an offload and onload through ``param.data = ...``. The
views then still point at the old storage (they keep it alive), and a refit would send
bytes the model no longer holds while every check passes.

So each refit starts with ``BoundTensors.check()``: the model's tensors read again from
their modules' tables (a replaced ``Parameter`` object is seen too) and compared
with those the views were cut from, in one ``==`` of two tuples gathered by ``map`` in C
(object, address, shape, stride, dtype, device of every tensor). Equal: the views alias
the model's storage (the old storage is kept alive by the views, so no new tensor can
take its address). Different: the views are cut again the way the source cut them
(``rebound``), or, where that would not hold the refit's payload (a tensor gone, or its
shape or dtype changed: the payload was built for the old ones), the refit is refused
before any byte moves (``Moved.refusals``, voted in the version check so every rank of
the group refuses alike). Cost measured in docs/MEASUREMENTS.md ("Moved parameters").
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from types import MappingProxyType
from typing import NamedTuple, Optional, Sequence

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.megatron.fp8_source import train_fp8_views
from megatron_reshard.megatron.model_info import named_tensors
from megatron_reshard.megatron.train_plan import TrainSidePlan

_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride
_DTYPE, _DEVICE = attrgetter("dtype"), attrgetter("device")


def signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    """What the views of ``tensors`` depend on, compared in one ``==``: each tensor's
    object, address, shape, stride, dtype and device (None where a tensor is gone)."""
    if any(t is None for t in tensors):
        return (tuple(map(id, tensors)),)
    return (tuple(map(id, tensors)), tuple(map(_PTR, tensors)), tuple(map(_SIZE, tensors)),
            tuple(map(_STRIDE, tensors)), tuple(map(_DTYPE, tensors)),
            tuple(map(_DEVICE, tensors)))


class Moved(NamedTuple):
    """The model's tensors that changed since the views were cut: ``moved`` (Megatron
    names, re-bindable), ``refused`` (Megatron names: gone, or another shape or dtype) and
    ``refusals`` (one line for each of those)."""

    moved: tuple[str, ...]
    refused: tuple[str, ...]
    refusals: tuple[str, ...]


class BoundTensors:
    """The model tensors a sender's views were cut from, checked at each refit."""

    def __init__(self, plan: TrainSidePlan):
        self.plan = plan
        self._names = [conv.megatron_name for conv, _ in plan.local.converted]
        self._slots = _slots(plan.facts.model, self._names)
        # taken now: a tensor moved by ``param.data = ...`` is the same object afterwards
        bound = [t for _, t in plan.local.converted]
        self._signature = signature(bound)
        self._places = _places(bound)
        self.rebinds = 0  # how many refits found moved tensors and re-cut the views

    def current(self) -> list[Optional[torch.Tensor]]:
        """The model's tensors now, by the names the plan converted: each read from its
        module's own table (``_parameters`` / ``_buffers``, where ``param.data = ...`` and
        ``_apply`` leave or put it), not by walking the model (~6 µs a param, measured)."""
        return [table.get(key) for table, key in self._slots]

    def check(self) -> Optional[Moved]:
        """None when every view still aliases the model's storage, else what moved."""
        now = self.current()
        got = signature(now)
        if got == self._signature:
            return None
        moved, refused, refusals = [], [], []
        where = self.plan.where()
        was = list(zip(*self._signature))  # per tensor: (id, address, shape, stride, dtype, device)
        for i, (name, new) in enumerate(zip(self._names, now)):
            _, _, shape, _, dtype, _ = was[i]
            if new is None:
                refused.append(name)
                refusals.append(f"{name}: gone from the model on {where}")
            elif tuple(new.shape) != tuple(shape) or new.dtype != dtype:
                refused.append(name)
                refusals.append(f"{name} on {where}: now {new.dtype} {list(new.shape)}, but the "
                                f"refit payload was built for {dtype} {list(shape)}")
            elif tuple(zip(*signature([new])))[0] != was[i] and _places([new])[0] != self._places[i]:
                moved.append(name)
        if not moved and not refused:
            # only addresses changed, each storage the same: its memory was reallocated in
            # place (``share_memory_()``, as the colocated transport's CPU stand-in does,
            # or ``resize_``) and the views, cut from the same storage, followed it
            self._signature = got
            return None
        return Moved(tuple(moved), tuple(refused), tuple(refusals))

    def rebound(self) -> tuple[TrainSidePlan, tuple]:
        """The plan with the model's current tensors, and their signature (after ``check``
        found only re-bindable moves); ``accept`` them once the views cut from the plan
        (``source.local_param_map``) are in use, so a failed cut leaves all as it was."""
        now = self.current()
        plan = self.plan
        converted = tuple((conv, tensor) for (conv, _), tensor in zip(plan.local.converted, now))
        fp8_views = plan.local.fp8_views
        if plan.gen.quant is not None:  # FP8-held weights: their data and scales cut again
            views, _ = train_fp8_views(list(converted), plan.facts.dims,
                                       tp_rank=plan.facts.coords.tp)
            fp8_views = MappingProxyType(views)
        local = dataclasses.replace(plan.local, converted=converted, fp8_views=fp8_views)
        return dataclasses.replace(plan, local=local), signature(now)

    def accept(self, rebound: tuple[TrainSidePlan, tuple]) -> None:
        self.plan, self._signature = rebound
        self._places = _places([t for _, t in self.plan.local.converted])
        self.rebinds += 1


def _places(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """Per tensor: its storage (the C object, alive while the views hold it: no other
    storage can take its address), offset, shape, stride and dtype; equal means the views
    cut from it still alias it, wherever that storage's memory now lives."""
    return [_place(t) for t in tensors]


def _place(t: torch.Tensor) -> tuple:
    try:
        return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(),
                t.dtype)
    except (RuntimeError, NotImplementedError, AttributeError):  # no plain storage: never
        return (object(),)                                       # equal, so re-cut


def _slots(model: torch.nn.Module, names: Sequence[str]) -> list[tuple[dict, str]]:
    """Per Megatron name (``model_info.named_tensors``): the module table that holds it and
    its key there."""
    tensors = dict(named_tensors(model))
    out = []
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix) if prefix else model
        table = module._parameters if leaf in module._parameters else module._buffers
        if table.get(leaf) is not tensors.get(name):  # a module that lends others its params
            raise BadInputError(f"{name}: the model's named_parameters() gives a tensor that "
                                f"its module {prefix or 'the model'} does not hold as {leaf!r}; "
                                f"the refit cannot tell when it moves")
        out.append((table, leaf))
    return out


__all__ = ["BoundTensors", "Moved", "signature"]
