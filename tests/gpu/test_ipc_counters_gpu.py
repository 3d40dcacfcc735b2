"""A SIGKILLed CUDA IPC exporter's reference-counter file (``/dev/shm/torch_<pid>_*``, 80,064
bytes) is removed by ``engine.ipc_counters`` once the exporter is dead, and the importer
still reads the tensor and frees it cleanly. Needs one CUDA GPU:
``python -m pytest tests/gpu/test_ipc_counters_gpu.py -q``."""

import gc
import multiprocessing as mp
import os
import signal

import pytest
import torch

from megatron_reshard.engine.ipc_counters import remove_dead_files
from megatron_reshard.engine.shm_segment import segment_path

ELEMENTS = 1 << 20
WAIT_S = 120.0
pytestmark = [pytest.mark.one_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _exporter(conn) -> None:
    values = torch.arange(ELEMENTS, dtype=torch.float32, device="cuda")
    from torch.multiprocessing.reductions import reduce_tensor  # the CUDA IPC export

    rebuild, args = reduce_tensor(values)
    conn.send((rebuild, args))
    conn.recv()  # SIGKILLed here


def test_a_killed_exporters_counter_file_is_removed_and_the_importer_is_fine():
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    exporter = ctx.Process(target=_exporter, args=(theirs,), daemon=True)
    exporter.start()
    path = None
    try:
        assert mine.poll(WAIT_S)
        rebuild, args = mine.recv()
        name = next(a for a in args if isinstance(a, bytes) and a.startswith(b"/torch_"))
        path = segment_path(name)  # the counter file's name, carried in the IPC handle
        imported = rebuild(*args)
        assert os.path.getsize(path) == 10_000 * 8 + 64  # the counters + torch's header
        assert remove_dead_files(creators={exporter.pid}) == []  # its creator lives
        os.kill(exporter.pid, signal.SIGKILL)
        exporter.join(WAIT_S)
        removed = remove_dead_files(creators={exporter.pid})
        assert [(f.path, f.count, f.mappings) for f in removed] == [(path, 1, 0)]
        assert not os.path.exists(path)
        expected = torch.arange(ELEMENTS, dtype=torch.float32, device="cuda")
        assert torch.equal(imported, expected)
        del imported  # its deleter opens the counter file by name: gone, torch lets it be
        gc.collect()
        torch.cuda.synchronize()
    finally:
        if exporter.is_alive():
            exporter.kill()
        exporter.join(WAIT_S)
        if path and os.path.exists(path):
            os.unlink(path)
