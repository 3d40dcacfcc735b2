"""What a long-lived refit process keeps per refit, measured directly (issue 52 follow-up).

The soak's RSS slope cannot tell a Python structure that grows per refit from the
allocator's arenas or torch's caches. This probe runs one ``RefitSender`` (1 training
rank, the demo's dense model, gloo, CPU) refitting one generation rank (the worker
extension over a vLLM-layout model) many times, no faults, no model switch (optionally
delta refits and an Adam step before each), and on both sides marks the points after the
warm-up and after each window of ``refits`` refits. Three measures (``MEASURES``):
``traced``: ``tracemalloc`` snapshots compared by traceback, ``gc.get_objects()`` counts by
type and the native figures; ``native``: the native figures alone (glibc's bytes in use,
RSS before and after ``malloc_trim``, CPU tensor storages, threads, fds), undisturbed by
tracemalloc's own tables; ``counts``: live objects by type and what the sender or worker
holds (``reachable``), cheap enough for a test. A figure that grows by about the same in
every window grows per refit; one that stops growing was warm-up.

The rank functions are module-level (they travel to the pool's spawned workers by name).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import linecache
import os
import tempfile
import tracemalloc
import types
from collections import Counter, deque
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.testing.optimizer_steps import adam_step_
from megatron_reshard.testing.vllm_like import build_vllm_like_model
from megatron_reshard.tools.e2e import ModuleWorker
from megatron_reshard.tools.tiny_source import tiny_source
from megatron_reshard.wire.codec import decode_payload

TIMEOUT_S = 60.0
FRAMES = 12  # traceback depth tracemalloc keeps: enough to reach our frames from torch's
_LIB_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _join(job):
    """The launch's control store (process 0 hosts it) and this process's own one-rank
    world (the training side needs one for megatron's parallel state)."""
    control = dist.TCPStore(job.host, job.ports[0], job.nprocs, job.rank == 0,
                            timeout=timedelta(seconds=120))
    side = "train" if job.rank == 0 else "gen"
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{side}", control), rank=0,
                            world_size=1, timeout=timedelta(seconds=TIMEOUT_S))
    return control


def _type_counts() -> Counter:
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


_COUNTS_LINE = _type_counts.__code__.co_firstlineno + 1  # its Counter: the probe's own


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _native() -> dict:
    """What the C side holds: glibc's bytes in use (``uordblks`` + ``hblkhd``: torch's CPU
    tensors, gloo's buffers and Python's arenas alike; a native leak grows it, the
    allocator's fragmentation does not), resident memory before and after
    ``malloc_trim(0)``, the bytes and count of live CPU tensor storages, threads, fds."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    out = {"malloc_in_use": info.uordblks + info.hblkhd, "rss": _rss()}
    libc.malloc_trim(0)
    out["rss_trimmed"] = _rss()
    storages = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
            try:
                st = o.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                pass
    out.update(tensor_bytes=sum(storages.values()), tensor_storages=len(storages),
               threads=len(os.listdir("/proc/self/task")), fds=len(os.listdir("/proc/self/fd")))
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mark(path: str) -> dict:
    """One measuring point: collect, then the native figures, live objects by type and a
    tracemalloc snapshot, dumped to ``path`` (a snapshot kept alive would be counted by the
    next point: its traces are tuples)."""
    gc.collect()
    native = _native()
    counts = _type_counts()
    tracemalloc.take_snapshot().dump(path)
    return {"counts": counts, "path": path, "native": native}


def _load(mark: dict) -> tracemalloc.Snapshot:
    """The mark's snapshot less the probe's own allocations (its counters, native figures,
    loaded snapshots: allocated in this file, tracemalloc's, ctypes' or a frozen module's)."""
    return tracemalloc.Snapshot.load(mark["path"]).filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__),
         tracemalloc.Filter(False, ctypes.__file__), tracemalloc.Filter(False, "<frozen *>"),
         tracemalloc.Filter(False, __file__, _COUNTS_LINE, all_frames=True)])


def _ours(frames) -> bool:
    return any(f.filename.startswith(_LIB_ROOT) for f in frames)


def _site(trace) -> list[str]:
    """The traceback of a growing site, innermost last, as ``file:line code``."""
    out = []
    for f in trace:
        path = f.filename
        short = path[len(_LIB_ROOT) - len("megatron_reshard"):] if path.startswith(_LIB_ROOT) \
            else "/".join(path.split("/")[-2:])
        out.append(f"{short}:{f.lineno} {linecache.getline(f.filename, f.lineno).strip()}")
    return out


