"""A batch's description on one rank: validated, planned and cached per group.

Shared by both refit transports (``execute.xfer_batch`` and ``colocated.ColocatedTransport``
describe a batch with the same code, so they validate alike, share one ``Planner``'s caches
and agree on the same fingerprint). A rank's invalid input is not raised here:
``Rejected`` carries it to the caller, which tells every rank through the vote.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadInputError, MegatronReshardError
from .batch import Batch, kept_rows, layout_rows, light_key, rows_head
from .checks import Problem, check_layout_ranks
from .fuse import plan_fusion
from .plan import Planner, layout_key

MIN_STAGING_BYTES = 64
BACKENDS = ("python", "auto")  # both run this engine ("auto" stays for callers that pass it)


def describe_batch(transfers, world: int, me: int, staging_bytes: int, backend: str,
              planner: Planner, scope: Any) -> Batch:
    """The batch's cached state in ``planner`` for ``group`` (``scope``: the batch caches are
    the planner's per group), built (validated and planned) on a miss. Raises ``Rejected``
    with this rank's first problem (every rank is then told through the vote)."""
    if staging_bytes < MIN_STAGING_BYTES:
        raise Rejected(Problem(None, f"staging_bytes on rank {me} must be >= "
                                f"{MIN_STAGING_BYTES}, found {staging_bytes}"))
    if backend not in BACKENDS:
        raise Rejected(Problem(None, f"unknown backend on rank {me}: expected one of "
                                f"{BACKENDS}, found {backend!r}"))
    # first the rows a cached batch was built from (fast for the same objects), then
    # the light key (hashes placements: equal but new objects hit it too)
    head, rows = rows_head(me, staging_bytes, transfers), layout_rows(transfers)
    try:
        batch = planner.batch_by_rows(scope, head, rows)
    except (TypeError, RuntimeError):  # a field whose ``==`` is no bool (a tensor shape)
        batch = None
    if batch is not None:
        return batch
    light = light_key(transfers, world)
    bkey = None if light is None else (me, staging_bytes, light)
    try:
        batch = None if bkey is None else planner.batch(scope, bkey)
    except TypeError:  # unhashable placements (e.g. wire-form dicts): no caching
        light = bkey = batch = None
    if batch is None:
        keys = []
        for i, t in enumerate(transfers):
            where = f"param {getattr(t, 'name', f'#{i}')!r} on rank {me}"
            try:
                if t.dtype is None:
                    raise BadInputError(f"{where}: dtype is required, found None")

                def build(t=t, where=where):
                    key = layout_key(t.global_shape, t.src_mesh, t.src_placements,
                                     t.dst_mesh, t.dst_placements, where)
                    check_layout_ranks(key, world, where)
                    return key

                keys.append(build() if light is None else planner.layout(light[i].layout,
                                                                         build))
            except Exception as exc:  # whatever the description holds: every rank is told
                text = str(exc) if isinstance(exc, ValueError) else (
                    f"{where}: invalid description: {type(exc).__name__}: {exc}")
                raise Rejected(Problem(i, text)) from exc
        batch = Batch(transfers, planner.plan_all(keys), me)
        batch.fusion = plan_fusion(transfers, batch.plans, staging_bytes, planner)
        if bkey is not None:
            planner.remember_batch(scope, bkey, batch)
    kept = kept_rows(rows) if bkey is not None else None
    if kept is not None:
        planner.remember_rows(scope, head, batch, kept)
    return batch


class Rejected(MegatronReshardError):
    """This rank's description of a batch is invalid: ``problem`` says how (the vote
    carries it to every rank)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.text())
        self.problem = problem
