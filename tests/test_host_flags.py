"""The colocated group's barriers in shared host memory (``engine/host_flags.py``): payloads
of one batch never mix with the next, a peer's failed word, a dead peer and a late peer
each end a wait with an error that names them. Real TCPStore, real shared memory; the
ranks are threads of this process (the table is opened through the store as across
processes) except for the dead peer, a real process that is killed."""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_reshard.engine.host_flags import READY, VERDICT, HostFlags
from megatron_reshard.groups.faults import RefitError, RefitTimeout


def _store(port, server, timeout_s=10.0):
    return dist.TCPStore("127.0.0.1", port, None, server, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Board:  # the attributes HostFlags reads of a FaultBoard, nothing posted
    def __init__(self, who):
        self.who, self.label = who, "test group"

    def raise_if_failed(self, what):
        pass

    def first_fault(self, timeout_s=None):
        return None


def _in_threads(fns):
    out, errors = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errors


def _ranks(world, timeout_s=5.0):
    port = _free_port()
    stores = [_store(port, r == 0) for r in range(world)]
    flags = [HostFlags(stores[r], r, world, _Board(f"rank {r}"), timeout_s) for r in range(world)]
    _, errors = _in_threads([f._open for f in flags])  # each waits for the others' records
    assert errors == [None] * world
    return flags


def test_barriers_hand_each_batch_its_own_payloads():
    world, batches = 3, 50
    flags = _ranks(world)

    def rank(r):
        seen = []
        for b in range(1, batches + 1):
            flags[r].next_batch()
            flags[r].arrive(READY, b * 10 + r)
            seen.append(flags[r].wait(READY, "ready"))
            flags[r].arrive(VERDICT)
            flags[r].wait(VERDICT, "done")
        return seen

    out, errors = _in_threads([lambda r=r: rank(r) for r in range(world)])
    assert errors == [None] * world
    want = [[b * 10 + r for r in range(world)] for b in range(1, batches + 1)]
    assert out == [want] * world


def test_a_failed_word_ends_the_peers_wait_and_a_late_peer_times_out():
    flags = _ranks(2, timeout_s=0.5)
    for f in flags:
        f.next_batch()
    flags[0].arrive(READY)
    flags[1].mark_failed()
    with pytest.raises(RefitError, match=r"rank 1 \(group rank 1\) gave up"):
        flags[0].wait(READY, "the ready barrier")

    flags = _ranks(2, timeout_s=0.5)
    # rank 1 joined and never arrives
    flags[0].next_batch()
    flags[0].arrive(READY)
    t0 = time.monotonic()
    with pytest.raises(RefitTimeout, match=r"timeout of 0.5 s \(waiting on group rank\(s\) \[1\]\)"):
        flags[0].wait(READY, "the ready barrier")
    assert time.monotonic() - t0 < 5  # the deadline, not a hang (bound far above 0.5 s)


def test_payload_out_of_range_is_refused():
    flags = _ranks(1)
    flags[0].next_batch()
    with pytest.raises(ValueError, match="does not fit 31 bits"):
        flags[0].arrive(READY, 1 << 31)


_PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from megatron_reshard.engine.host_flags import HostFlags
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=timedelta(seconds=10))
class B:
    who, label = "gen rank 0", "test group"
f = HostFlags(store, 1, 2, B(), 30.0)
f._open()
store.set("peer_ready", "1")
time.sleep(60)
"""


def test_a_dead_peer_is_named_long_before_the_timeout():
    port = _free_port()
    store = _store(port, True)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port)],
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        flags = HostFlags(store, 0, 2, _Board("train rank 0"), 30.0)
        flags._open()
        store.wait(["peer_ready"], timedelta(seconds=30))
        flags.next_batch()
        flags.arrive(READY)
        assert flags.gone_peers() == []
        os.kill(peer.pid, signal.SIGKILL)  # a zombie until reaped: still dead to the waiter
        t0 = time.monotonic()
        with pytest.raises(RefitError, match=r"gen rank 0 \(group rank 1, pid \d+\) exited"):
            flags.wait(READY, "the ready barrier")
        assert time.monotonic() - t0 < 10  # found by its pid, not by the 30 s timeout
        # whose shared-memory files the colocated transport's close may then remove
        assert flags.gone_peers() == [peer.pid]
    finally:
        peer.kill()
        peer.wait()
