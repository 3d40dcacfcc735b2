"""The fixed cost of one refit, phase by phase, on the CPU (issue 51 item 4).

    python scripts/bench_refit_overhead.py [--preset moe] [--layers N] [--refits 60] [--ab]

Two worlds of one process each on this machine: a training rank (a demo preset's real
megatron-core model, TP1 PP1, ``RefitSender``) and a generation rank (the vLLM-layout model
behind the worker extension, ``ModuleWorker``: the same ``RefitWorkerState.refit`` vLLM's
weight-transfer engine calls), joined by one refit group over gloo with
``transport="colocated"`` (shared memory: the CPU form of CUDA IPC). The model is tiny, so
what a refit costs here is almost all fixed cost: the votes, the per-refit Python work and
the barriers, not bytes.

Each timed refit starts on both sides from a barrier (a raw all-reduce on the group's
backend, outside the refit) after an in-place weight change (an optimizer step's
stand-in). Printed: the median per-phase split of one refit on each side (``follow``:
re-reading the model's / vLLM's tensors; ``version``: the version vote; ``bulk``; ``misc``:
the packed broadcast of the other params; ``commit``: the commit vote; ``derived``: the
generation side's refresh of derived weights; ``rest``: the call's time outside them), the
collective round trips one refit issues on the refit group (by kind, counted by a spy on
the group object: the real call still runs), the colocated transport's shared-memory
barrier waits, the waits handed to the group's daemon threads, the group's store calls and
the walks over vLLM's modules, and, in the same run on the same group, a raw gloo all-gather
round trip (``pg.allgather(...).wait()``: the floor of one vote) and the library's own
``all_gather_ints`` / ``all_reduce`` over it (fault-aware waits), with each vote's ratio
to the raw round trip. The last refit is checked bit for bit against
the reference (full HF tensors gathered on the training side, sliced by vLLM's layout).
``--ab``: every other refit runs with the two runtime cuts of issue 51 item 4 switched off
(``_set_cuts``), so both tables come from one run; numbers in docs/MEASUREMENTS.md
("Per-refit fixed cost").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

TRAIN_PHASES = ("follow+rest", "version", "bulk", "misc", "commit")
GEN_PHASES = ("follow", "version", "bulk", "misc", "commit", "derived", "rest")
GROUP_CALLS = ("allreduce", "allgather", "broadcast", "send", "recv", "barrier")
TIMEOUT_S = 60.0
SPIN_S = 5e-4  # faults.SPIN_S's default, restored after an --ab refit without it


class CallCount:
    """Counts the collective calls made on one refit group object (a spy: each forwards to
    the group's own method) and the colocated transport's shared-memory barrier waits."""

    def __init__(self, group, model=None):
        from megatron_reshard.engine.host_flags import HostFlags

        self.counts: Counter = Counter()
        for name in GROUP_CALLS:
            setattr(group, name, self._counting(name, getattr(group, name)))
        # a wait or a store call handed to one of the group's daemon threads
        group.threads.submit = self._counting("waiter hand-off", group.threads.submit)
        # the group's TCPStore: its fault board's reads and posts, the colocated
        # transport's (built on the first refit, from ``group.store``)
        group.store = group.board.store = _CountingStore(group.store, self)
        if model is not None:  # walks over vLLM's modules (the derived refresh's, ...)
            model.named_modules = self._counting("module walk", model.named_modules)
        real_wait = HostFlags.wait

        def wait(flags, *args, **kwargs):
            self.counts["shm barrier wait"] += 1
            return real_wait(flags, *args, **kwargs)

        HostFlags.wait = wait

    def _counting(self, name, fn):
        def call(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return call

    def take(self) -> dict:
        out, self.counts = dict(self.counts), Counter()
        return out


class _CountingStore:
    """A store that counts each call (one round trip to the store's host) and forwards it."""

    CALLS = ("add", "get", "set", "check", "wait", "compare_set", "delete_key", "multi_get",
             "multi_set")

    def __init__(self, store, counter: CallCount):
        self._store, self._counter = store, counter

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if name in self.CALLS:
            return self._counter._counting("store call", attr)
        return attr


def _align(group) -> None:
    """Both ranks leave together: a raw all-reduce on the group's backend (not counted)."""
    t = torch.zeros(1)
    group.pg.allreduce([t]).wait()


def _round_trips(group, iters: int) -> dict:
    """Medians (ms) of a raw gloo all-gather round trip on the group's backend, and of the
    library's vote collectives over the same group (fault-board waits included)."""
    from megatron_reshard.groups.collectives import all_gather_ints, all_reduce

    mine = torch.zeros(12, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(group.size())]
    times: dict = {"raw_allgather": [], "raw_allreduce": [], "all_gather_ints": [],
                   "all_reduce": []}
    for _ in range(iters):
        _align(group)
        t0 = time.perf_counter()
        group.pg.allgather([out], [mine]).wait()
        times["raw_allgather"].append(time.perf_counter() - t0)
        _align(group)
        t0 = time.perf_counter()
        group.pg.allreduce([mine]).wait()
        times["raw_allreduce"].append(time.perf_counter() - t0)
        _align(group)
        t0 = time.perf_counter()
        all_gather_ints([0] * 12, group)
        times["all_gather_ints"].append(time.perf_counter() - t0)
        _align(group)
        t0 = time.perf_counter()
        all_reduce(mine, group, dist.ReduceOp.MAX, "the bench")
        times["all_reduce"].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _join(job, side: str):
    control = dist.TCPStore(job.host, job.ports[0], job.nprocs, job.rank == 0,
                            timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{side}", control), rank=0,
                            world_size=1, timeout=timedelta(seconds=TIMEOUT_S))
    return control


def _train(job, args: dict) -> dict:
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.testing.vllm_like import expected_vllm_shard, vllm_param_shapes
    from megatron_reshard.tools.e2e import perturb_, tensor_digest
    from megatron_reshard.tools.tiny_source import tiny_source

    control = _join(job, "train")
    model, source, family, vocab = tiny_source(args["preset"], 1, pp=1, seed=0,
                                               **args["overrides"])
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 2, "gloo", TIMEOUT_S,
                               transport="colocated", who="train rank 0")
    sender = RefitSender(source, group)
    counter = CallCount(group)
    rows, calls = [], []
    profile = cProfile.Profile() if args.get("profile") else None
    for k in range(1, args["warmup"] + args["refits"] + 1):
        perturb_(model, k)  # in place, as an optimizer step writes
        cuts = _set_cuts(args, k - 1)
        _align(group)
        counter.take()
        profiled = profile is not None and k > args["warmup"]
        out, call = _timed(sender.refit, profile if profiled else None)
        calls.append(counter.take())
        timed = {"version": out["version_s"], "bulk": out["bulk_s"], "misc": out["misc_s"],
                 "commit": out["commit_s"]}
        rows.append({"call": call, **timed, "follow+rest": call - sum(timed.values()),
                     "cuts": cuts})
    # the reference of the last refit: full HF tensors, sliced by vLLM's layout
    full = {n: t.cpu() for n, t in
            gather_full_hf_state_dict(model, family=family, vocab_size=vocab).items()}
    cfg = source.hf_config
    control.set("expected", json.dumps({
        n: tensor_digest(expected_vllm_shard(cfg, n, full, 0, 1, 1))
        for n in vllm_param_shapes(cfg, 0, 1, 1)}))
    trips = _round_trips(group, args["trips"])
    control.wait(["gen_done"])
    destroy_refit_group(group, TIMEOUT_S)
    return {"rows": rows[args["warmup"]:], "calls": calls[args["warmup"]:], "trips": trips,
            "params": len(sender.loop.param_names(other=True)[0]),
            "profile": _profile_text(profile, args.get("profile"))}


def _timed(refit, profile) -> tuple:
    """``refit()``'s result and seconds, under ``profile`` (a ``cProfile.Profile``) if given."""
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    try:
        out = refit()
    finally:
        if profile is not None:
            profile.disable()
    return out, time.perf_counter() - t0


def _gen(job, args: dict) -> dict:
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.tools.e2e import ModuleWorker, tensor_digest
    from megatron_reshard.wire.codec import decode_payload

    control = _join(job, "gen")
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], 0, 1, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1]], 1, 2, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload, {})
    group = worker.refit_worker_state.groups[0]
    counter = CallCount(group, model)
    rows, calls = [], []
    profile = cProfile.Profile() if args.get("profile") else None
    state = worker.refit_worker_state
    underived = getattr(state, "_underived", None)  # None: a tree before that cut
    for k in range(args["warmup"] + args["refits"]):
        cuts = _set_cuts(args, k)
        if underived is not None:
            state._underived = underived if cuts else None
        _align(group)
        counter.take()
        profiled = profile is not None and k >= args["warmup"]
        stats, call = _timed(worker.refit, profile if profiled else None)
        calls.append(counter.take())
        timed = {"follow": stats["follow_s"], "version": stats["version_s"],
                 "bulk": stats["bulk_s"], "misc": stats["misc_s"],
                 "commit": stats["commit_s"], "derived": stats["derived_s"]}
        rows.append({"call": call, **timed, "rest": call - sum(timed.values()), "cuts": cuts})
    trips = _round_trips(group, args["trips"])
    expected = json.loads(control.get("expected"))
    actual = {n: tensor_digest(p) for n, p in model.named_parameters()}
    wrong = sorted(n for n in set(expected) | set(actual) if expected.get(n) != actual.get(n))
    control.set("gen_done", "1")
    worker.destroy_refit_groups(TIMEOUT_S)
    return {"rows": rows[args["warmup"]:], "calls": calls[args["warmup"]:], "trips": trips,
            "params": len(actual), "wrong": wrong,
            "profile": _profile_text(profile, args.get("profile"))}


