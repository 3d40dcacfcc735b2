"""A long-lived training rank and generation rank keep nothing per refit (issue 52 follow-up).

In RL a training process refits every step for days, so a structure of ours that grows per
refit (a list or dict appended to, a cache keyed by version or tensor id, stats or work
handles kept) is a defect even at a few KiB a refit. ``scripts/probe_refit_memory.py``
measured it with tracemalloc and glibc's bytes in use (docs/MEASUREMENTS.md, "What a
long-lived refit process keeps per refit"): nothing of ours grows. This test keeps it so,
deterministically: real processes, a real megatron-core model (the demo's dense, 2 layers,
bf16) on 1 training rank refitting 1 generation rank (the worker extension over a
vLLM-layout model) over gloo, full refits, then delta refits after an Adam step each.
After a warm-up come three windows of ``REFITS`` refits. On both sides, what the sender (or
the worker) holds, objects reachable from it and the summed length of its containers, and
every type's count of live objects grow by less than one per two refits in at least two
of the three windows; a type of ours grows in at most one. A per-refit leak grows by
``REFITS`` or more in every window; a one-off is allowed one window: a refit group's
waiter threads gain one (16 objects) when a wait overlaps another on a loaded machine.
"""

import pytest

from megatron_reshard.tools.refit_memory import probe_job

WARMUP, REFITS, WINDOWS = 10, 20, 3
BOUND = REFITS // 2  # the probe's own bookkeeping and the odd value that varies stay far below


@pytest.fixture(scope="module", params=["full", "delta_adam"])
def runs(pool, request):
    changing = request.param == "delta_adam"
    return pool.run(probe_job, 2, WARMUP, REFITS, WINDOWS, 0, changing, changing,
                    counts_only=True, num_ports=2, timeout_s=300)


def test_every_refit_ran_in_the_mode_asked(runs, request):
    train, gen = runs
    total = WARMUP + REFITS * WINDOWS
    assert train["version"] == gen["version"] == total, (train["version"], gen["version"])
    delta = request.node.callspec.params["runs"] == "delta_adam"
    assert train["modes"] == ({"full": 1, "delta": total - 1} if delta else {"full": total})


@pytest.mark.parametrize("side", [0, 1], ids=["train", "gen"])
def test_what_the_sender_or_worker_holds_does_not_grow_per_refit(runs, side):
    out = runs[side]
    assert out["held_end"]["objects"] > 1000, out["held_end"]  # the walk reached the session
    for figure in ("objects", "items"):
        grew = [w["held"][figure] for w in out["windows"]]
        assert sorted(grew)[-2] < BOUND, (figure, grew)


@pytest.mark.parametrize("side", [0, 1], ids=["train", "gen"])
def test_no_type_gains_live_objects_per_refit(runs, side):
    windows = [w["types"] for w in runs[side]["windows"]]
    for name in set().union(*windows):
        grew = [w.get(name, 0) for w in windows]
        assert sorted(grew)[-2] < (1 if name.startswith("megatron_reshard.") else BOUND), \
            (name, grew)
