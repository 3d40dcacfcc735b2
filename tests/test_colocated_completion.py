"""``engine/colocated_completion.py`` on one rank (a real TCPStore and shared table): reports
are counts of batches in order, a training rank lets go of a batch once it is reported, and
after a failure what no peer reported read stays alive a while (a peer's copies may still
run), then is freed."""

import gc
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.engine import colocated_completion
from megatron_reshard.engine.colocated_completion import Completions
from megatron_reshard.engine.host_flags import COPIED, HostFlags
from megatron_reshard.tools.worlds import free_ports


def _flags():
    store = dist.TCPStore("127.0.0.1", free_ports(1)[0], None, True,
                          timeout=timedelta(seconds=10), wait_for_workers=False)
    return HostFlags(store, 0, 1, None, 5.0)


def test_reports_count_batches_in_order_and_let_go_waits_for_them():
    flags = _flags()
    reads = Completions(flags)
    kept = torch.ones(4)
    for seq in (1, 2):
        reads.queued(seq, None)  # complete at once (CPU copies)
        reads.published(seq, [kept])
    reads.report()
    assert flags.wait(COPIED, "test", seq=2) == [0]  # batch 2 reported: 1 implied
    reads.let_go(1)  # batch 1 dropped, batch 2 kept
    assert [s for s, _ in reads._unread] == [2]
    reads.settle()
    assert not reads._unread


def test_after_a_failure_unread_tensors_outlive_the_transport_a_while(monkeypatch):
    monkeypatch.setattr(colocated_completion, "UNREAD_LINGER_S", 1.0)
    reads = Completions(_flags())
    buffer = torch.ones(1024)
    alive = weakref.ref(buffer)
    reads.published(1, [buffer])
    del buffer
    reads.clear()  # refcounts free a tensor at once: no gc pass needed (nor wanted: slow)
    assert alive() is not None, "freed while a peer's copies may still read it"
    deadline = time.monotonic() + 10
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert alive() is None, "still held long after the linger"
