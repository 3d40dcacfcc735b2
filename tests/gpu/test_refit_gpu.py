"""Refit over NCCL on 4 GPUs under torchrun (2 training + 2 generation ranks), bit-exact.

Runs scripts/refit_torchrun.py once per layout; skipped without GPUs (see conftest.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    # experts: train Shard(0) over EP... vs gen Shard(1)/Shard(2) over TP; dense FFN TP→TP
    "moe_train_tp2_to_gen_tp2": ["--model", "moe", "--train-tp", "2", "--train-pp", "1", "--train-ep", "1"],
    "moe_train_ep2_to_gen_tp2": ["--model", "moe", "--train-tp", "1", "--train-pp", "1", "--train-ep", "2"],
    "dense_train_pp2_to_gen_tp2": ["--model", "dense", "--train-tp", "1", "--train-pp", "2", "--train-ep", "1"],
    "dense_train_dp2_to_gen_dp2": ["--model", "dense", "--train-tp", "1", "--train-pp", "1", "--train-ep", "1",
                                   "--gen-tp", "1"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_refit_over_nccl_is_bit_exact(layout):
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
           "--master-port=29641", str(ROOT / "scripts" / "refit_torchrun.py"),
           "--train-world", "2", "--gen-world", "2", "--refits", "2", *LAYOUTS[layout]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REFIT_SUMMARY ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(lines[-1].split(" ", 1)[1])
    assert summary["verified"] is True
    assert all(not row["mismatched"] for row in summary["per_gen_rank"])
    print(layout, json.dumps({k: summary[k] for k in ("params", "bytes_per_gen_rank",
                                                       "exact_path_fraction", "refit_s")}))
