"""A refit group is one object (``groups.RefitGroup``) that owns its state: its fault board,
its threads and its transport die with its ``destroy()``, two groups of one process share
none of it, and a planner's per-group caches neither outlive a group nor keep it alive.

Real gloo groups over real TCPStores, two spawned ranks (the shared pool); every check
reads the group object, not a module table."""

import gc
import weakref

import torch
from torch.distributed.tensor import Replicate, Shard


def _batch(train: bool, out: torch.Tensor, value: float):
    """One Transfer of a 4x6 tensor from rank 0 (sharded by rows, one shard) to rank 1."""
    from megatron_reshard.engine import Transfer
    from megatron_reshard.layout.placements import MeshInfo

    src = torch.full((4, 6), value) if train else None
    return [Transfer("w", (4, 6), torch.float32, MeshInfo(torch.tensor([0])), [Shard(0)],
                     MeshInfo(torch.tensor([1])), [Replicate()], src,
                     None if train else out)]


def _destroy_releases(job, transport_name):
    from megatron_reshard.engine import Planner
    from megatron_reshard.engine.refit_transport import transport_of
    from megatron_reshard.errors import CallOrderError
    from megatron_reshard.groups import RefitGroup, create_refit_group, destroy_refit_group

    train = job.rank == 0
    group = create_refit_group(job.host, job.ports[0], job.rank, 2, "gloo", 60.0,
                               transport=transport_name)
    assert isinstance(group, RefitGroup) and group.board.threads is group.threads
    out, planner = torch.zeros(4, 6), Planner()
    transport = transport_of(group)
    assert transport is group.transport is transport_of(group)  # built once, kept by the group
    transport.move(_batch(train, out, 3.0), group, planner=planner)
    transport.flush()
    moved = train or bool((out == 3.0).all())
    used = group.threads.alive()  # the waits and board reads ran on the group's threads
    closed = []
    close = transport.close
    transport.close = lambda: (closed.append(True), close())[1]
    done = destroy_refit_group(group, 30.0)  # the function form calls group.destroy()
    try:
        transport_of(group)
        refused = None
    except CallOrderError as exc:
        refused = str(exc)
    return {"moved": moved, "used": used, "done": done, "closed": closed,
            "board": group.board, "transport": group.transport,
            "threads_closed": group.threads.closed, "alive": group.threads.alive(),
            "again": group.destroy(), "refused": refused}


def test_a_destroyed_group_releases_its_board_transport_and_threads(pool):
    for name in ("p2p", "colocated"):
        results = pool.run(_destroy_releases, 2, name, timeout_s=90)
        for rank, r in enumerate(results):
            assert r["moved"] and r["used"] >= 1, (name, rank, r)
            assert r["closed"] == [True], (name, rank, r)  # the group closed its transport
            assert r["board"] is None and r["transport"] is None, (name, rank, r)
            assert r["threads_closed"] and r["alive"] == 0, (name, rank, r)
            assert r["again"] == 1, (name, rank, r)  # a second destroy does nothing
            assert "was destroyed" in r["refused"], (name, rank, r)
        assert results[0]["done"] == 2, (name, results)  # the store's host waited for both


def _two_groups(job):
    from megatron_reshard.engine import Planner, xfer_batch
    from megatron_reshard.engine.refit_transport import transport_of
    from megatron_reshard.groups import PeerFailure, create_refit_group
    from megatron_reshard.groups.faults import post_failure, wait_works

    train = job.rank == 0
    a = create_refit_group(job.host, job.ports[0], job.rank, 2, "gloo", 60.0, label="group A")
    b = create_refit_group(job.host, job.ports[1], job.rank, 2, "gloo", 60.0, label="group B",
                           transport="colocated")
    separate = (a.board is not b.board and a.threads is not b.threads
                and a.store is not b.store and a.pg is not b.pg)
    names = (transport_of(a).name, transport_of(b).name)
    planner, out = Planner(), torch.zeros(4, 6)
    xfer_batch(_batch(train, out, 1.0), a, planner=planner)
    transport_of(b).move(_batch(train, out, 2.0), b, planner=planner)
    own_history = planner.call_sequence(a) is not planner.call_sequence(b)
    # group A fails (rank 0 posts, rank 1 sees it in a wait); group B is untouched
    if train:
        post_failure([a], RuntimeError("planted on A"))
        seen = "posted"
    else:
        try:
            wait_works([a.pg.recv([torch.zeros(1)], 0, 9)], a, "a receive on A", [0])
            seen = None
        except PeerFailure as exc:
            seen = str(exc)
    a_failed, b_failed = a.board.failed, b.board.failed
    a.destroy(10.0)
    transport_of(b).move(_batch(train, out, 5.0), b, planner=planner)  # B still moves bytes
    b_ok = train or bool((out == 5.0).all())
    b_alive = b.board is not None and b.transport is not None and not b.threads.closed
    # the planner's entries for B do not keep B alive, and go with it (A, failed, is held
    # until its abandoned receive has ended: faults.retire)
    histories = len(planner._sequences.values())
    b.destroy(30.0)
    ref = weakref.ref(b)
    del b
    gc.collect()
    return {"separate": separate, "names": names, "own_history": own_history, "seen": seen,
            "a_failed": a_failed, "b_failed": b_failed, "b_ok": b_ok, "b_alive": b_alive,
            "b_gone": ref() is None,
            "histories": (histories, len(planner._sequences.values()))}


def test_two_groups_of_one_process_keep_separate_state(pool):
    results = pool.run(_two_groups, 2, num_ports=2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["separate"] and r["own_history"], (rank, r)
        assert r["names"] == ("p2p", "colocated"), (rank, r)
        assert r["a_failed"] and not r["b_failed"], (rank, r)  # A's failure stays on A
        assert r["b_ok"] and r["b_alive"], (rank, r)  # destroying A left B whole
        assert r["b_gone"] and r["histories"] == (2, 1), (rank, r)  # B's history went with B
    assert "planted on A" in results[1]["seen"], results[1]
