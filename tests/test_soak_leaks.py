"""What the long soak found growing (issue 52), each reproduced small: a generation rank
mapped the CPU shared memory of every training process it ever refit from through that
process's ``torch_shm_manager``, and torch kept each connection for the reader's whole life:
one socket per training rank that was restarted, and the dead rank's manager kept alive
with its shared model never unlinked from ``/dev/shm``. Now a reader maps the segments by
name (``engine.shm_segment``). Counts, not timings."""

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

from megatron_reshard.engine import shm_segment
from megatron_reshard.engine.shared_memory import (SharedMemoryError, StorageHandle,
                                                   export_storage, open_storage, view_of)
from megatron_reshard.tools.soak_growth import least_squares
from megatron_reshard.tools.soak_leaks import Leftovers, figure, orphan_segments, slope_band

OWNERS = 3        # owner processes, each killed after the reader mapped its storage
ELEMENTS = 4096
WAIT_S = 120.0    # a spawned process's imports on a loaded 2-core machine
SEGMENTS_GONE_S = 30.0  # a dead owner's manager unlinks its segments once it has no client


def _fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _owner(conn, seed: int) -> None:
    """A training rank's side: share a storage, hand over its handle, die by SIGKILL once
    the reader has it mapped (no cleanup of its own, as in a killed training rank)."""
    values = torch.arange(ELEMENTS, dtype=torch.float32) * seed
    conn.send(tuple(export_storage(values.untyped_storage())))
    conn.recv()
    os.kill(os.getpid(), signal.SIGKILL)


def _reader(conn) -> None:
    """A generation rank's side, alive across owners: map each owner's storage, check what
    it reads, write one element the owner must see (a barrier word), let go; report its
    fds before the first owner and after the last."""
    before = _fds()
    while True:
        msg = conn.recv()
        if msg is None:
            break
        handle, seed = StorageHandle(*msg[0]), msg[1]
        storage = open_storage(handle)
        view = view_of(storage, torch.float32, 0, (ELEMENTS,), (1,))
        ok = torch.equal(view, torch.arange(ELEMENTS, dtype=torch.float32) * seed)
        del view, storage
        conn.send(ok)
    after = _fds()
    conn.send((before, after))


def _segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(shm_segment.SHM_DIR) if n.startswith(f"torch_{pid}_"))


