"""The CPU delta benchmark (scripts/bench_delta.py) end to end on tiny shapes: every timed
refit is a delta, the bytes each generation rank received follow the changed fraction,
and the table renders."""

import re
import subprocess
import sys
from pathlib import Path

from megatron_reshard.tools.bench.delta_bench import default_opts, run, table


def test_the_delta_bench_reports_bytes_messages_and_times_per_fraction(pool):
    opts = default_opts(layers=2, hidden=64, ffn=160, vocab=500, iters=1,
                        fractions=[0.01, 0.3, 1.0], checksums=True)
    summary = run(opts, pool)
    rows = {r["fraction"]: r for r in summary["rows"]}
    assert all(r["modes"] == ["delta"] for r in rows.values()), rows
    assert rows[0.01]["received_vs_full"] < 0.04, rows[0.01]
    assert rows[0.01]["received_vs_full"] < rows[0.3]["received_vs_full"] < 1.0
    # 100% changed: every region dense, plus its 16-byte header
    assert 1.0 < rows[1.0]["received_vs_full"] < 1.02, rows[1.0]
    assert rows[1.0]["encodings"] == {"dense": rows[1.0]["regions_sent"]}
    for r in rows.values():
        assert r["messages_sent"] == 2 * opts["gen"]  # one batch: headers + payload per peer
        assert r["refit_s"] > 0 and r["raw_s"] > 0
    text = table(summary)
    assert "| 1% | delta |" in text and "| 100% | delta |" in text


def test_the_host_bench_prints_each_step_a_region():
    """scripts/bench_delta_host.py (in its own process: it swaps the kernels for no-ops)
    prints a figure for the cut, the encode and the apply at each batch size."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_delta_host.py"
    out = subprocess.run([sys.executable, str(script), "--regions", "1,3", "--elements",
                          "5000", "--iters", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("K=")]
    assert len(lines) == 2, out.stdout
    for line in lines:
        figures = dict(re.findall(r"(\w+_many) ([0-9.]+)", line))
        assert sorted(figures) == ["apply_many", "cut_many", "encode_many"], line
        assert all(float(v) > 0 for v in figures.values()), line
