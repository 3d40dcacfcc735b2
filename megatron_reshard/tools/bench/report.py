"""Benchmark reports: a markdown table, a JSON file, and a PNG plot when matplotlib exists.

Rows are plain dicts (JSON-ready); columns say which keys to show and how to format them.
Missing or non-finite values print as ``n/a`` in the table and ``null`` in the JSON.

Signatures::

    Column(key, header, fmt="{}")   # fmt: format string or callable (e.g. sig)
    format_table(rows, columns) -> str                       # markdown
    write_report(out_dir, rows, columns, *, meta=None, stem="results", plot=None)
        -> ReportPaths(markdown, json, png)                  # png None if not plotted
    plot_bandwidth(rows, path, *, label_key="case", series=None, title="") -> Optional[Path]
        # grouped bars of GB/s per row; returns None (and says why) without matplotlib
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

NA = "n/a"


def sig(value: float) -> str:
    """One decimal for figures >= 10, three significant digits below (CPU smoke figures)."""
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


@dataclass(frozen=True)
class Column:
    """``fmt``: a format string (``"{:.2f}"``) or a function of the value."""

    key: str
    header: str
    fmt: "str | Callable[[Any], str]" = "{}"

    def render(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return NA
        try:
            return self.fmt(value) if callable(self.fmt) else self.fmt.format(value)
        except (ValueError, TypeError):
            return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A GitHub-flavoured markdown table; ``|`` inside cells is escaped."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(c.header) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(c.render(row)) for c in columns) + " |")
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


@dataclass(frozen=True)
class ReportPaths:
    markdown: Path
    json: Path
    png: Optional[Path]


def write_report(out_dir: "str | Path", rows: Sequence[Mapping[str, Any]],
                 columns: Sequence[Column], *, meta: Optional[Mapping[str, Any]] = None,
                 stem: str = "results",
                 plot: Optional[Callable[[Sequence[Mapping[str, Any]], Path], Optional[Path]]] = None,
                 title: str = "") -> ReportPaths:
    """Write ``<stem>.md`` (table + run facts), ``<stem>.json`` and, if ``plot``, ``<stem>.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    md = []
    if title:
        md += [f"# {title}", ""]
    md += [format_table(rows, columns), ""]
    if meta:
        md += ["Run:", ""] + [f"- {k}: {_jsonable(v)}" for k, v in meta.items()] + [""]
    md_path = out / f"{stem}.md"
    md_path.write_text("\n".join(md))
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps({"meta": _jsonable(meta), "rows": _jsonable(list(rows))},
                                    indent=2) + "\n")
    png = plot(rows, out / f"{stem}.png") if plot is not None else None
    return ReportPaths(md_path, json_path, png)


def plot_bandwidth(rows: Sequence[Mapping[str, Any]], path: "str | Path", *,
                   label_key: str = "case", series: Optional[Mapping[str, str]] = None,
                   title: str = "") -> Optional[Path]:
    """Grouped bar chart of GB/s per row. ``series`` maps row key -> legend label.

    Returns the path written, or None (with a message) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed; skipping the plot "
              "(pip install 'megatron-reshard[plot]')")
        return None
    series = dict(series or {"engine_gbps": "engine", "raw_pair_gbps": "raw P2P (one pair)",
                             "baseline_gbps": "gather+broadcast"})
    labels = [str(r.get(label_key, i)) for i, r in enumerate(rows)]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    for j, (key, legend) in enumerate(series.items()):
        values = []
        for r in rows:
            v = r.get(key)
            values.append(v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0)
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))], values,
               width, label=legend)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("GB/s per destination rank")
    if title:
        ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
