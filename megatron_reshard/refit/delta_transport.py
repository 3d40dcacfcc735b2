"""The delta transport of the process-group path: changed elements only, per plan op.

Torch + stdlib only (the receiver imports it). For each eligible bulk param of a batch
(``refit.delta.eligible``: every op of its engine plan one hop, source -> destination),
each op ``(src, dst, box)`` becomes one message pair on the refit group: a header of three
int64 ``[count, encoding, payload bytes]``, then (when ``count > 0``) one uint8 payload.
The sender compares the box of its new local view with its base bit for bit and picks the
smallest encoding:

- ``POSITIONS``: int32 (int64 past 2**31 elements) flat positions in the box, row-major,
  then the values;
- ``BITMASK``: one bit per element of the box (little-endian within a byte), then the
  values of the set bits in order;
- ``DENSE``: the whole box;
- ``NONE``: nothing changed (header only).

The receiver learns the encoding from the header (no extra round trip) and writes the
values in place into its destination view, which holds the base's bits (the vote in
``refit.version`` proved that). Ops run in plan order, params in batch order, blocking:
every op has one sender and one receiver and every rank walks the same list, so nothing
can deadlock. Waits go through ``groups.faults.wait_works`` (a failing peer raises at
once). Bits are compared as integers, so NaN payloads and -0.0 move exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_reshard.layout.geometry import box_numel
from megatron_reshard.engine.param_plan import ParamPlan
from megatron_reshard.groups.collectives import control_device
from megatron_reshard.groups.faults import RefitError, wait_works
from megatron_reshard.refit import delta_kernels
from megatron_reshard.refit.delta import TrainBase, as_tensor

NONE, POSITIONS, BITMASK, DENSE = 0, 1, 2, 3
ENCODINGS = {NONE: "none", POSITIONS: "positions", BITMASK: "bitmask", DENSE: "dense"}
HEADER_BYTES = 3 * 8
_TAG = 0
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


class DeltaTransportError(RefitError):
    """A delta message that does not fit the receiver's view (bad or mismatched delta)."""


@dataclass
class DeltaTally:
    """What the delta transport moved on this rank in one refit."""

    params: int = 0          # params of this rank moved as deltas
    ops: int = 0             # message pairs this rank took part in
    wire_bytes: int = 0      # header + payload bytes this rank sent (src) or received (dst)
    full_bytes: int = 0      # what a full refit would have moved for the same ops
    forwarded_bytes: int = 0  # dst: header + payload bytes sent on to replicas (phase 1)
    held_bytes: int = 0      # this rank's owned boxes of those params (RefitStats.local_bytes)
    changed: int = 0         # elements that changed
    encodings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"params": self.params, "ops": self.ops, "wire_bytes": self.wire_bytes,
                "full_bytes": self.full_bytes, "held_bytes": self.held_bytes,
                "forwarded_bytes": self.forwarded_bytes, "changed": self.changed,
                "encodings": dict(self.encodings)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (contiguous copy when needed)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def index_bytes(numel: int) -> int:
    return 4 if numel < (1 << 31) else 8


def pick_encoding(numel: int, count: int, itemsize: int) -> int:
    """The cheapest encoding of ``count`` changed elements of ``numel`` (ties: fewer steps)."""
    if count == 0:
        return NONE
    sizes = {DENSE: numel * itemsize,
             BITMASK: (numel + 7) // 8 + count * itemsize,
             POSITIONS: count * (index_bytes(numel) + itemsize)}
    return min(sizes, key=lambda k: (sizes[k], -k))


