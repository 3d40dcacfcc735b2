"""GPU engine checks: runs tests/gpu/engine_worker.py under torchrun (NCCL)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("engine_worker.py")


@pytest.mark.gpu
def test_engine_over_nccl_matches_the_reference_under_torchrun():
    nproc = min(4, torch.cuda.device_count())
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-port=29531", str(WORKER)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540,
                          cwd=WORKER.parents[2])
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ENGINE GPU WORKER OK" in proc.stdout
