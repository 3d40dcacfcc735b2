"""The GPU engine worker runs only where GPUs are; its CPU mode (gloo, ENGINE_WORKER_CPU=1)
runs every check that does not need CUDA, so the script cannot rot between GPU runs."""

import os
import subprocess
import sys
from pathlib import Path

from megatron_reshard.tools.worlds import free_port_block

WORKER = Path(__file__).parent / "gpu" / "engine_worker.py"


def test_engine_gpu_worker_passes_its_cpu_mode_under_torchrun():
    port = free_port_block(16)
    env = {**os.environ, "ENGINE_WORKER_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={port}", str(WORKER)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240,
                          cwd=WORKER.parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ENGINE GPU WORKER OK" in proc.stdout
    assert "ok: random layouts on a side stream (120 params)" in proc.stdout
