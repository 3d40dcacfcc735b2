"""A rank's schedule resolved into views of its tensors (``resolve.py``), and run.

Rounds: pack staged sends, post every send/recv of the round, run local copies while the
first round is in flight, wait, unpack staged receives. On CUDA the copies leave the
critical path on a side stream (``overlap.py``); rounds with nothing staged (direct
messages only) are posted without it.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import overlap
from .checks import picker
from .copies import Copies, address, address_bits, as_bits, as_words, flat_view, typed_view
from .overlap import EarlyPack
from .plan import Planner
from .resolve import resolve
from .schedule import Schedule
from .steps import StagePlan
from .p2p import P2PChannel


def _bits(tensors, k: int, cache: dict) -> int:
    """``address_bits`` of tensor k, once per copy batch."""
    got = cache.get(k)
    if got is None:
        got = cache[k] = address_bits(tensors[k])
    return got


class Program:
    """The schedule resolved for one set of tensor strides on this rank. Plain data;
    ``run`` only makes views and copies."""

    def __init__(self, sched: Schedule, transfers, plans, me: int) -> None:
        self._side = None  # CUDA side stream for pack/unpack, created on first use
        self.local, self.rounds, rows = resolve(sched, transfers, plans, me)
        # a kept batch's tensors compared by address; a permuted-row destination by its key
        self._address = address if rows else torch.Tensor.data_ptr
        self.staged = any(r.packs or r.unpacks for r in self.rounds)  # else: no staging
        # whole tensor to whole tensor, as they are: gathered in C on each call, no
        # Python step per copy (the other local steps make views)
        plain = [not s.flat and s.dst.view is None and s.src.view is None and not s.words
                 for s in self.local]
        whole = [s for s, p in zip(self.local, plain) if p]
        self._whole_dst = picker([s.dst.k for s in whole])
        self._whole_src = picker([s.src.k for s in whole])
        self._viewed = tuple(s for s, p in zip(self.local, plain) if not p)
        # the local copies' batch, kept for the addresses it was built for (see local_copies)
        self._local_ks = sorted({k for s in self.local for k in (s.dst.k, s.src.k)})
        self._local_pick = picker(self._local_ks)
        self._local_batch: Optional[tuple] = None
        self._staged: dict = {}    # (id(stage plan), pack) -> (addresses, Copies), CUDA
        self._stage_ks: dict = {}  # id(stage plan) -> picker of the tensors it reads or writes

    # ---- copies -----------------------------------------------------------------------

    def local_copies(self, tensors) -> None:
        """Run the local copies. Their batch of views is built once and kept for the
        addresses of the tensors it reads and writes: a refit passes the same tensors on
        every call, and building a view costs the host ~2 µs (a rank's 128 experts: ~1 ms
        a call). The strides are the program's key and the shapes, dtypes and devices are
        checked on every call (checks.py), so equal addresses mean equal views. The kept
        views hold the last call's tensors alive until the next call or ``release``."""
        if not self.local:
            return
        addresses = tuple(map(self._address, self._local_pick(tensors)))
        kept = self._local_batch
        if kept is None or kept[0] != addresses:
            kept = self._local_batch = (addresses, self._local_batch_for(tensors))
        kept[1].run()

    def kept_local(self) -> Optional[Copies]:
        """The kept batch of local copies where they are all this program runs (no
        rounds), else None (``lane.py`` runs it again for the same tensors)."""
        if self.rounds or self._local_batch is None:
            return None
        return self._local_batch[1]

    def release(self) -> None:
        """Drop the kept batches of copies (and the tensors and slots they hold)."""
        self._local_batch = None
        self._staged.clear()

    def _local_batch_for(self, tensors) -> Copies:
        copies, bits = Copies(), {}
        copies.many(self._whole_dst(tensors), self._whole_src(tensors))
        for step in self._viewed:
            if step.flat:
                copies.flat(flat_view(tensors, step.dst), flat_view(tensors, step.src),
                            step.nbytes)
                continue
            dst, src = typed_view(tensors, step.dst), typed_view(tensors, step.src)
            w = step.words
            if w and (_bits(tensors, step.dst.k, bits) | _bits(tensors, step.src.k, bits)
                      | step.skew) % w == 0:
                dst, src = as_words(dst, w), as_words(src, w)
            copies.exact(dst, src)
        return copies

    def stage(self, buf, plan: StagePlan, tensors, pack: bool) -> None:
        """Copy segments into (pack) or out of the staging buffer. On CUDA the staging
        slots are kept across calls, so the batch of views is kept too, for the addresses
        of the slot and the tensors it was built for (as ``local_copies``); on CPU each
        round has a new buffer and the batch is built for the call."""
        if buf.device.type == "cpu":
            batch = _stage_batch(buf, plan, tensors, pack)
            if batch is not None:
                batch.run()
            return
        pick = self._stage_ks.get(id(plan))
        if pick is None:  # gathered in C on each call (a rank's 128 experts, unpacked)
            pick = self._stage_ks[id(plan)] = picker(
                plan.ks if plan.elements is not None else
                sorted({c.ref.k for c in (*plan.flat, *plan.typed)}))
        addresses = (buf.data_ptr(), *map(self._address, pick(tensors)))
        kept = self._staged.get((id(plan), pack))
        if kept is None or kept[0] != addresses:
            kept = self._staged[(id(plan), pack)] = (
                addresses, _stage_batch(buf, plan, tensors, pack))
        kept[1].run()

    def post(self, buf, posts, tensors, channel: P2PChannel, local_done: bool) -> bool:
        """Post one round's sends and receives (waited for on exit); the local copies run
        during the first round, overlapping its transfers. Returns whether they ran."""
        with channel.round():
            for p in posts:
                tensor = (buf[p.offset: p.offset + p.nbytes] if p.ref is None
                          else flat_view(tensors, p.ref))
                (channel.send if p.is_send else channel.recv)(tensor, p.peer, p.tag)
            if not local_done:
                self.local_copies(tensors)
                local_done = True
        return local_done

    # ---- CUDA side stream (overlap.py) --------------------------------------------------

    def side_stream(self, device) -> "torch.cuda.Stream":
        """The program's CUDA side stream for packs, unpacks and local copies."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def pack_ahead(self, tensors, channel: P2PChannel, planner: Planner,
                   ready: "torch.cuda.Event") -> Optional[EarlyPack]:
        """CUDA: the first round packed during the agreement step (``overlap.pack_ahead``)."""
        return overlap.pack_ahead(self, tensors, channel, planner, ready)

    def run(self, tensors, channel: P2PChannel, planner: Planner,
            early: Optional[EarlyPack] = None) -> None:
        if channel.device.type == "cuda" and (self.staged or (self.local and self.rounds)):
            overlap.run_overlapped(self, tensors, channel, planner, early)
            return
        local_done = False
        for rnd in self.rounds:
            if rnd.phase == 1 and not local_done:  # phase-1 sends may forward local copies
                self.local_copies(tensors)
                local_done = True
            buf = (torch.empty(rnd.nbytes, dtype=torch.uint8, device=channel.device)
                   if rnd.nbytes else None)
            if rnd.packs:
                self.stage(buf, rnd.packs, tensors, pack=True)
            local_done = self.post(buf, rnd.posts, tensors, channel, local_done)
            if rnd.unpacks:
                self.stage(buf, rnd.unpacks, tensors, pack=False)
            buf = None  # freed before the next round's: one round's buffer at a time
        if not local_done:
            self.local_copies(tensors)


def _stage_batch(buf, plan: StagePlan, tensors, pack: bool) -> Optional[Copies]:
    """The copies between the staging buffer's pieces and the tensors' views, or None when
    they were done at once (a CPU pack as one ``cat``). The pieces start at 16-byte
    aligned offsets: a typed segment goes as words whenever its tensor side can."""
    cpu_cat = pack and plan.whole and buf.device.type == "cpu"
    if plan.elements is not None:  # whole 1-D tensors of one dtype: as they are
        typed_buf = buf[:plan.nbytes].view(plan.dtype)
        if cpu_cat:
            torch.cat([tensors[k] for k in plan.ks], out=typed_buf)
            return None
        # off the CPU as integers: CUDA's foreach copy of a float dtype rewrites NaN
        # payloads (copies.py); a CPU copy of one dtype keeps every bit
        bits = (lambda x: x) if buf.device.type == "cpu" else as_bits
        pieces, copies = bits(typed_buf).split_with_sizes(plan.elements), Copies()
        for c in plan.flat:
            if pack:
                copies.flat(pieces[c.piece], bits(tensors[c.ref.k]), c.nbytes)
            else:
                copies.flat(bits(tensors[c.ref.k]), pieces[c.piece], c.nbytes)
        return copies
    if cpu_cat:
        # one cat instead of a copy per segment: 1,000 segments of 8 KiB on CPU, 1.4 ms
        # against 3.0 (each copy_ costs the host ~1.5 µs); not measured on CUDA yet
        torch.cat([flat_view(tensors, c.ref) for c in plan.flat], out=buf[:plan.nbytes])
        return None
    pieces = buf[:plan.nbytes].split_with_sizes(plan.sizes)
    copies, bits = Copies(), {}
    for c in plan.flat:
        if pack:
            copies.flat(pieces[c.piece], flat_view(tensors, c.ref), c.nbytes)
        else:
            copies.flat(flat_view(tensors, c.ref), pieces[c.piece], c.nbytes)
    for c in plan.typed:
        chunk, view = pieces[c.piece].view(c.dtype).view(c.shape), typed_view(tensors, c.ref)
        if c.words and (_bits(tensors, c.ref.k, bits) | c.skew) % c.words == 0:
            chunk, view = as_words(chunk, c.words), as_words(view, c.words)
        if pack:
            copies.exact(chunk, view)
        else:
            copies.exact(view, chunk)
    return copies
