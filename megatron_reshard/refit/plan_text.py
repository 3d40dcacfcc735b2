"""What a plan mismatch says: the parts of a refit plan that differ between the ranks of a
group, by the names the user sets them under, and how to fix each (``refit.loop``'s plan
check). Stdlib only."""

from __future__ import annotations

from typing import Sequence

PLANNERS = ("default", "link", "auto")  # codes 0, 1, 2 in the plan check's row

# what each part of a plan is called where the user sets it, and what to do when it differs
_PART_HINTS = {
    "transfers": ("the ordered transfer list", "build every rank's plan from the same payload"),
    "misc_items": ("misc_items", "pass misc_items (refit.order.misc_items_by_stage) on both "
                                 "sides, or on neither"),
    "batch_bytes": ("batch_bytes", "pass the same batch_bytes on every rank"),
    "staging_bytes": ("staging_bytes", "pass the same staging_bytes on every rank"),
    "checksums": ("verify_checksums", "pass the same verify_checksums on both sides "
                                      "(RefitSender(verify_checksums=...) on the training "
                                      "side, prepare_refit's {'verify_checksums': ...} on "
                                      "the generation side)"),
    "planner": ("planner", "pass the same planner on both sides (RefitSender(planner=...) "
                           "on the training side, ReceiverSession(planner=...) / "
                           "prepare_refit's {'planner': ...} on the generation side)"),
}


def plan_mismatch_text(names: Sequence[str], rows: Sequence[Sequence[int]]) -> str:
    """Name exactly the plan parts that differ between group ranks: ``rows[r]`` is group
    rank r's ``[transfer count, *part values]`` in the order of ``names``."""
    out = []
    for i, name in enumerate(names, start=1):
        by_value: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            by_value.setdefault(row[i], []).append(rank)
        if len(by_value) < 2:
            continue
        label, hint = _PART_HINTS.get(name, (name, f"pass the same {name} on every rank"))
        if name == "planner":
            shown = {repr(PLANNERS[v]) if 0 <= v < len(PLANNERS) else v: r
                     for v, r in by_value.items()}
        elif name == "checksums":
            shown = {bool(v): r for v, r in by_value.items()}
        elif name == "misc_items":
            shown = {("none given" if v < 0 else f"{v:#x}"): r for v, r in by_value.items()}
        elif name == "transfers":
            counts = {rank: row[0] for rank, row in enumerate(rows)}
            shown = {f"{v:#x} ({counts[r[0]]} transfers)": r for v, r in by_value.items()}
        else:
            shown = by_value
        values = "; ".join(f"{v} on group rank(s) {r}" for v, r in shown.items())
        out.append(f"{label} differs ({values}): {hint}")
    return ". ".join(out) or "the plan fingerprints differ (no single part does)"


__all__ = ["PLANNERS", "plan_mismatch_text"]
