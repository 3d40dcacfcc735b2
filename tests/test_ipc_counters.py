"""A SIGKILLed process's torch shared-memory file, removed only when no survivor would unlink
it (``engine.ipc_counters``; issue 52 item 5).

On a GPU the file is torch's CUDA IPC reference-counter file; on CPU torch's ``file_system``
sharing makes files with the same ``RefcountedMapAllocator`` header, so the test uses those,
real ones, made and opened by torch in spawned processes. The dead creator's
``torch_shm_manager`` is left alive: a libshm client whose manager is gone aborts when it
closes the storage (``std::system_error: Broken pipe``, torch's own behaviour), and the
manager touches the names only once its last client, the survivor, has left. While the
survivor lives nothing else unlinks the file: the CUDA case's state.
"""

import gc
import multiprocessing as mp
import os
import signal

import torch

from megatron_reshard.engine import shm_segment
from megatron_reshard.engine.ipc_counters import remove_dead_files
from megatron_reshard.tools import cli

ELEMENTS = 4096
WAIT_S = 120.0  # a spawned process's imports on a loaded 2-core machine


def _share(values: torch.Tensor) -> tuple:
    storage = values.untyped_storage()
    manager, name, size = storage._share_filename_cpu_()
    return storage, (manager, name, size)


def _open(handle: tuple) -> torch.UntypedStorage:
    return torch.UntypedStorage._new_shared_filename_cpu(*handle)  # counted in the header


def _live_creator(conn) -> None:
    """Shares file E and lives until told to stop."""
    storage, handle = _share(torch.ones(ELEMENTS))
    conn.send(handle)
    conn.recv()


def _dead_creator(conn) -> None:
    """Shares files A and B, opens E (a count it will never give back), frees B (so B's
    count is only the survivor's), then waits for its SIGKILL."""
    a, handle_a = _share(torch.arange(ELEMENTS, dtype=torch.float32) * 3)
    b, handle_b = _share(torch.zeros(ELEMENTS))
    conn.send((handle_a, handle_b))
    e = _open(conn.recv())
    conn.send("opened E")
    conn.recv()
    del b
    gc.collect()
    conn.send("freed B")
    conn.recv()


def _survivor(conn) -> None:
    """Opens A and B through torch (counted); once asked, reads A and closes both."""
    handle_a, handle_b = conn.recv()
    a, b = _open(handle_a), _open(handle_b)
    conn.send("mapped")
    conn.recv()
    view = torch.empty(0, dtype=torch.float32).set_(
        torch.TypedStorage(wrap_storage=a, dtype=torch.float32, _internal=True))
    conn.send(torch.equal(view, torch.arange(ELEMENTS, dtype=torch.float32) * 3))
    conn.recv()
    del view, a, b
    gc.collect()  # A's count 2 -> 1 (no unlink); B's 1 -> 0: torch unlinks B itself
    conn.send("closed")


def _path(handle: tuple) -> str:
    return shm_segment.segment_path(handle[1])


def _count(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(4), "little", signed=True)


def test_dead_creators_file_removed_only_when_its_count_is_stuck(capsys):
    ctx = mp.get_context("spawn")
    roles = (_live_creator, _dead_creator, _survivor)
    pipes = [ctx.Pipe() for _ in roles]
    procs = [ctx.Process(target=fn, args=(child,), daemon=True)
             for fn, (_, child) in zip(roles, pipes)]
    live, dead, survivor = (parent for parent, _ in pipes)
    paths = []
    try:
        for p in procs:
            p.start()
        assert live.poll(WAIT_S) and dead.poll(WAIT_S)
        handle_e = live.recv()
        handles = dead.recv()
        dead.send(handle_e)
        assert dead.poll(WAIT_S) and dead.recv() == "opened E"
        survivor.send(handles)
        assert survivor.poll(WAIT_S) and survivor.recv() == "mapped"
        dead.send("free B")
        assert dead.poll(WAIT_S) and dead.recv() == "freed B"
        path_a, path_b = _path(handles[0]), _path(handles[1])
        path_e = _path(handle_e)
        paths = [path_a, path_b, path_e]
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(WAIT_S)
        creators = {procs[0].pid, procs[1].pid}
        # A: the dead creator's stuck count + the survivor's; B: the survivor's alone;
        # E: its live creator's + the dead one's stuck count
        assert [_count(p) for p in paths] == [2, 1, 2]

        # a mapping made here without torch's count (map_segment) leaves the count alone,
        # and the rule counts it as a live mapping: A is kept while it is there
        mapped = shm_segment.map_segment(handles[0][1], ELEMENTS * 4)
        assert _count(path_a) == 2
        assert remove_dead_files(creators=creators) == []
        assert all(os.path.exists(p) for p in paths)
        del mapped
        gc.collect()

        # the operator's dry run names A and unlinks nothing
        assert cli.main(["clean-shm"]) == 0
        assert path_a in capsys.readouterr().out
        assert os.path.exists(path_a)

        removed = remove_dead_files(creators=creators)
        assert [(f.path, f.creator, f.count, f.mappings, f.size) for f in removed] == \
            [(path_a, procs[1].pid, 2, 1, shm_segment.HEADER_BYTES + ELEMENTS * 4)]
        assert not os.path.exists(path_a)
        assert os.path.exists(path_b) and os.path.exists(path_e)  # count == live; creator alive

        # the survivor still reads A, and closing A and B is clean: B's count reaches 0
        # and torch unlinks B itself, which it could not had B been removed here
        survivor.send("read")
        assert survivor.poll(WAIT_S) and survivor.recv() is True
        survivor.send("close")
        assert survivor.poll(WAIT_S) and survivor.recv() == "closed"
        procs[2].join(WAIT_S)
        assert procs[2].exitcode == 0
        assert not os.path.exists(path_b)
    finally:
        if procs[0].is_alive():
            live.send("stop")
        for p in procs:
            p.join(WAIT_S / 4)
            if p.is_alive():
                p.kill()
                p.join(WAIT_S / 4)
        for p in paths:  # what this test made and the rule left: not left on the host
            if os.path.exists(p):
                os.unlink(p)