def _growth(a: dict, b: dict, top: int) -> dict:
    """What grew from mark ``a`` to mark ``b``: bytes and blocks of the top sites (by
    traceback), of our sites only, and live objects by type."""
    new, old = _load(b), _load(a)
    stats = new.compare_to(old, "traceback")
    grew = [s for s in stats if s.size_diff > 0]
    rows = [{"bytes": s.size_diff, "blocks": s.count_diff, "ours": _ours(s.traceback),
             "site": _site(s.traceback)} for s in grew]
    types = {k: b["counts"][k] - a["counts"].get(k, 0) for k in b["counts"]
             if b["counts"][k] - a["counts"].get(k, 0) > 0}
    traced = [sum(t.size for t in snap.traces) for snap in (old, new)]
    return {"traced": traced[1] - traced[0], "traced_end": traced[1],
            "net_bytes": sum(s.size_diff for s in stats),
            "grew_bytes": sum(r["bytes"] for r in rows),
            "ours_bytes": sum(r["bytes"] for r in rows if r["ours"]),
            "top": rows[:top], "top_ours": [r for r in rows if r["ours"]][:top],
            "types": dict(sorted(types.items(), key=lambda kv: -kv[1])[:top]),
            "native": {k: b["native"][k] - a["native"][k] for k in b["native"]}}


def _measure(refit, root, warmup: int, refits: int, windows: int, top: int) -> dict:
    """Warm up, then ``windows`` windows of ``refits`` refits each, marking the points
    between; the growth of each window (``root``: unused here, see ``count_types``)."""
    with tempfile.TemporaryDirectory(prefix="refit_memory_") as tmp:
        tracemalloc.start(FRAMES)
        for _ in range(warmup):
            refit()
        marks = [_mark(os.path.join(tmp, "0"))]
        for i in range(1, windows + 1):
            for _ in range(refits):
                refit()
            marks.append(_mark(os.path.join(tmp, str(i))))
        tracemalloc.stop()
        grown = [_growth(a, b, top) for a, b in zip(marks, marks[1:])]
        return {"windows": grown, "refits": refits, "warmup": warmup,
                "traced_end": grown[-1]["traced_end"], "native_end": marks[-1]["native"]}


def native_only(refit, root, warmup: int, refits: int, windows: int, top: int = 0) -> dict:
    """The native figures alone (``_native``: no tracemalloc, whose own tables are
    allocated with the C allocator, no type counts kept): per window, their growth."""
    for _ in range(warmup):
        refit()
    gc.collect()
    marks = [_native()]
    for _ in range(windows):
        for _ in range(refits):
            refit()
        gc.collect()
        marks.append(_native())
    return {"native_windows": [{k: b[k] - a[k] for k in b} for a, b in zip(marks, marks[1:])],
            "refits": refits, "warmup": warmup, "native_end": marks[-1]}


_LEAVES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.CodeType, types.FrameType)


def reachable(root) -> dict:
    """What ``root`` holds: the objects reachable from it (``gc.get_referents``, untracked
    ones such as ints and strings included, each counted once) and the summed ``len`` of
    the containers among them. Modules, classes, functions and frames are counted but not
    entered (a function's globals reach the whole program). A list or dict appended to
    per refit, a cache keyed by version or tensor id, work handles kept: each grows it."""
    seen = {id(root)}
    todo, objects, items = [root], 0, 0
    while todo:
        obj = todo.pop()
        objects += 1
        if isinstance(obj, (list, tuple, dict, set, frozenset, deque)):
            items += len(obj)
        if isinstance(obj, _LEAVES):
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen:
                seen.add(id(ref))
                todo.append(ref)
    return {"objects": objects, "items": items}


def count_types(refit, root, warmup: int, refits: int, windows: int, top: int = 0) -> dict:
    """The cheap form of ``_measure`` (no tracemalloc), for the tests: per window, the
    types whose count of live objects grew, and the growth of what ``root`` (the sender or
    the worker) holds (``reachable``)."""
    for _ in range(warmup):
        refit()
    gc.collect()
    marks = [(_type_counts(), reachable(root))]
    for _ in range(windows):
        for _ in range(refits):
            refit()
        gc.collect()
        marks.append((_type_counts(), reachable(root)))
    grown = [{"types": {k: n - a.get(k, 0) for k, n in b.items() if n > a.get(k, 0)},
              "held": {k: held_b[k] - held_a[k] for k in held_b}}
             for (a, held_a), (b, held_b) in zip(marks, marks[1:])]
    return {"windows": grown, "refits": refits, "warmup": warmup,
            "held_end": marks[-1][1]}


def train_rank(job, measure, delta: bool = False, adam: bool = False) -> dict:
    """The long-lived sender: the demo's dense model (2 layers, bf16), one refit group,
    ``measure(refit)``'s figures; ``delta``: delta refits; ``adam``: an Adam step
    (``testing.optimizer_steps``, 1-3% of the elements change) before each refit, as an RL
    loop does."""
    control = _join(job)
    model, source, _, _ = tiny_source("dense", 1, seed=0, num_layers=2)
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 2, "gloo", TIMEOUT_S,
                               who="train rank 0", label="refit group")
    sender = RefitSender(source, group, delta=delta)
    steps = [0]
    modes = Counter()

    def refit():
        if adam:
            steps[0] += 1
            adam_step_(model, steps[0])
        modes[sender.refit()["mode"]] += 1

    out = measure(refit, sender)
    out.update(version=sender.version, modes=dict(modes))
    destroy_refit_group(group, TIMEOUT_S)
    return out