def _set_cuts(args: dict, index: int) -> bool:
    """With ``--ab``, every other refit (by index, alike on both sides) runs with this
    branch's two runtime cuts switched off, as the code before them ran: votes waited for
    on a waiter thread at once (``faults.SPIN_S = 0``) and the derived refresh's module
    walks (the worker state's ``_underived`` cleared, on the generation side). Returns
    whether they are on for this refit."""
    from megatron_reshard.groups import faults

    on = not (args.get("ab") and index % 2)
    faults.SPIN_S = args.get("spin_s", SPIN_S) if on else 0.0
    return on


def _profile_text(profile, top: int):
    if profile is None:
        return None
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _job(job, args: dict) -> dict:
    from megatron_reshard.engine.host_flags import HostFlags
    from megatron_reshard.groups import faults

    torch.set_num_threads(1)
    # what the spies and ``--ab`` change in this process, given back after the job (the
    # test suite's pool runs later jobs in the same processes)
    wait, spin = HostFlags.wait, faults.SPIN_S
    try:
        return (_train if job.rank == 0 else _gen)(job, args)
    finally:
        HostFlags.wait, faults.SPIN_S = wait, spin


def _medians(rows: list[dict], phases) -> dict:
    return {p: 1e3 * statistics.median(r[p] for r in rows) for p in ("call", *phases)}


