"""Shared fixtures: one pool of spawned worker processes for every multi-process test;
subprocesses started ahead of the tests that read them (``tests/ahead.py``)."""

import subprocess

import pytest

from megatron_reshard.tools.worlds import WorkerPool

# Subprocesses of this process start by fork+exec, not vfork+exec. A start from one of
# tests/ahead.py's threads failed with ``OSError: [Errno 14] Bad address`` in two of two
# full runs (in test_plan_cli). Likely cause, not proven: Python 3.11.7 drops the GIL around
# vfork, so other threads run while the child still uses the parent's memory. A forked child
# has its own copy; it costs a few ms more per start.
if hasattr(subprocess, "_USE_VFORK"):
    subprocess._USE_VFORK = False

POOL_SIZE = 6  # 4 training + 2 generation ranks is the largest layout the CPU tests use


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(POOL_SIZE)
    yield workers
    workers.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "ahead(*args, **kwargs): calls of the module's AHEAD "
                                       "runner this test makes, started ahead (tests/ahead.py)")


def _may_be_skipped(item) -> bool:
    """A skip mark, or a skipif whose condition is not plainly False: its calls are not
    started (on a GPU machine the skipped ``bench refit`` would start the benchmark)."""
    if any(True for _ in item.iter_markers("skip")):
        return True
    return any(c is not False for m in item.iter_markers("skipif")
               for c in (*m.args, m.kwargs.get("condition", False)))


@pytest.fixture(scope="module", autouse=True)
def _commands_ahead(request):
    """Queue the ``ahead`` calls of the module's selected tests, in the order they run."""
    runner = getattr(request.module, "AHEAD", None)
    if runner is None:
        yield
        return
    seen = set()  # the cases of a parametrized test share the marks of its function
    for item in request.session.items:
        if item.module is not request.module or _may_be_skipped(item):
            continue
        for mark in item.iter_markers("ahead"):
            key = (getattr(item, "function", None), tuple(map(tuple, mark.args)),
                   tuple(sorted(mark.kwargs.items())))
            if key not in seen:
                seen.add(key)
                runner.start(*mark.args, **mark.kwargs)
    yield
    runner.stop()


def pytest_collection_modifyitems(config, items):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        return
    skip = pytest.mark.skip(reason="needs >= 2 CUDA GPUs (run under torchrun on the GPU machine)")
    for item in items:  # tests/gpu's folder name puts "gpu" in every item's keywords
        if "gpu" in item.keywords and not (gpus and item.get_closest_marker("one_gpu")):
            item.add_marker(skip)
