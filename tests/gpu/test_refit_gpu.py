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


def _refit_torchrun(nproc: int, args: list) -> dict:
    """scripts/refit_torchrun.py on ``nproc`` GPUs: its REFIT_SUMMARY, the run checked ok."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-port=29641", str(ROOT / "scripts" / "refit_torchrun.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REFIT_SUMMARY ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(lines[-1].split(" ", 1)[1])
    assert summary["verified"] is True
    assert all(not row["mismatched"] for row in summary["per_gen_rank"])
    return summary


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_refit_over_nccl_is_bit_exact(layout):
    summary = _refit_torchrun(4, ["--train-world", "2", "--gen-world", "2", "--refits", "2",
                                  *LAYOUTS[layout]])
    print(layout, json.dumps({k: summary[k] for k in ("params", "bytes_per_gen_rank",
                                                       "exact_path_fraction", "refit_s")}))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["moe", "dense"])
def test_delta_refit_over_nccl_is_bit_exact(model):
    """One training GPU, one generation GPU, Adam steps between refits: the second and third
    refits go as deltas over NCCL (CUDA headers, the Triton cut and apply), each verified
    bit for bit against the full HF tensors sliced for the generation rank."""
    summary = _refit_torchrun(2, ["--model", model, "--train-world", "1", "--train-tp", "1",
                                  "--train-pp", "1", "--train-ep", "1", "--gen-world", "1",
                                  "--gen-tp", "1", "--refits", "3", "--delta", "--update", "adam"])
    assert summary["modes"] == ["full", "delta", "delta"], summary["full_reasons"]
    received = summary["bytes_received"]["0"]
    assert all(0 < b < 0.04 * received[0] for b in received[1:]), received
    print(model, json.dumps({k: summary[k] for k in ("modes", "bytes_received", "refit_s")}))
