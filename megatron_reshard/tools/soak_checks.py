"""The soak's invariants (``tools.soak``): named counters, each check a plain function of
what the ranks reported (the leak figures: ``tools.soak_leaks``).

Invariants (issue 52), checked after every refit and every fault:

- ``weights``: a generation rank's weights equal the independent reference for the version
  its weight state reports, or the state says they do not (``inconsistent``). A
  ``consistent`` state over other bytes is a *silent outcome*, the worst there is. Under an
  ``inconsistent`` state every param it does not list as overwritten must still equal the
  reference of ``started_from`` (what the README promises), params the soak itself wrote
  behind the library's back excepted;
- ``versions``: a generation worker's version never decreases, and a committed refit
  reports the version it was sent with;
- ``survivors``: after a fault, every survivor fails within the group's timeout + 5 s with
  an error that names the cause; ``hangs``: a rank that has not answered long after that;
- ``delta base``: a delta refit is applied only onto the bytes its sender cut it against.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable, Mapping, Optional

from megatron_reshard.tools.soak_leaks import leak_slopes, slope  # noqa: F401 - re-exported

MARGIN_S = 5.0  # the bound on a survivor's failure: the group's timeout + 5 s
# words a survivor's error uses when it names what happened to its peer
_CAUSE = re.compile(r"exited|killed|stopped|no sign of life|unreachable|timed out|timeout|"
                    r"closed|connection|train rank|generation worker|refit payload|payload|"
                    r"checksum", re.IGNORECASE)
EXAMPLES = 5  # violations kept per counter, for the report


class Tally:
    """Named counters and the first few examples of each violation."""

    # counters whose non-zero value breaks an invariant
    VIOLATIONS = ("silent_wrong_weights", "inconsistent_state_wrong", "version_decreased",
                  "version_mismatch", "survivor_late", "survivor_no_cause", "survivor_no_error",
                  "hangs", "delta_onto_wrong_base", "old_version_accepted",
                  "bad_payload_accepted", "full_expected_got_delta")

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.examples: dict[str, list] = {}
        self.silent_by_fault: Counter = Counter()
        self.by_cause: dict[str, Counter] = {}  # violation -> the fault it followed -> count

    def ok(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def bad(self, name: str, example: Any, cause: Optional[str] = None) -> None:
        """One violation of ``name``; ``cause``: the fault it followed (None: no fault)."""
        self.counts[name] += 1
        if cause is None and isinstance(example, dict):
            cause = example.get("where")  # the soak's step: a fault's kind, or "refit"
        causes = self.by_cause.setdefault(name, Counter())
        causes[cause or "none"] += 1
        kept = self.examples.setdefault(name, [])
        if len(kept) < EXAMPLES or causes[cause or "none"] == 1:  # each cause's first too
            kept.append(example)

    def violations(self) -> dict[str, int]:
        return {k: self.counts[k] for k in self.VIOLATIONS if self.counts[k]}

    def as_dict(self) -> dict:
        return {"counters": {k: self.counts[k] for k in sorted(set(self.counts) | set(self.VIOLATIONS))},
                "violations": self.violations(), "silent_by_fault": dict(self.silent_by_fault),
                "violations_by_fault": {k: dict(v) for k, v in self.by_cause.items()},
                "examples": self.examples}


def check_weights(tally: Tally, gen_rank: int, reply: Mapping, refs: Mapping[int, Mapping],
                  written: Iterable[str], cause: Optional[str], where: str) -> bool:
    """The weight invariant on one generation rank's reply (``state`` and ``after``
    digests); ``refs``: version -> gen rank -> digests; ``written``: params the soak wrote
    behind the library's back since they were last refitted. True when the weights are
    what the state says."""
    state, actual = reply["state"], reply["after"]
    if state["state"] == "consistent":
        version = state["version"]
        if version is None or version not in refs:
            tally.ok("weights_unversioned")  # a fresh worker: nothing refitted yet
            return True
        want = refs[version][gen_rank]
        wrong = sorted(n for n in actual if want.get(n) != actual[n])
        if wrong:
            tally.bad("silent_wrong_weights", {"where": where, "gen_rank": gen_rank,
                                               "version": version, "params": wrong[:5],
                                               "of": len(wrong), "after_fault": cause}, cause)
            tally.silent_by_fault[cause or "none"] += 1
            return False
        tally.ok("weights_exact")
        return True
    base = state.get("started_from")
    if base is None or base not in refs:
        tally.ok("weights_inconsistent_said")
        return True
    want = refs[base][gen_rank]
    unlisted = set(actual) - set(state["overwritten"]) - set(written)
    wrong = sorted(n for n in unlisted if want.get(n) != actual[n])
    if wrong:
        tally.bad("inconsistent_state_wrong", {"where": where, "gen_rank": gen_rank,
                                               "started_from": base, "params": wrong[:5],
                                               "after_fault": cause}, cause)
        return False
    tally.ok("weights_inconsistent_said")
    return True


def check_version(tally: Tally, last: Optional[int], state: Mapping, where: str) -> Optional[int]:
    """A worker's version never decreases; returns the version it now holds."""
    version = state.get("version")
    if version is not None and last is not None and version < last:
        tally.bad("version_decreased", {"where": where, "was": last, "now": version})
        return version
    tally.ok("versions_checked")
    return version if version is not None else last


def check_delta_base(tally: Tally, gen_rank: int, reply: Mapping, refs: Mapping,
                     base_version: Optional[int], where: str) -> None:
    """A delta refit's generation rank held, before it, the bytes of the version its
    sender cut the delta against."""
    if reply.get("mode") != "delta":
        return
    want = refs.get(base_version, {}).get(gen_rank) if base_version is not None else None
    wrong = sorted(n for n in reply["before"] if want is None or want.get(n) != reply["before"][n])
    if wrong:
        tally.bad("delta_onto_wrong_base", {"where": where, "gen_rank": gen_rank,
                                            "base_version": base_version, "params": wrong[:5],
                                            "of": len(wrong)})
    else:
        tally.ok("delta_base_checked")


def check_survivor(tally: Tally, name: str, reply: Optional[Mapping], fault_at: float,
                   timeout_s: float, where: str) -> None:
    """A survivor of a fault failed within ``timeout_s`` + 5 s, naming the cause."""
    if reply is None or reply.get("error") is None:
        tally.bad("survivor_no_error", {"where": where, "rank": name,
                                        "reply": None if reply is None else "completed"})
        return
    took = reply["at"] - fault_at
    if took > timeout_s + MARGIN_S:
        tally.bad("survivor_late", {"where": where, "rank": name, "took_s": round(took, 2),
                                    "error": reply["error"][:300]})
    else:
        tally.ok("survivor_in_time")
    tally.counts["survivor_worst_ms"] = max(tally.counts["survivor_worst_ms"], int(took * 1000))
    if not _CAUSE.search(reply["error"]):
        tally.bad("survivor_no_cause", {"where": where, "rank": name, "error": reply["error"][:300]})
    else:
        tally.ok("survivor_named_cause")


__all__ = ["MARGIN_S", "Tally", "check_delta_base", "check_survivor", "check_version",
           "check_weights", "leak_slopes", "slope"]