def report(train: dict, gen: dict) -> str:
    """The tables of one run (see the module docstring); with ``--ab`` one per half."""
    floor = gen["trips"]["raw_allgather"]
    lines = [f"refits timed: {len(gen['rows'])}; params: {train['params']} sent, "
             f"{gen['params']} vLLM params written"]
    halves = sorted({r["cuts"] for r in gen["rows"]})
    for on in halves:
        pick = lambda side: [r for r in side["rows"] if r["cuts"] == on]  # noqa: E731
        calls = [c for c, r in zip(gen["calls"], gen["rows"]) if r["cuts"] == on]
        what = "" if len(halves) == 1 else (" with this branch's cuts" if on else
                                            " with the votes' waiter threads and the derived "
                                            "walks as before (every other refit)")
        lines += _table(pick(train), pick(gen), calls, floor, what)
    tr = gen["trips"]
    lines.append("one round trip on the same group, same run (gen side, median ms):")
    for k, v in tr.items():
        lines.append(f"  {k:<16}{v:>8.3f}   x{v / floor:.2f} of the raw all-gather")
    lines.append("bit-exact against the reference: " +
                 ("yes" if not gen["wrong"] else f"NO: {gen['wrong'][:5]}"))
    return "\n".join(lines)


def _table(train_rows: list, gen_rows: list, gen_calls: list, floor: float,
           what: str) -> list[str]:
    t, g = _medians(train_rows, TRAIN_PHASES), _medians(gen_rows, GEN_PHASES)
    lines = [f"median ms per refit{what} ({len(gen_rows)} refits; a refit call, by phase):",
             f"  {'side':<6}{'call':>8}" + "".join(f"{p:>12}" for p in GEN_PHASES),
             f"  {'gen':<6}{g['call']:>8.3f}" + "".join(f"{g[p]:>12.3f}" for p in GEN_PHASES),
             f"  {'train':<6}{t['call']:>8.3f}" + "".join(
                 f"{t[p]:>12.3f}" for p in ("follow+rest", "version", "bulk", "misc", "commit")),
             "  (train: follow and rest are one column, 'follow+rest')"]
    calls = Counter()
    for c in gen_calls:
        calls.update(c)
    per = {k: v / len(gen_calls) for k, v in sorted(calls.items())}
    trips = sum(v for k, v in per.items() if k in GROUP_CALLS)
    lines.append(f"  per refit on the refit group (gen side): {trips:g} collective round trips "
                 f"({', '.join(f'{k} {v:g}' for k, v in per.items() if k in GROUP_CALLS)}); "
                 f"{per.get('shm barrier wait', 0):g} shared-memory barrier waits, "
                 f"{per.get('waiter hand-off', 0):g} waits handed to a thread, "
                 f"{per.get('store call', 0):g} store calls, "
                 f"{per.get('module walk', 0):g} walks over vLLM's modules")
    lines.append(f"  against the raw all-gather: version vote x{g['version'] / floor:.2f}, "
                 f"commit vote x{g['commit'] / floor:.2f}, the whole call x{g['call'] / floor:.1f}")
    return lines