def encode(new: torch.Tensor, old: torch.Tensor) -> tuple[int, int, Optional[torch.Tensor]]:
    """``(count, encoding, payload)`` of the elements of ``new`` whose bits differ from
    ``old`` (same shape and dtype); payload None when nothing changed."""
    if delta_kernels.usable(new):  # CUDA: two Triton launches (refit.delta_kernels)
        return delta_kernels.encode(new, old, pick_encoding)
    flat_new = new.contiguous().reshape(-1)
    changed = (_bits(new).reshape(-1) != _bits(old).reshape(-1))
    count = int(changed.sum())
    numel = flat_new.numel()
    enc = pick_encoding(numel, count, new.element_size())
    if enc == NONE:
        return 0, NONE, None
    if enc == DENSE:
        return count, enc, flat_new.view(torch.uint8)
    values = flat_new[changed].view(torch.uint8)
    if enc == POSITIONS:
        idx_dtype = torch.int32 if index_bytes(numel) == 4 else torch.int64
        pos = changed.nonzero().reshape(-1).to(idx_dtype).view(torch.uint8)
        return count, enc, torch.cat([pos, values])
    pad = (-numel) % 8
    bits = torch.cat([changed, changed.new_zeros(pad)]) if pad else changed
    mask = (bits.reshape(-1, 8).to(torch.uint8) * _BIT_WEIGHTS.to(bits.device)).sum(
        1, dtype=torch.uint8)
    return count, enc, torch.cat([mask, values])


