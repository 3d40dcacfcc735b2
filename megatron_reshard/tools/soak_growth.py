"""What each of the soak's events adds to a rank's memory (``tools.soak``): refits, faults
and model switches, apart.

A slope over a whole run (``soak_leaks.figure``) mixes them: the soak switches models
every ``--switch-every`` refits and injects faults at random, and each of those rebuilds
things a plain refit does not. Here each window between two settled samples gives one
row: the figure's growth over the window on the ranks of a role alive at both ends (their
mean; a process's first window, its warm-up, left out), against the window's refits,
faults and switches; a least-squares fit without an intercept, ``growth = a * refits +
b * faults + c * switches``, gives each event's share with its standard error. A leak in the library's refit path shows in ``a``, one in its
failure and rebuild path in ``b``; what the harness's switches cost is ``c``.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional, Sequence

GROWTH_METRICS = ("rss_trimmed_mib", "rss_mib")
TURNS = "model_turns"  # a rank's model turns so far: a live rank's count grows at a switch
EVENTS = ("per_1000_refits", "per_fault", "per_switch")
_SCALE = (1000.0, 1.0, 1.0)


def window_row(before: Mapping[tuple, dict], after: Mapping[tuple, dict],
               young: Iterable[tuple] = ()) -> dict:
    """One window: per role, the mean growth of each ``GROWTH_METRICS`` figure over the
    role's ranks ((role, pid) keys) sampled at both ends, but the ``young`` ones (in their
    first window: a process's warm-up, its pools' first allocations, is not a leak); and
    the switches in it (the most model turns any such rank took)."""
    both = sorted(set(before) & set(after) - set(young))
    growth: dict[str, dict[str, float]] = {}
    for role in sorted({key[0] for key in both}):
        keys = [k for k in both if k[0] == role]
        growth[role] = {m: sum(after[k][m] - before[k][m] for k in keys) / len(keys)
                        for m in GROWTH_METRICS
                        if all(m in after[k] and m in before[k] for k in keys)}
    switches = max((after[k].get(TURNS, 0) - before[k].get(TURNS, 0) for k in both), default=0)
    return {"growth": growth, "switches": switches}


def least_squares(rows: Sequence[tuple[Sequence[float], float]]) -> Optional[list]:
    """(coefficient, standard error) per column of ``rows`` ((x, y) pairs), fitted without
    an intercept; None for a column that is zero in every row; None in all when there are
    no more rows than fitted columns (no residual to estimate the error from)."""
    width = len(rows[0][0]) if rows else 0
    used = [j for j in range(width) if any(x[j] for x, _ in rows)]
    p, n = len(used), len(rows)
    if p == 0 or n <= p:
        return None
    xs = [[x[j] for j in used] for x, _ in rows]
    ys = [y for _, y in rows]
    inv = _inverse([[sum(r[i] * r[j] for r in xs) for j in range(p)] for i in range(p)])
    if inv is None:
        return None
    xty = [sum(r[i] * y for r, y in zip(xs, ys)) for i in range(p)]
    beta = [sum(inv[i][j] * xty[j] for j in range(p)) for i in range(p)]
    residual = sum((y - sum(b * v for b, v in zip(beta, r))) ** 2 for r, y in zip(xs, ys))
    s2 = residual / (n - p)
    out: list = [None] * width
    for i, j in enumerate(used):
        out[j] = (beta[i], math.sqrt(max(0.0, s2 * inv[i][i])))
    return out


def _inverse(a: list[list[float]]) -> Optional[list[list[float]]]:
    """Gauss-Jordan with partial pivoting; None for a singular matrix."""
    n = len(a)
    m = [row[:] + [float(i == j) for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        lead = m[col][col]
        m[col] = [v / lead for v in m[col]]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col])]
    return [row[n:] for row in m]


def attribute(windows: Sequence[Mapping]) -> dict:
    """Per role and figure: growth per 1,000 refits, per fault and per switch, each as
    [value, two standard errors] (None where the run had none of that event), and the
    windows fitted. ``windows``: {"span" (refits), "faults", "switches", "growth"}."""
    out: dict[str, dict] = {}
    roles = sorted({r for w in windows for r in w["growth"]})
    for role in roles:
        per_metric = {}
        for m in GROWTH_METRICS:
            rows = [((w["span"], w["faults"], w["switches"]), w["growth"][role][m])
                    for w in windows if m in w["growth"].get(role, {})]
            fit = least_squares(rows)
            if fit is None:
                continue
            per_metric[m] = {e: None if f is None else [round(f[0] * s, 3), round(2 * f[1] * s, 3)]
                             for e, f, s in zip(EVENTS, fit, _SCALE)}
            per_metric[m]["windows"] = len(rows)
        if per_metric:
            out[role] = per_metric
    return out


def summary(growth: Mapping[str, dict]) -> list[str]:
    """One line per role: each event's share of the trimmed RSS growth."""
    lines = []
    for role, per_metric in growth.items():
        fig = per_metric.get("rss_trimmed_mib")
        if fig is None:
            continue
        parts = [f"{e.replace('_', ' ')} {v[0]:+g} ± {v[1]:g} MiB" for e, v in
                 ((e, fig[e]) for e in EVENTS) if v is not None]
        lines.append(f"RSS trimmed on the {role} ranks, by event ({fig['windows']} settled "
                     f"windows): " + ", ".join(parts))
    return lines


__all__ = ["EVENTS", "GROWTH_METRICS", "TURNS", "attribute", "least_squares", "summary",
           "window_row"]
