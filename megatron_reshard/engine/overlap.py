"""CUDA: a program's copies kept off the critical path on a side stream.

Round k+1 is packed and round k-1 unpacked on the side stream while round k is on the
wire (two staging slots kept on the Planner, so the schedule is built with half the
budget), and with a cached schedule the first round is packed during the agreement step
(``pack_ahead``). The functions here drive a ``Program`` (program.py): its ``stage``,
``post`` and ``local_copies``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .plan import Planner
from .p2p import P2PTransport


class EarlyPack(NamedTuple):
    """The first round packed ahead on the side stream (``pack_ahead``)."""

    slots: list
    packed: "torch.cuda.Event"
    main: "torch.cuda.Stream"

    def discard(self) -> None:
        """The current stream waits for a pack that will not be used, so its slots are
        freed only after the side stream is done writing them."""
        self.main.wait_event(self.packed)


def slots(prog, device, planner: Planner) -> list:
    """The planner's staging slots for the current stream, big enough for every round."""
    return planner.staging_slots(device, max(r.nbytes for r in prog.rounds))


def pack_ahead(prog, tensors, transport: P2PTransport, planner: Planner,
               ready: "torch.cuda.Event") -> Optional[EarlyPack]:
    """Allocate the staging slots and pack the first round now, on the side stream once
    the current stream reaches ``ready``, so that the pack overlaps the agreement step.
    Returns the pack for ``run_overlapped``, or None when there is nothing to pack; a
    caller that does not go on to run calls its ``discard()``."""
    first = next((r for r in prog.rounds if r.phase == 0), None)
    if transport.device.type != "cuda" or first is None or not first.packs:
        return None
    device = transport.device
    main, side = torch.cuda.current_stream(device), prog.side_stream(device)
    held = slots(prog, device, planner)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        prog.stage(held[0], first.packs, tensors, pack=True)
        packed = torch.cuda.Event()
        packed.record(side)
    return EarlyPack(held, packed, main)


def run_overlapped(prog, tensors, transport: P2PTransport, planner: Planner,
                   early: Optional[EarlyPack]) -> None:
    """The copies of neighbouring rounds and the local copies run on a side stream
    during transfers.

    Per phase, with round k's buffer in slot k % 2: the side stream packs round k+1 while
    round k is on the wire, then waits for round k and unpacks it; the current stream
    only waits for a round's pack before posting it. The local copies go on the side
    stream after the first round is posted: on the current stream they would run before
    the round's NCCL kernel (NCCL's stream waits for the current one when the group is
    launched), so a 128 MiB local copy delayed the transfer by its whole duration. No
    host sync. Every stream is joined back into the current one before returning, so the
    slots and the callers' tensors are released in order.
    """
    device = transport.device
    main, side = torch.cuda.current_stream(device), prog.side_stream(device)
    held = (early.slots if early is not None else
            slots(prog, device, planner) if prog.staged else [None, None])
    local_done = not prog.local
    for phase in (0, 1):
        rounds = [r for r in prog.rounds if r.phase == phase]
        if not rounds:
            continue
        if phase == 1 and not local_done:  # phase-1 sends may forward local copies
            prog.local_copies(tensors)
            local_done = True
        packed: list = []

        def pack(k: int) -> None:
            with torch.cuda.stream(side):
                if rounds[k].packs:
                    prog.stage(held[k % 2], rounds[k].packs, tensors, pack=True)
                packed.append(torch.cuda.Event())
                packed[k].record(side)

        if phase == 0 and early is not None:
            packed.append(early.packed)
        else:
            side.wait_stream(main)  # data written on the current stream is visible
            pack(0)
        for k, rnd in enumerate(rounds):
            main.wait_event(packed[k])
            buf = held[k % 2]
            prog.post(buf, rnd.posts, tensors, transport, local_done=True)
            done = torch.cuda.Event()
            done.record(main)
            if k + 1 < len(rounds):
                # slot (k+1) % 2 held round k-1, which the side stream waited for already
                pack(k + 1)
            if not local_done:  # behind the first packs, alongside the first round
                with torch.cuda.stream(side):
                    prog.local_copies(tensors)
                local_done = True
            with torch.cuda.stream(side):
                side.wait_event(done)  # always: the next pack into this slot waits too
                if rnd.unpacks:
                    prog.stage(buf, rnd.unpacks, tensors, pack=False)
        main.wait_stream(side)
    if not local_done:
        prog.local_copies(tensors)
