"""The delta transport of the process-group path: changed elements only, batched per peer
(``DeltaMover``, one per side of a stage; ``DeltaTally``, what it moved).

Torch + stdlib only (the receiver imports it). For each eligible bulk param of a batch
(``delta.eligible.eligible``: every op of its engine plan one hop), each plan op
``(src, dst, box)`` becomes one *region*: the sender compares the box of its new local
view with its base bit for bit and cuts ``(count, encoding, payload)``. Regions are not
messages: per batch and per peer, the headers of all its regions travel as one int64
message (two words a region: ``count * 16 + encoding``, payload bytes) and their payloads
as one uint8 message (none when nothing changed). So a delta refit costs two messages per
peer per batch, however many small params (norms, biases) the batch holds, and 16 bytes a
region: per-message latency, not bytes, dominates a sparse delta (issue 35).

The receiver learns each region's encoding from the header and writes the values in place
into its destination view. Every rank walks the same plan in the same order: per batch,
phase 0 (sources -> destinations) then phase 1 (a destination member forwards the stripe
it received to its replicas, as a delta of its own against the stripe's old bits). Each
exchange is two ``engine.p2p`` rounds (headers, then payloads), all posted before any is
waited on (NCCL: coalesced), so nothing can deadlock. Bits are compared as integers: NaN
payloads and -0.0 move exactly. A header that does not fit the receiver's box is refused
before its payload is received (``DeltaTransportError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_reshard.delta.bases import TrainBase, as_tensor
from megatron_reshard.delta.encoding import apply_many, encode_many, header_problem
from megatron_reshard.delta.wire_format import (HEADER_BYTES, HEADER_WORDS, NONE,
                                                DeltaTransportError, encoding_name)
from megatron_reshard.engine.p2p import P2PChannel
from megatron_reshard.engine.param_plan import ParamPlan
from megatron_reshard.groups.collectives import control_device
from megatron_reshard.layout.geometry import box_numel

_TAG = 0


@dataclass
class DeltaTally:
    """What the delta transport moved on this rank in one refit."""

    params: int = 0          # params of this rank moved as deltas
    ops: int = 0             # regions this rank sent (src) or received (dst)
    messages: int = 0        # messages this rank sent (src) or received (dst), headers included
    wire_bytes: int = 0      # header + payload bytes this rank sent (src) or received (dst)
    full_bytes: int = 0      # what a full refit would have moved for the same regions
    forwarded_bytes: int = 0  # dst: header + payload bytes sent on to replicas (phase 1)
    held_bytes: int = 0      # this rank's owned boxes of those params (RefitStats.local_bytes)
    changed: int = 0         # elements that changed
    # params of this rank that went full inside the delta refit (not eligible: a local
    # copy, or a weight the generation side quantizes, ``delta.eligible.record_eligible``)
    full_params: int = 0
    encodings: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"params": self.params, "ops": self.ops, "messages": self.messages,
                "wire_bytes": self.wire_bytes, "full_bytes": self.full_bytes,
                "held_bytes": self.held_bytes, "forwarded_bytes": self.forwarded_bytes,
                "changed": self.changed, "full_params": self.full_params,
                "encodings": dict(self.encodings)}


@dataclass
class _Region:
    """One plan op of one param, as this rank sees it."""

    name: str
    peer: int             # the other end (group rank)
    box: tuple
    view: Optional[torch.Tensor] = None   # dst: where it lands
    count: int = 0        # src: what was cut
    enc: int = NONE
    payload: Optional[torch.Tensor] = None
    full: int = 0         # bytes of the box


class DeltaMover:
    """Moves the eligible params of each batch as deltas, for one side of one stage."""

    def __init__(self, side: str, group: Any, rank: int, plans: list[Optional[ParamPlan]],
                 base: Optional[TrainBase] = None, on_apply: Optional[Callable] = None):
        """``on_apply(writes)`` (dst): told each batch's ``(view, count, encoding, payload)``
        once applied (a staged refit keeps them for its flip, ``receiver.staged_deltas``)."""
        self.side = side
        self.on_apply = on_apply
        self.group = group
        self.rank = rank
        self.plans = plans
        self.base = base
        self.tally = DeltaTally()
        self._ctl = control_device(group)
        self._p2p = P2PChannel(group, self._ctl)

    def move(self, index: int, name: str, buf: Any) -> None:
        """One param alone (a batch of one)."""
        self.move_batch([(index, name, buf)])

    def move_batch(self, items: list) -> None:
        """The eligible params of one batch: ``(index, name, buf)`` each, ``buf`` this
        rank's side of param ``index`` (or None), in stage order."""
        cuts: list[tuple] = []  # (name, peer, box, new, old) of each phase 0 send
        recvs: list[_Region] = []
        forwards: list[tuple[_Region, torch.Tensor]] = []  # phase 1: (region, old stripe)
        late: list[_Region] = []                           # phase 1 receives
        bases = []
        for index, name, buf in items:
            plan = self.plans[index]
            local = None if buf is None else as_tensor(buf)
            if local is not None:
                self.tally.params += 1
                own = (plan.src if self.side == "src" else plan.dst).get(self.rank)
                if own is not None:
                    self.tally.held_bytes += sum(box_numel(p.box) for p in own.pieces) * \
                        local.element_size()
            if self.side == "src":
                if local is None:
                    continue
                base = self.base.tensors.get(index)
                if base is None or base.shape != local.shape or base.dtype != local.dtype:
                    raise DeltaTransportError(
                        f"{name}: src group rank {self.rank} holds no base of its local view "
                        f"{list(local.shape)} for a delta refit")
                for op in plan.ops:
                    if op.phase == 0 and op.src == self.rank:
                        idx = plan.src[self.rank].pieces[op.src_piece].index(op.box)
                        cuts.append((name, op.dst, op.box, local[idx], base[idx]))
                bases.append((base, local))
                continue
            if local is None:
                continue
            for op in plan.ops:
                if op.phase == 1 and op.src == self.rank:
                    view = local[plan.dst[self.rank].pieces[op.src_piece].index(op.box)]
                    # the stripe's old bits, kept until phase 0 rewrote it
                    forwards.append((_Region(name, op.dst, op.box, view), view.clone()))
                elif op.dst == self.rank:
                    view = local[plan.dst[self.rank].pieces[op.dst_piece].index(op.box)]
                    (recvs if op.phase == 0 else late).append(_Region(name, op.src, op.box, view))
        self._exchange(self._cut(cuts), recvs)
        for base, local in bases:  # the bits just sent become the base (valid at the commit)
            base.copy_(local)
        if forwards or late:
            cut = self._cut([(r.name, r.peer, r.box, r.view, old) for r, old in forwards],
                            forwarded=True)
            self._exchange(cut, late, forwarded=True)

    def _cut(self, wanted: list[tuple], forwarded: bool = False) -> list[_Region]:
        """The regions ``(name, peer, box, new, old)`` cut (``encode_many``: on CUDA one
        host read per group of regions)."""
        pairs = [(new, old.to(new.device) if old.device != new.device else old)
                 for _, _, _, new, old in wanted]
        out = []
        for (name, peer, box, new, _), (count, enc, payload) in zip(wanted, encode_many(pairs)):
            region = _Region(name, peer, box, None, count, enc, payload,
                             new.numel() * new.element_size())
            if not forwarded:
                self._count(region, 0 if payload is None else payload.numel())
            out.append(region)
        return out

    def _exchange(self, sends: list[_Region], recvs: list[_Region],
                  forwarded: bool = False) -> None:
        """Two rounds: every peer's headers, then every peer's payloads (one message each)."""
        out = _by_peer(sends)
        into = _by_peer(recvs)
        headers_out, payloads_out = {}, {}
        for peer, regions in out.items():
            words = [w for r in regions for w in
                     (r.count * 16 + r.enc, 0 if r.payload is None else r.payload.numel())]
            headers_out[peer] = torch.tensor(words, dtype=torch.int64, device=self._ctl)
            parts = [r.payload.reshape(-1) for r in regions if r.payload is not None]
            if parts:
                payloads_out[peer] = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        headers_in = {peer: torch.empty(HEADER_WORDS * len(regions), dtype=torch.int64,
                                        device=self._ctl) for peer, regions in into.items()}
        with self._p2p.round():
            for peer, header in headers_out.items():
                self._p2p.send(header, peer, _TAG)
            for peer, header in headers_in.items():
                self._p2p.recv(header, peer, _TAG)
        announced = {peer: self._check(into[peer], header.tolist())
                     for peer, header in headers_in.items()}
        payloads_in = {peer: torch.empty(sum(n for _, _, n in got), dtype=torch.uint8,
                                         device=into[peer][0].view.device)
                       for peer, got in announced.items() if any(n for _, _, n in got)}
        with self._p2p.round():
            for peer, payload in payloads_out.items():
                self._p2p.send(payload, peer, _TAG)
            for peer, payload in payloads_in.items():
                self._p2p.recv(payload, peer, _TAG)
        writes, labels = [], []
        for peer, got in announced.items():
            at = 0
            for region, (count, enc, nbytes) in zip(into[peer], got):
                part = payloads_in[peer][at:at + nbytes] if nbytes else None
                at += nbytes
                writes.append((region.view, count, enc, part))
                labels.append(f"{region.name}: dst group rank {self.rank}, delta from group "
                              f"rank {region.peer} for box {list(region.box)}")
                region.count, region.enc = count, enc
                self._count(region, nbytes)
        apply_many(writes, labels)  # on CUDA: one host read for the batch's checks
        if self.on_apply is not None:
            self.on_apply(writes)
        # src: the messages it sent; dst: those it received (forwards count as forwarded)
        self.tally.messages += len(headers_in) + len(payloads_in) + \
            (0 if forwarded else len(headers_out) + len(payloads_out))
        if forwarded:
            self.tally.forwarded_bytes += sum(HEADER_BYTES + (0 if r.payload is None else
                                                              r.payload.numel()) for r in sends)

    def _check(self, regions: list[_Region], words: list[int]) -> list[tuple[int, int, int]]:
        """Each region's ``(count, encoding, payload bytes)``; a header that cannot fit its
        box is refused before any payload is received."""
        out = []
        for k, region in enumerate(regions):
            word, nbytes = words[2 * k], words[2 * k + 1]
            count, enc = word >> 4, word & 15
            numel = box_numel(region.box)
            why = header_problem(numel, region.view.element_size(), count, enc, nbytes)
            if why:
                # the peer is still consistent (it sent what it announced): raise here, the
                # fault board tells the others
                raise DeltaTransportError(
                    f"{region.name}: dst group rank {self.rank} got a delta header from group "
                    f"rank {region.peer} for box {list(region.box)} ({numel} elements) that "
                    f"does not fit: {why}")
            out.append((count, enc, nbytes))
        return out

    def _count(self, region: _Region, nbytes: int) -> None:
        self.tally.ops += 1
        self.tally.wire_bytes += HEADER_BYTES + nbytes
        self.tally.full_bytes += region.full or (region.view.numel() * region.view.element_size())
        self.tally.changed += region.count
        key = encoding_name(region.enc)
        self.tally.encodings[key] = self.tally.encodings.get(key, 0) + 1


def _by_peer(regions: list[_Region]) -> dict[int, list[_Region]]:
    out: dict[int, list[_Region]] = {}
    for r in regions:
        out.setdefault(r.peer, []).append(r)
    return dict(sorted(out.items()))


__all__ = ["DeltaMover", "DeltaTally"]