def payload_bytes(numel: int, count: int, enc: int, itemsize: int) -> int:
    if enc == NONE:
        return 0
    if enc == DENSE:
        return numel * itemsize
    if enc == BITMASK:
        return (numel + 7) // 8 + count * itemsize
    if enc == POSITIONS:
        return count * (index_bytes(numel) + itemsize)
    raise DeltaTransportError(f"unknown delta encoding {enc}")


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a payload as ``dtype``; copied when they do not start on an element
    boundary (values after an odd-sized bitmask)."""
    if raw.storage_offset() % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()
    return raw.view(dtype)


def apply(view: torch.Tensor, count: int, enc: int, payload: Optional[torch.Tensor]) -> None:
    """Write a received delta into ``view`` in place (any strides)."""
    if enc == NONE:
        return
    if delta_kernels.usable(view):  # CUDA: Triton kernels (refit.delta_kernels)
        try:
            if delta_kernels.apply(view, count, enc, payload):
                return
        except delta_kernels.BadDelta as exc:
            raise DeltaTransportError(f"a delta for a view of shape {list(view.shape)}: "
                                      f"{exc}") from None
    numel = view.numel()
    if enc == DENSE:
        view.copy_(payload.view(view.dtype).reshape(view.shape))
        return
    flat = view.contiguous().reshape(-1)  # a copy for a strided view, written back below
    if enc == POSITIONS:
        nidx = count * index_bytes(numel)
        idx_dtype = torch.int32 if index_bytes(numel) == 4 else torch.int64
        pos = _typed(payload[:nidx], idx_dtype).to(torch.int64)
        flat[pos] = _typed(payload[nidx:], view.dtype)
    else:
        nmask = (numel + 7) // 8
        weights = _BIT_WEIGHTS.to(payload.device)
        bits = (payload[:nmask].unsqueeze(1) & weights).ne(0).reshape(-1)[:numel]
        if int(bits.sum()) != count:
            raise DeltaTransportError(f"a bitmask delta sets {int(bits.sum())} bits but its "
                                      f"header says {count}")
        flat[bits] = _typed(payload[nmask:], view.dtype)
    if not view.is_contiguous():  # ``flat`` was a copy
        view.copy_(flat.reshape(view.shape))


class DeltaMover:
    """Moves the eligible params of each batch as deltas, for one side of one stage."""

    def __init__(self, side: str, group: Any, rank: int, plans: list[Optional[ParamPlan]],
                 base: Optional[TrainBase] = None):
        self.side = side
        self.group = group
        self.rank = rank
        self.plans = plans
        self.base = base
        self.tally = DeltaTally()
        self._ctl = control_device(group)

    def _wait(self, work, what: str) -> None:
        wait_works([work], self.group, what)

    def move(self, index: int, name: str, buf: Any) -> None:
        """Param ``index`` (``name``) of the stage; ``buf``: this rank's side (or None)."""
        plan = self.plans[index]
        local = None if buf is None else as_tensor(buf)
        if local is not None:
            self.tally.params += 1
            own = (plan.src if self.side == "src" else plan.dst).get(self.rank)
            if own is not None:
                self.tally.held_bytes += sum(box_numel(p.box) for p in own.pieces) * \
                    local.element_size()
        base = None
        if self.side == "src" and local is not None:
            base = self.base.tensors.get(index)
            if base is None or base.shape != local.shape or base.dtype != local.dtype:
                raise DeltaTransportError(f"{name}: src group rank {self.rank} holds no base of "
                                          f"its local view {list(local.shape)} for a delta refit")
        # phase 1 (replica completion): a member forwards the stripe it received as a
        # delta of its own; the old bits of that stripe are kept until then
        old_stripes = {}
        if self.side == "dst" and local is not None:
            for k, op in enumerate(plan.ops):
                if op.phase == 1 and op.src == self.rank:
                    piece = plan.dst[self.rank].pieces[op.src_piece]
                    old_stripes[k] = local[piece.index(op.box)].clone()
        for k, op in enumerate(plan.ops):
            if op.phase == 0 and op.src == self.rank and self.side == "src":
                piece = plan.src[self.rank].pieces[op.src_piece]
                idx = piece.index(op.box)
                self._send(name, op, local[idx], base[idx])
            elif op.phase == 1 and op.src == self.rank and self.side == "dst":
                piece = plan.dst[self.rank].pieces[op.src_piece]
                self._send(name, op, local[piece.index(op.box)], old_stripes.pop(k),
                           forwarded=True)
            elif op.dst == self.rank and self.side == "dst":
                piece = plan.dst[self.rank].pieces[op.dst_piece]
                self._recv(name, op, local[piece.index(op.box)])
        if base is not None:  # the bits just sent become the base (valid at the commit)
            base.copy_(local)

    def _send(self, name: str, op, new: torch.Tensor, old: torch.Tensor,
              forwarded: bool = False) -> None:
        old = old.to(new.device) if old.device != new.device else old
        count, enc, payload = encode(new, old)
        nbytes = 0 if payload is None else payload.numel()
        header = torch.tensor([count, enc, nbytes], dtype=torch.int64, device=self._ctl)
        self._wait(self.group.send([header], op.dst, _TAG), f"the delta header of {name}")
        if payload is not None:
            self._wait(self.group.send([payload.contiguous()], op.dst, _TAG),
                       f"the delta of {name}")
        if forwarded:
            self.tally.forwarded_bytes += HEADER_BYTES + nbytes
            return
        self._count(op, new, count, enc, nbytes)

    def _recv(self, name: str, op, view: torch.Tensor) -> None:
        header = torch.empty(3, dtype=torch.int64, device=self._ctl)
        self._wait(self.group.recv([header], op.src, _TAG), f"the delta header of {name}")
        count, enc, nbytes = (int(x) for x in header.tolist())
        numel = box_numel(op.box)
        want = payload_bytes(numel, count, enc, view.element_size()) \
            if enc in ENCODINGS and 0 <= count <= numel else -1
        if want != nbytes:
            # the peer is still consistent (it sent what it announced): raise here, the
            # fault board tells the others
            raise DeltaTransportError(
                f"{name}: dst group rank {self.rank} got a delta header from group rank "
                f"{op.src} for box {list(op.box)} ({numel} elements) with count {count}, "
                f"encoding {enc}, {nbytes} bytes; expected {want} bytes")
        payload = None
        if nbytes:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=view.device)
            self._wait(self.group.recv([payload], op.src, _TAG), f"the delta of {name}")
        apply(view, count, enc, payload)
        self._count(op, view, count, enc, nbytes)

    def _count(self, op, t: torch.Tensor, count: int, enc: int, nbytes: int) -> None:
        self.tally.ops += 1
        self.tally.wire_bytes += HEADER_BYTES + nbytes
        self.tally.full_bytes += math.prod(t.shape) * t.element_size()
        self.tally.changed += count
        key = ENCODINGS[enc]
        self.tally.encodings[key] = self.tally.encodings.get(key, 0) + 1


__all__ = ["BITMASK", "DENSE", "DeltaMover", "DeltaTally", "DeltaTransportError", "NONE",
           "POSITIONS", "apply", "encode", "pick_encoding"]
