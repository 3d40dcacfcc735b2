"""The proof every built plan passes: each destination element is written exactly once.

Run by ``Planner.plan`` on every rank when a plan is built; a failure is a planner bug,
never bad input, and nothing has moved yet.
"""

from __future__ import annotations

from ..errors import MegatronReshardError
from megatron_reshard.layout.geometry import Box, box_intersect, box_numel
from .param_plan import ParamPlan


class PlanError(MegatronReshardError, RuntimeError):
    """A plan that would leave a destination element unwritten or write it twice (a bug)."""


def check_writes_exactly_once(plan: ParamPlan) -> None:
    """Prove that the plan writes every element of every destination piece exactly once.

    Per destination (rank, piece): every op box lies inside the piece's box, no two op
    boxes overlap, and their sizes add up to the piece's. Linear in the ops but for the
    pairwise overlap test inside one piece (a handful of boxes). Run on every rank when a
    plan is built; a failure is a planner bug, never bad input, and nothing has moved yet.
    """
    by_piece: dict = {}
    for op in plan.ops:
        by_piece.setdefault((op.dst, op.dst_piece), []).append(op.box)
    for rank, own in plan.dst.items():
        for index, piece in enumerate(own.pieces):
            boxes = by_piece.pop((rank, index), [])
            problem = _tiling_problem(piece.box, boxes)
            if problem:
                raise PlanError(f"plan for layout {plan.key!r}: destination rank {rank}, piece "
                                f"{index} {list(piece.box)}: {problem}")
    if by_piece:
        raise PlanError(f"plan for layout {plan.key!r}: ops write pieces no destination has: "
                        f"{sorted(by_piece)}")


def _tiling_problem(target: Box, boxes: list) -> str:
    for b in boxes:
        if box_intersect(b, target) != tuple(b):
            return f"op box {list(b)} reaches outside it"
    total = sum(box_numel(b) for b in boxes)
    if total != box_numel(target):
        return f"ops write {total} elements of its {box_numel(target)}"
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b[0][0] >= a[0][1]:
                break  # sorted by the first dim's start: no later box reaches back into a
            if box_intersect(a, b) is not None:
                return f"op boxes {list(a)} and {list(b)} overlap"
    return ""
