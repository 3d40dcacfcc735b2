"""``scripts/bench_colocated.py`` runs on CPU (shared memory): two processes, the 30B-shaped
small slice cut into several batches (as the refit loop cuts), into checkpoint-order
expert storage and into FlashInfer-like orders (``--orders synthetic``: TRTLLM's permuted
rows, CUTLASS's [up; gate]), every case checked bit for bit by the script itself, and the
timeline lists both ranks' steps."""

import json
import subprocess
import sys
from pathlib import Path

from megatron_reshard.tools.worlds import free_ports

ROOT = Path(__file__).resolve().parents[1]


def test_the_colocated_benchmark_runs_on_cpu_with_its_timeline(tmp_path):
    out = tmp_path / "c.json"
    # the timeout only keeps a hang from blocking the suite; nothing here measures time
    done = subprocess.run([sys.executable, "scripts/bench_colocated.py", "--device", "cpu",
                           "--small", "--iters", "2", "--warmup", "1", "--timeline", "--batch-mib", "0.1",
                           "--cases", "qwen3_30b_a3b", "--port", str(free_ports(1)[0]), "--json", str(out),
                           "--orders", "synthetic"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {f"{p}{o}" for p in ("refit", "experts")
                         for o in ("", "[flashinfer_trtllm]", "[flashinfer_cutlass]")}
    assert rows["refit[flashinfer_trtllm]"]["expert_order"] == "trtllm-like"
    for row in rows.values():
        assert row["refit_ms"] > 0 and row["memcpy_gbps"] > 0 and row["copy_pairs"] > 0
        assert row["train_host_ms"] >= 0  # both ranks reported
    assert rows["refit"]["batches"] > 1
    for step in ("gen.describe", "gen.check", "gen.ready", "gen.run", "gen.verdict",
                 "train.describe", "train.ready", "train.check", "train.verdict",
                 "train.copied"):
        assert f"  {step} " in done.stdout, step


def test_the_gpt_oss_case_moves_its_experts_in_vllms_wire_form_on_cpu(tmp_path):
    """The gpt-oss-120b-shaped case (small): biased experts through the library's own
    views into w13 seen as [E, I, 2, H], checked bit for bit by the script (it exits
    non-zero on a difference); checkpoint order only."""
    out = tmp_path / "o.json"
    done = subprocess.run([sys.executable, "scripts/bench_colocated.py", "--device", "cpu",
                           "--small", "--iters", "2", "--warmup", "1", "--batch-mib", "0.1",
                           "--cases", "gpt_oss_120b", "--port", str(free_ports(1)[0]),
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"refit", "experts"}
    assert rows["experts"]["params"] == 4  # w13, w13_bias, w2, w2_bias of one layer
    assert rows["refit"]["params"] == 2 * 12 and rows["refit"]["batches"] > 1
    assert all(r["refit_ms"] > 0 and r["copy_pairs"] > 0 for r in rows.values())
