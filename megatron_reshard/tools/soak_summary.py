"""The soak's report in a few lines (``tools.soak``): counts, invariants, leaks."""

from __future__ import annotations

from megatron_reshard.tools.soak_checks import MARGIN_S
from megatron_reshard.tools.soak_growth import summary as growth_summary


def summary_lines(report: dict) -> list[str]:
    """The report in a few lines: counts, invariants, leaks."""
    c = report["counters"]
    lines = [f"refits {report['refits']} ({report['committed']} committed; modes "
             f"{report['modes']}), faults {report['faults']}: {report['faults_by_kind']}",
             f"silent outcomes {report['silent_outcomes']} (by fault: {report['silent_by_fault']}), "
             f"hangs {report['hangs']}, violations {report['violations'] or 'none'}",
             "invariants: " + ", ".join(f"{k} {c[k]}" for k in (
                 "weights_exact", "weights_inconsistent_said", "versions_checked",
                 "survivor_in_time", "survivor_named_cause", "delta_base_checked",
                 "old_version_refused", "bad_payload_refused") if k in c),
             f"worst survivor failure {c.get('survivor_worst_ms', 0) / 1000:.2f} s after its "
             f"fault (timeout {report['config']['timeout_s']:g} s + {MARGIN_S:g} s)"]
    for role, leak in report["leaks"].items():
        figs = ", ".join(f"{m} {f['per_1000_refits']:+g} ± {f['band_2se']:g}/1000"
                         f"{' (flat)' if f['flat'] else ''} ({f['first']:g}->{f['last']:g})"
                         for m, f in leak["figures"].items())
        lines.append(f"leaks {role} (refits {leak['refits'][0]}-{leak['refits'][1]}): {figs}")
    left = report.get("failed_group_leftovers")
    if left and left["faults_measured"]:
        for role, per in left["per_fault"].items():
            lines.append(f"failed groups' leftovers per fault on the {role} survivors ("
                         f"{left['faults_measured']} faults): "
                         + ", ".join(f"{m} {v:+g}" for m, v in per.items()))
    if left:
        lines += growth_summary(left.get("growth_by_event", {}))
    return lines


__all__ = ["summary_lines"]