@pytest.mark.skipif(not shm_segment.available(), reason="no POSIX shared memory directory")
def test_a_reader_outliving_its_owners_keeps_no_socket_and_no_dead_owners_segment():
    ctx = mp.get_context("spawn")
    reader_end, reader_conn = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(reader_conn,), daemon=True)
    owners = []
    for seed in range(1, OWNERS + 1):  # started together: their imports overlap
        mine, theirs = ctx.Pipe()
        owners.append((ctx.Process(target=_owner, args=(theirs, seed), daemon=True), mine, seed))
    reader.start()
    for proc, _, _ in owners:
        proc.start()
    dead_pids = []
    try:
        for proc, conn, seed in owners:
            assert conn.poll(WAIT_S), "an owner process did not start"
            reader_end.send((conn.recv(), seed))
            assert reader_end.poll(WAIT_S) and reader_end.recv(), \
                f"the reader read other values than owner {seed} shared"
            conn.send("die")
            proc.join(WAIT_S)
            assert proc.exitcode == -signal.SIGKILL, proc.exitcode
            dead_pids.append(proc.pid)
        reader_end.send(None)
        assert reader_end.poll(WAIT_S)
        before, after = reader_end.recv()
        # the dead owners' segments: unlinked by their managers, which exit once no client is
        # left (old code: the reader's connections kept every one alive, and its segments)
        left = {pid: _segments_of(pid) for pid in dead_pids}
        deadline = time.monotonic() + SEGMENTS_GONE_S
        while any(left.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            left = {pid: _segments_of(pid) for pid in dead_pids}
    finally:
        reader.kill()
        for proc, _, _ in owners:
            proc.kill()
    grown = {fd: target for fd, target in after.items() if before.get(fd) != target}
    assert grown == {}, (f"after {OWNERS} owners came and went, the reader holds {len(grown)} "
                         f"more fds: {grown}")
    assert not any(left.values()), f"dead owners' shared segments still in /dev/shm: {left}"


def test_a_segment_that_is_gone_is_refused_and_not_created():
    name = f"/torch_{os.getpid()}_0_missing".encode()
    handle = StorageHandle("cpu", (name,), 64, (b"/nonexistent/manager.sock", name, 64))
    with pytest.raises(SharedMemoryError, match="could not open a shared cpu storage of 64 bytes"):
        open_storage(handle)
    assert not os.path.exists(shm_segment.segment_path(name))  # no empty segment made up


def test_a_mapped_segment_is_the_owners_memory_both_ways():
    values = torch.arange(300, dtype=torch.int64)
    handle = export_storage(values.untyped_storage())
    seen = view_of(open_storage(handle), torch.int64, 0, (300,), (1,))
    assert torch.equal(seen, values)
    seen[7] = -1       # a reader's write (a colocated barrier word) reaches the owner
    values[8] = -2     # and the owner's reaches the reader
    assert values[7].item() == -1 and seen[8].item() == -2
    with pytest.raises(SharedMemoryError, match="expected torch's 64-byte header"):
        open_storage(StorageHandle("cpu", handle.key, 8, (handle.args[0], handle.args[1], 8)))


# ------------------------------------------------------------- the soak's leak figures


def test_a_slope_within_its_noise_band_is_flat_and_a_steady_climb_is_not():
    noisy = [(r, 100.0 + (3.0 if r % 50 else -3.0)) for r in range(0, 1000, 25)]
    fig = figure(noisy)
    assert fig["flat"] and abs(fig["per_1000_refits"]) <= fig["band_2se"], fig
    climb = [(r, 5 + r // 100 + (1 if r % 50 else 0)) for r in range(0, 1000, 25)]
    fig = figure(climb)
    assert not fig["flat"] and fig["per_1000_refits"] == pytest.approx(10, abs=1), fig
    warm = figure([(r, 300 + min(r, 200) / 10) for r in range(0, 1000, 25)])  # then flat
    assert warm["per_1000_refits"] > 5 and warm["late_per_1000_refits"] == 0, warm
    still = figure([(r, 7) for r in range(0, 100, 10)])
    assert still["flat"] and still["band_2se"] == 0 and still["per_1000_refits"] == 0
    assert slope_band([(0, 1.0), (10, 2.0)]) is None


def test_leftovers_are_what_survivors_gained_between_settled_samples_per_fault():
    left = Leftovers()
    left.settled(0, {}, {("gen", 10): {"sockets": 5, "threads": 7},
                        ("train", 11): {"sockets": 30, "threads": 70}})
    # two faults; the training rank died in between (not a survivor) and a new one started
    faults = {"kill_train@commit": 1, "tamper_gen": 1}
    left.settled(25, faults, {("gen", 10): {"sockets": 7, "threads": 7},
                              ("train", 12): {"sockets": 50, "threads": 90}})
    left.settled(50, faults, {("gen", 10): {"sockets": 8, "threads": 7},
                              ("train", 12): {"sockets": 50, "threads": 90}})
    out = left.report()
    assert out["faults_measured"] == 2 and out["per_fault"]["gen"]["sockets"] == 1.0
    assert out["per_fault"]["gen"]["threads"] == 0.0 and out["per_fault"]["train"]["sockets"] == 0
    assert out["worst_window"]["refits"] == 25
    assert out["worst_window"]["kinds"] == {"kill_train@commit": 1, "tamper_gen": 1}
    assert out["without_faults_total"]["gen"]["sockets"] == 1  # a quiet window's growth
    assert out["without_faults_total"]["train"]["sockets"] == 0


def test_growth_is_told_apart_by_event_refits_faults_and_switches():
    # a rank that grows 8 MiB per 1,000 refits, 0.5 MiB per fault, 3 MiB per model switch,
    # with +-0.2 MiB of noise, after a warm-up of 10 MiB in its first window (left out):
    # each share comes back within its band
    rng = random.Random(0)
    left, rss, turns, faults = Leftovers(), 300.0, 1, 0
    left.settled(0, {}, {("gen", 10): {"rss_trimmed_mib": rss, "model_turns": turns}})
    for refits in range(25, 1025, 25):
        hit = rng.randrange(4)
        switch = refits % 100 == 0
        faults, turns = faults + hit, turns + switch
        rss += 0.008 * 25 + 0.5 * hit + 3.0 * switch + rng.uniform(-0.2, 0.2) + 10 * (refits == 25)
        left.settled(refits, {"kill_gen": faults},
                     {("gen", 10): {"rss_trimmed_mib": rss, "model_turns": turns},
                      ("train", refits): {"rss_trimmed_mib": 1e3 * refits}})  # a new one each time
    fig = left.report()["growth_by_event"]["gen"]["rss_trimmed_mib"]
    for event, want in (("per_1000_refits", 8.0), ("per_fault", 0.5), ("per_switch", 3.0)):
        value, band = fig[event]
        assert abs(value - want) <= band < 4, (event, fig)
    assert fig["windows"] == 39
    assert "train" not in left.report()["growth_by_event"]  # never alive at both ends
    # no switch in a run: no share for it, the others still fitted
    rows = [((25, k % 3, 0), 0.2 + 0.5 * (k % 3)) for k in range(10)]
    fit = least_squares(rows)
    assert fit[2] is None and fit[0][0] == pytest.approx(0.008) and fit[1][0] == pytest.approx(0.5)
    assert least_squares(rows[:2]) is None  # no residual left to estimate the error from


def test_dead_processes_segments_are_counted_on_the_host(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / f"torch_{dead}_1_0").write_bytes(b"x" * 2048)
    (tmp_path / f"torch_{os.getpid()}_1_0").write_bytes(b"x")  # alive: not an orphan
    (tmp_path / "torch_999_1_0").write_bytes(b"x")              # not one of the soak's
    out = orphan_segments([dead, os.getpid()], str(tmp_path))
    assert out == {"orphan_segments": 1, "orphan_segment_mib": round(2048 / 2**20, 3)}
