"""The CPU delta benchmark (scripts/bench_delta.py) end to end on tiny shapes: every timed
refit is a delta, the bytes each generation rank received follow the changed fraction,
and the table renders."""

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
