"""What a long-lived refit process keeps per refit, measured directly (issue 52 follow-up).

The soak's RSS slope cannot tell a Python structure that grows per refit from the
allocator's arenas or torch's caches. This probe runs one ``RefitSender`` (1 training
rank, the demo's dense model, gloo, CPU) refitting one generation rank (the worker
extension over a vLLM-layout model) many times, no faults, no model switch, and on both
sides takes ``tracemalloc`` snapshots and ``gc.get_objects()`` counts by type at three
points: after the warm-up, after ``refits`` more, after ``refits`` more again. A site that
grows by about the same bytes in both windows grows per refit; one that grew only in the
first is warm-up. Figures per refit are the second window's growth over its refits.

The rank functions are module-level (they travel to the pool's spawned workers by name).
"""

from __future__ import annotations

import gc
import linecache
import os
import tempfile
import tracemalloc
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.testing.vllm_like import build_vllm_like_model
from megatron_reshard.tools.e2e import ModuleWorker
from megatron_reshard.tools.tiny_source import tiny_source
from megatron_reshard.wire.codec import decode_payload

TIMEOUT_S = 60.0
FRAMES = 12  # traceback depth tracemalloc keeps: enough to reach our frames from torch's
_LIB_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _join(job, side_ranks: int = 1):
    """The launch's control store (process 0 hosts it) and this process's own one-rank
    world (the training side needs one for megatron's parallel state)."""
    control = dist.TCPStore(job.host, job.ports[0], job.nprocs, job.rank == 0,
                            timeout=timedelta(seconds=120))
    side = "train" if job.rank == 0 else "gen"
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{side}", control), rank=0,
                            world_size=side_ranks, timeout=timedelta(seconds=TIMEOUT_S))
    return control


def _type_counts() -> Counter:
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


_COUNTS_LINE = _type_counts.__code__.co_firstlineno + 1  # its Counter: the probe's own


def _mark(path: str) -> dict:
    """One measuring point: collect, then live objects by type and a tracemalloc snapshot,
    dumped to ``path`` (a snapshot kept alive would be counted by the next point: its
    traces are tuples)."""
    gc.collect()
    counts = _type_counts()
    tracemalloc.take_snapshot().dump(path)
    return {"counts": counts, "path": path}


def _load(mark: dict) -> tracemalloc.Snapshot:
    """The mark's snapshot less the probe's own allocations (its counters, loaded snapshots)."""
    return tracemalloc.Snapshot.load(mark["path"]).filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__),
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
            "types": dict(sorted(types.items(), key=lambda kv: -kv[1])[:top])}


def _measure(refit, warmup: int, refits: int, top: int) -> dict:
    """Warm up, then two windows of ``refits`` refits each, marking the points between."""
    with tempfile.TemporaryDirectory(prefix="refit_memory_") as tmp:
        tracemalloc.start(FRAMES)
        for _ in range(warmup):
            refit()
        marks = [_mark(os.path.join(tmp, "0"))]
        for i in (1, 2):
            for _ in range(refits):
                refit()
            marks.append(_mark(os.path.join(tmp, str(i))))
        tracemalloc.stop()
        second = _growth(marks[1], marks[2], top)
        return {"first": _growth(marks[0], marks[1], top), "second": second,
                "refits": refits, "warmup": warmup, "traced_end": second["traced_end"]}


def train_rank(job, warmup: int, refits: int, top: int) -> dict:
    """The long-lived sender: the demo's dense model (2 layers, bf16), one refit group."""
    control = _join(job)
    model, source, _, _ = tiny_source("dense", 1, seed=0, num_layers=2)
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 2, "gloo", TIMEOUT_S,
                               who="train rank 0", label="refit group")
    sender = RefitSender(source, group)
    out = _measure(sender.refit, warmup, refits, top)
    out["version"] = sender.version
    destroy_refit_group(group, TIMEOUT_S)
    return out


def gen_rank(job, warmup: int, refits: int, top: int) -> dict:
    """The generation rank: the worker extension over a vLLM-layout model (TP1, bf16)."""
    control = _join(job)
    payload = decode_payload(control.get("payload"))  # waits until the sender published it
    model = build_vllm_like_model(payload["hf_config"], 0, 1, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1]], 1, 2, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload)
    out = _measure(worker.refit, warmup, refits, top)
    out["version"] = worker.refit_weights_state()["version"]
    worker.destroy_refit_groups(TIMEOUT_S)
    return out


def probe_job(job, warmup: int, refits: int, top: int) -> dict:
    return (train_rank if job.rank == 0 else gen_rank)(job, warmup, refits, top)


def report_lines(side: str, out: dict) -> list[str]:
    """The side's figures: traced bytes per refit in each window, then the second window's
    top growing sites (ours first) and types."""
    n = out["refits"]
    lines = [f"== {side}: warm-up {out['warmup']}, two windows of {n} refits, version "
             f"{out['version']}, traced at end {out['traced_end'] / 2**20:.2f} MiB"]
    for name in ("first", "second"):
        g = out[name]
        lines.append(f"  {name} window: traced {g['traced'] / n:+.1f} B/refit, sites that grew "
                     f"{g['grew_bytes'] / n:+.1f} B/refit (ours {g['ours_bytes'] / n:+.1f}), "
                     f"net {g['net_bytes'] / n:+.1f} B/refit")
    second, first = out["second"], out["first"]
    for title, rows in (("sites of ours that grew (second window)", second["top_ours"]),
                        ("all sites that grew (second window)", second["top"])):
        lines.append(f"  {title}:")
        for r in rows or [{"bytes": 0, "blocks": 0, "site": ["(none)"]}]:
            lines.append(f"    {r['bytes'] / n:+8.1f} B/refit {r['blocks']:+5d} blocks  "
                         f"{r['site'][-1]}")
            for frame in reversed(r["site"][:-1][-3:]):
                lines.append(f"        from {frame}")
    lines.append("  live objects by type, growth first window | second window:")
    names = list(dict.fromkeys([*second["types"], *first["types"]]))
    for t in names or ["(none)"]:
        lines.append(f"    {first['types'].get(t, 0):+6d} | {second['types'].get(t, 0):+6d}  {t}")
    return lines


__all__ = ["probe_job", "report_lines", "train_rank", "gen_rank"]
