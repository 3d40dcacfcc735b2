"""The soak's leak figures (``tools.soak``): slopes with their noise band, what failed groups
leave behind per fault, and the host's shared memory left by dead processes.

A slope alone does not say "flat": RSS moves by a few MiB between samples for reasons that
are not leaks (allocator arenas, caches warming). So each figure gets its least-squares
slope per 1,000 refits and a band of two standard errors around it (from the fit's
residuals); ``flat`` means the band contains zero, i.e. a growth this run cannot tell from
its noise. A figure that is a count (sockets, threads) and never moved has a band of 0.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import Iterable, Mapping, Optional, Sequence

from megatron_reshard.tools.soak_growth import TURNS, attribute, window_row

SHM_DIR = "/dev/shm"
# per failed group: what a survivor may be left holding once the group has been let go
LEFTOVER_METRICS = ("threads", "sockets", "fds", "shm", "groups_alive", "children")
# the figures whose every sample the report keeps (the longest-lived process of each role)
SERIES = ("rss_mib", "rss_trimmed_mib", "py_blocks", "cpu_tensor_mib", "fds", "sockets",
          "threads", "orphan_segment_mib")
_SEGMENT = re.compile(r"torch_(\d+)_")


def slope(points: Sequence[tuple[float, float]]) -> Optional[float]:
    """Least-squares slope of ``(x, y)`` points; None with fewer than 3 or no spread in x."""
    fit = slope_band(points)
    return None if fit is None else fit[0]


def slope_band(points: Sequence[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """(slope, its standard error) of the least-squares line through ``points``; None with
    fewer than 3 points or no spread in x."""
    n = len(points)
    if n < 3:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    k = sum((x - mx) * (y - my) for x, y in points) / sxx
    residual = sum((y - my - k * (x - mx)) ** 2 for x, y in points)
    return k, math.sqrt(residual / (n - 2) / sxx)


def figure(points: Sequence[tuple[float, float]]) -> Optional[dict]:
    """One sampled figure: slope per 1,000 refits, ± two standard errors, flat or not,
    the slope over the later half of the samples (a process's warm-up, caches filling,
    flattens out there; a leak keeps its slope), first / last / max value."""
    fit = slope_band(points)
    if fit is None:
        return None
    k, se = fit[0] * 1000, fit[1] * 1000
    late = slope_band(points[len(points) // 2:])
    return {"per_1000_refits": round(k, 3), "band_2se": round(2 * se, 3),
            "flat": abs(k) <= 2 * se,
            "late_per_1000_refits": None if late is None else round(late[0] * 1000, 3),
            "late_band_2se": None if late is None else round(2 * late[1] * 1000, 3),
            "first": round(points[0][1], 2), "last": round(points[-1][1], 2),
            "max": round(max(y for _, y in points), 2)}


def leak_slopes(lives: Sequence[Mapping]) -> dict:
    """Per role, each sampled figure (``figure``) over the longest-lived process of that role
    (``lives``: {"role", "samples": [(refit, {metric: value})]}), the span of refits it
    covers, and the samples of the figures in ``SERIES``."""
    out: dict[str, dict] = {}
    for role in sorted({life["role"] for life in lives}):
        longest = max((life for life in lives if life["role"] == role),
                      key=lambda life: len(life["samples"]))
        samples = longest["samples"]
        if len(samples) < 3:
            continue
        metrics = sorted({k for _, s in samples for k in s} - {TURNS})  # a count, not a leak
        figures = {}
        for m in metrics:
            fig = figure([(r, s[m]) for r, s in samples if m in s])
            if fig is not None:
                figures[m] = fig
        out[role] = {"refits": [samples[0][0], samples[-1][0]], "samples": len(samples),
                     "figures": figures, "pid": longest.get("pid"),
                     "series": {m: [[r, round(s[m], 3)] for r, s in samples if m in s]
                                for m in SERIES if any(m in s for _, s in samples)}}
    return out


class Leftovers:
    """What failed groups leave on the ranks that survive them, per fault and per role.

    The soak's leak samples are settled (taken once every failed group has been let go: its
    timeout + the retire margin passed), so each finds the ranks with one healthy group.
    Between two settled samples, what a rank alive at both gained is what the window's
    failed groups left behind, if the window had faults (``faults`` of them, shared: one
    window may hold several), or what plain refits left, if it had none. Net figures (a
    drop counts), summed over the ranks of a role. A process's one-time set-up that
    happens to fall in a window counts there too (a training rank's first colocated group
    starts its ``torch_shm_manager``: a child, a few fds), so a figure is a leak only if it
    keeps growing with the faults (the slopes)."""

    def __init__(self) -> None:
        self.last: dict[tuple, dict] = {}  # (role, pid) -> figures at the last settled sample
        self.last_faults: dict[str, int] = {}  # the soak's faults by kind then
        self.last_refits = 0
        self.sampled: Counter = Counter()  # (role, pid) -> settled samples so far
        # {"refits", "faults", "kinds": {kind: n}, "grew": {role: {metric: net}}}
        self.windows: list[dict] = []

    def settled(self, refits: int, faults: Mapping[str, int],
                samples: Mapping[tuple, dict]) -> None:
        """A settled sample of the live ranks ((role, pid) -> figures) after ``refits``
        refits and ``faults`` (by kind) in all."""
        kinds = {k: n - self.last_faults.get(k, 0) for k, n in faults.items()
                 if n != self.last_faults.get(k, 0)}
        if self.last:
            grew: dict[str, dict] = {}
            for key in sorted(set(self.last) & set(samples)):
                role = grew.setdefault(key[0], dict.fromkeys(LEFTOVER_METRICS, 0.0))
                for m in LEFTOVER_METRICS:
                    role[m] += samples[key].get(m, 0) - self.last[key].get(m, 0)
            self.windows.append({"refits": refits, "faults": sum(kinds.values()),
                                 "kinds": kinds, "grew": grew, "span": refits - self.last_refits,
                                 **window_row(self.last, samples,
                                              [k for k in samples if self.sampled[k] < 2])})
        self.sampled.update(samples.keys())
        self.last = {key: dict(s) for key, s in samples.items()}
        self.last_faults, self.last_refits = dict(faults), refits

    def report(self) -> dict:
        """Per role: what its survivors gained per fault over the windows with faults, and
        in all over the windows without; the window with faults that gained the most."""
        hit = [w for w in self.windows if w["faults"]]
        faults = sum(w["faults"] for w in hit)
        roles = sorted({r for w in self.windows for r in w["grew"]})

        def total(windows, role, m):
            return sum(w["grew"].get(role, {}).get(m, 0.0) for w in windows)

        quiet = [w for w in self.windows if not w["faults"]]
        worst = max(hit, default=None, key=lambda w: sum(
            max(0.0, v) for g in w["grew"].values() for v in g.values()))
        return {"faults_measured": faults, "windows_with_faults": len(hit),
                "windows_without_faults": len(quiet),
                "per_fault": {r: {m: round(total(hit, r, m) / faults, 3) if faults else 0.0
                                  for m in LEFTOVER_METRICS} for r in roles},
                "without_faults_total": {r: {m: round(total(quiet, r, m), 3)
                                             for m in LEFTOVER_METRICS} for r in roles},
                "worst_window": worst and {k: v for k, v in worst.items() if k != "growth"},
                "growth_by_event": attribute(self.windows),
                "growth_windows": [{k: w[k] for k in ("refits", "span", "faults", "kinds",
                                                      "switches", "growth")} for w in self.windows]}


def orphan_segments(pids: Iterable[int], shm_dir: str = SHM_DIR) -> dict:
    """Torch shared-memory segments created by ``pids`` (the soak's ranks) whose process is
    gone: what a dead owner's manager failed to unlink (count and MiB)."""
    pids = set(pids)
    count, nbytes = 0, 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return {"orphan_segments": 0, "orphan_segment_mib": 0.0}
    for name in names:
        m = _SEGMENT.match(name)
        if m is None or int(m.group(1)) not in pids or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        try:
            nbytes += os.stat(os.path.join(shm_dir, name)).st_size
            count += 1
        except OSError:
            continue  # unlinked meanwhile
    return {"orphan_segments": count, "orphan_segment_mib": round(nbytes / 2**20, 3)}


__all__ = ["LEFTOVER_METRICS", "Leftovers", "figure", "leak_slopes", "orphan_segments",
           "slope", "slope_band"]
