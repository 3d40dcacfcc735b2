"""A refit loop's delta work of one stage in one run (``refit.loop``; the delta package
moves the params): which params of an opened batch move as deltas, what the training
side's base keeps of a full refit, and the stages' tallies summed. Torch + stdlib only
(the receiver imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DeltaStage:
    """One stage's delta work in one run: ``mover`` (delta mode) moves the eligible params;
    ``base`` (training side, full mode) keeps what the engine sent of them."""

    plans: list
    mover: Any
    base: Any

    def move(self, batch: Any, params: list) -> list:
        """Move the batch's eligible params as deltas; the engine's transfers left."""
        if self.mover is None:
            return batch.transfers
        bufs = {o.index: o.ctx.buf for o in batch.opened}
        rest, items = [], []
        for offset, transfer in enumerate(batch.transfers):
            index = batch.start + offset
            if self.plans[index] is None:
                rest.append(transfer)
                self.mover.tally.full_params += index in bufs
            else:
                items.append((index, params[index].name, bufs.get(index)))
        if items:  # one exchange per batch: two messages per peer (delta.mover)
            self.mover.move_batch(items)
        return rest

    def keep(self, batch: Any) -> None:
        if self.mover is None and self.base is not None:
            for o in batch.opened:
                if self.plans[o.index] is not None:
                    self.base.capture(o.index, o.ctx.buf)


def merged_tallies(tallies: list[dict]) -> dict:
    """The delta movers' tallies of a run's stages, summed (``RefitStats.delta``)."""
    counts = ("params", "ops", "messages", "wire_bytes", "full_bytes", "held_bytes",
              "forwarded_bytes", "changed", "full_params")
    out = {**{k: 0 for k in counts}, "encodings": {}}
    for t in tallies:
        for k in counts:
            out[k] += t[k]
        for k, n in t["encodings"].items():
            out["encodings"][k] = out["encodings"].get(k, 0) + n
    return out


__all__ = ["DeltaStage", "merged_tallies"]