def main(argv=None) -> int:
    from megatron_reshard.tools.run_config import MODEL_PRESETS
    from megatron_reshard.tools.worlds import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="moe", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    ap.add_argument("--refits", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trips", type=int, default=200, help="round trips timed per kind")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print each side's N costliest functions of the "
                         "timed refits (cProfile, by own time; the split is then slower)")
    ap.add_argument("--ab", action="store_true",
                    help="every other refit without this branch's two runtime cuts (the "
                         "votes' spin, the derived walk skip): both tables from one run")
    ap.add_argument("--spin-ms", type=float, default=SPIN_S * 1e3,
                    help="faults.SPIN_S for the refits with the cuts on (ms)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args(argv)
    overrides = {} if args.layers is None else {"num_layers": args.layers}
    plan = {"preset": args.preset, "overrides": overrides, "refits": args.refits,
            "warmup": args.warmup, "trips": args.trips, "profile": args.profile, "ab": args.ab,
            "spin_s": args.spin_ms * 1e-3}
    with WorkerPool(2) as pool:
        train, gen = pool.run(_job, 2, plan, num_ports=2, timeout_s=600)
    print(report(train, gen))
    for side, result in (("generation", gen), ("training", train)):
        if result.get("profile"):
            print(f"--- the {side} side's timed refits, by own time (cProfile)")
            print(result["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"train": train, "gen": gen, "plan": plan}, f)
    return 0 if not gen["wrong"] else 1


if __name__ == "__main__":
    sys.exit(main())
