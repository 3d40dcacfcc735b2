"""A delta refit's payloads kept for the flip of a staged refit (issue 53).

Torch + stdlib only. During a staged delta refit the delta transport applies each region's
payload into the staging tensors (so phase-1 forwards, checksums and the commit vote see the
result exactly as in an in-place refit) and hands the same ``(view, count, encoding,
payload)`` to ``StagedDeltas.record`` (``RefitLoop.on_delta_apply``). At the flip those
payloads are applied once more, into the live params: the live storage holds version N,
the base every delta was cut from (checked first, ``receiver.flip_base``: a param written
since the start is copied whole instead), so the result is bit-identical to the staging
copy, and the pause writes the changed elements only instead of every staged byte. Params
the refit wrote through the full path as well (not eligible for deltas, packed params, a
fused target mixing both) are copied whole from staging instead (``full_path_targets``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Optional

import torch

from megatron_reshard.delta.encoding import apply_many
from megatron_reshard.errors import BadInputError


class StagedDelta(NamedTuple):
    """One region's delta, as it will be applied to the live param ``target``."""

    target: str                 # the model's param (vLLM name) the region lies in
    live: torch.Tensor          # the region's view of the live param
    count: int
    enc: int
    payload: Optional[torch.Tensor]


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def live_view(view: torch.Tensor, staging: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The view of ``live`` at the place ``view`` takes in ``staging`` (same size and strides
    in elements of ``view``'s dtype). ``staging`` and ``live`` have the same size, strides
    and dtype (``staging_tiers.allocate``), so a byte offset in one is the same in the other."""
    offset = (view.storage_offset() * view.element_size()
              - staging.storage_offset() * staging.element_size()
              + live.storage_offset() * live.element_size())
    if offset % view.element_size():
        raise BadInputError(f"a region at byte {offset} of a {live.dtype} param cannot be seen "
                         f"as {view.dtype}")
    out = torch.empty(0, dtype=view.dtype, device=live.device)
    return out.set_(live.untyped_storage(), offset // view.element_size(), view.size(),
                    view.stride())


class StagedDeltas:
    """The deltas a staged refit applied into staging tensors, to apply into the live
    params at the flip."""

    def __init__(self, staging: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]):
        self.staging = staging
        self.live = live
        self._by_storage = {storage_key(t): n for n, t in staging.items()}
        self.regions: list[StagedDelta] = []

    def clear(self) -> None:
        self.regions = []

    def record(self, writes: Iterable[tuple]) -> None:
        """``(view, count, encoding, payload)`` the delta transport just applied. Views of a
        staging tensor are kept (their payloads stay alive with them); views of a live
        param (an in-place param beyond the budget) were written where they go."""
        for view, count, enc, payload in writes:
            target = self._by_storage.get(storage_key(view))
            if target is None:
                continue
            self.regions.append(StagedDelta(
                target, live_view(view, self.staging[target], self.live[target]),
                count, enc, payload))

    @property
    def payload_bytes(self) -> int:
        return sum(0 if r.payload is None else r.payload.numel() for r in self.regions)

    def payload_bytes_by_target(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.regions:
            out[r.target] = out.get(r.target, 0) + (0 if r.payload is None else r.payload.numel())
        return out

    def targets(self) -> set:
        return {r.target for r in self.regions}

    def apply(self, skip: Iterable[str] = ()) -> int:
        """Apply the recorded deltas into the live params, except those of ``skip`` (copied
        whole instead). The number of regions applied."""
        skip = set(skip)
        todo = [r for r in self.regions if r.target not in skip]
        with torch.no_grad():
            apply_many([(r.live, r.count, r.enc, r.payload) for r in todo],
                       [f"{r.target}: staged delta at the flip" for r in todo])
        return len(todo)


def full_path_targets(session: Any) -> set:
    """The model's params a delta refit of ``session`` writes other than as deltas: those of
    bulk params without a delta plan (a local copy, a weight this rank quantizes) and of the
    packed params (always full). Payload-derived, like the eligibility itself."""
    loop = session.loop
    plans = loop.delta_plans or {}
    hf_names = [record.name for stage, records in loop.stages.items()
                for record, plan in zip(records, plans.get(stage, [None] * len(records)))
                if plan is None]
    hf_names += [name for items in session.misc_items.values() for name, _, _ in items]
    return session.targets_written_by(hf_names)


__all__ = ["StagedDelta", "StagedDeltas", "full_path_targets", "live_view"]
