"""The one-device engine benchmark's CPU mode (scripts/bench_engine_1gpu.py): every case
runs, checks its bytes exactly, and reports the engine's figure with the memcpy reference
measured in the same run and their ratio. No wall-clock thresholds."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_one_device_bench_reports_engine_memcpy_and_ratio_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_engine_1gpu.py"), "--device", "cpu",
           "--small", "--iters", "2", "--warmup", "1", "--params", "50", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = [r["case"] for r in rows["copies"]]
    assert names[:4] == ["local_contiguous", "local_strided_dst", "local_column_block_dst",
                         "local_experts_list"]
    assert any(n.startswith("pack_") for n in names) and any(n.startswith("unpack_") for n in names)
    for r in rows["copies"]:
        assert r["engine_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert math.isclose(r["vs_memcpy"], r["engine_gbps"] / r["memcpy_gbps"])
    experts = rows["copies"][3]
    assert experts["peak_extra_mib"] < experts["mib"]  # no stacking copy of the experts
    assert [r["case"] for r in rows["host"]] == ["host_1d_4096", "host_2d_64x64",
                                          "host_transposed_dst_64x64"]
    assert all(r["host_us_per_param"] > 0 and r["params"] == 50 for r in rows["host"])
    assert "engine/memcpy" in proc.stdout and "host µs/param" in proc.stdout