def gen_rank(job, measure) -> dict:
    """The generation rank: the worker extension over a vLLM-layout model (TP1, bf16),
    ``measure(refit)``'s figures."""
    control = _join(job)
    payload = decode_payload(control.get("payload"))  # waits until the sender published it
    model = build_vllm_like_model(payload["hf_config"], 0, 1, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1]], 1, 2, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload)
    out = measure(worker.refit, worker)
    out["version"] = worker.refit_weights_state()["version"]
    worker.destroy_refit_groups(TIMEOUT_S)
    return out


MEASURES = {"traced": _measure, "counts": count_types, "native": native_only}


def probe_job(job, warmup: int, refits: int, windows: int, top: int, delta: bool = False,
              adam: bool = False, counts_only: bool = False, measure: str = "traced") -> dict:
    """One side of the probe (process 0 trains, process 1 generates): ``measure``'s figures
    (``MEASURES``: ``_measure``, ``count_types``, ``native_only``); ``counts_only``: the
    tests' ``"counts"``."""
    measure = functools.partial(MEASURES["counts" if counts_only else measure], warmup=warmup,
                                refits=refits, windows=windows, top=top)
    if job.rank == 0:
        return train_rank(job, measure, delta, adam)
    return gen_rank(job, measure)


def _native_text(d: dict, n: int) -> str:
    return (f"malloc in use {d['malloc_in_use'] / n:+.1f} B/refit, RSS {d['rss'] / n:+.1f} "
            f"(trimmed {d['rss_trimmed'] / n:+.1f}) B/refit, CPU tensors "
            f"{d['tensor_bytes'] / n:+.1f} B/refit ({d['tensor_storages']:+d} storages), "
            f"threads {d['threads']:+d}, fds {d['fds']:+d}")


def native_lines(side: str, out: dict) -> list[str]:
    """``native_only``'s figures: per window, the native growth per refit."""
    n, end = out["refits"], out["native_end"]
    lines = [f"== {side} (native only): warm-up {out['warmup']}, "
             f"{len(out['native_windows'])} windows of {n} refits, version {out['version']}"
             f"{', modes ' + str(out['modes']) if 'modes' in out else ''}, malloc in use "
             f"{end['malloc_in_use'] / 2**20:.1f} MiB, RSS trimmed "
             f"{end['rss_trimmed'] / 2**20:.1f} MiB"]
    for i, d in enumerate(out["native_windows"], 1):
        lines.append(f"  window {i}: {_native_text(d, n)}")
    return lines


def report_lines(side: str, out: dict) -> list[str]:
    """The side's figures: per window, traced Python bytes and the native figures per
    refit; then the last window's top growing sites (ours first) and the live objects by
    type that grew in the first and the last window."""
    n = out["refits"]
    if "native_windows" in out:
        return native_lines(side, out)
    windows = out["windows"]
    lines = [f"== {side}: warm-up {out['warmup']}, {len(windows)} windows of {n} refits, "
             f"version {out['version']}"
             f"{', modes ' + str(out['modes']) if 'modes' in out else ''}, "
             f"Python traced at end {out['traced_end'] / 2**20:.2f} MiB, malloc in use "
             f"{out['native_end']['malloc_in_use'] / 2**20:.1f} MiB"]
    for i, g in enumerate(windows, 1):
        lines.append(f"  window {i}: Python traced {g['traced'] / n:+.1f} B/refit (sites of ours "
                     f"{g['ours_bytes'] / n:+.1f}); {_native_text(g['native'], n)}")
    last, first = windows[-1], windows[0]
    for title, rows in (("sites of ours that grew (last window)", last["top_ours"]),
                        ("all sites that grew (last window)", last["top"])):
        lines.append(f"  {title}:")
        for r in rows or [{"bytes": 0, "blocks": 0, "site": ["(none)"]}]:
            lines.append(f"    {r['bytes'] / n:+8.2f} B/refit {r['blocks']:+5d} blocks  "
                         f"{r['site'][-1]}")
            for frame in reversed(r["site"][:-1][-3:]):
                lines.append(f"        from {frame}")
    lines.append("  live objects by type, growth in the first | last window:")
    names = list(dict.fromkeys([*last["types"], *first["types"]]))
    for t in names or ["(none)"]:
        lines.append(f"    {first['types'].get(t, 0):+6d} | {last['types'].get(t, 0):+6d}  {t}")
    return lines


__all__ = ["MEASURES", "count_types", "gen_rank", "native_only", "probe_job", "reachable",
           "report_lines", "train_rank"]
