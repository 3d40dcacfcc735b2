"""Shared fixtures: one pool of spawned worker processes for every multi-process test."""

import pytest

from megatron_reshard.tools.worlds import WorkerPool

POOL_SIZE = 6  # 4 training + 2 generation ranks is the largest layout the CPU tests use


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(POOL_SIZE)
    yield workers
    workers.close()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs >= 2 CUDA GPUs (run under torchrun on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
