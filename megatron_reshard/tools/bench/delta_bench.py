"""Delta refits against full refits on CPU (gloo): bytes and time per refit, same run.

One pool of ``1 + gen`` spawned processes: a training rank (PP1 TP1) holding a bf16
megatron-core model (the dense preset widened: ``--hidden``, ``--ffn``, ``--layers``,
``--vocab``) and ``gen`` generation ranks (gen TP, the vLLM-layout model) joined by one
refit group. Per run:

1. ``--iters`` full refits (the sender's vote says off: the engine moves every byte; the
   training side still keeps its base, as a delta-enabled sender does), the first one
   untimed (plan verification);
2. per changed fraction: every bulk param of the training model gets that fraction of its
   elements changed (seeded; ``--change ulp``: one unit in the last place up or down, what
   an optimizer step at RL learning rates does, ``scripts/measure_change_rate.py``;
   ``random``: new values), then ``--iters`` delta refits timed (the first is cut from the
   previous fraction's base, the others from the one before, all at the same fraction);
3. the raw transport figure: the same bytes each generation rank received, as one message
   per generation rank from the training rank on the refit group (all posted at once), timed.

Per fraction: bytes each generation rank received (max over ranks, the report's
``bytes_received``) against a full refit's (``full_bytes``), the training side's bytes
sent, messages, encodings, median refit time (training rank's ``refit()`` wall time: it
returns after every rank committed) and the raw figure. ``--checksums`` turns on the
end-to-end checksums (the result compared region by region with the sender's bits).

    python scripts/bench_delta.py [--fractions 0.001,0.01,0.018,0.05,0.3,1] [--json out.json]
"""

from __future__ import annotations

import statistics
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.megatron.sender import RefitSender
from megatron_reshard.delta import DeltaConfig
from megatron_reshard.testing.vllm_like import build_vllm_like_model
from megatron_reshard.tools.e2e import ModuleWorker
from megatron_reshard.tools.tiny_source import tiny_source
from megatron_reshard.tools.worlds import WorkerPool
from megatron_reshard.wire.codec import decode_payload
from megatron_reshard.wire.records import RefitPayload

FRACTIONS = (0.001, 0.01, 0.018, 0.05, 0.3, 1.0)
TIMEOUT_S = 120.0


def _join(job, gen: int):
    control = dist.TCPStore(job.host, job.ports[0], job.nprocs, job.rank == 0,
                            timeout=timedelta(seconds=300))
    side, rank, size = ("train", 0, 1) if job.rank == 0 else ("gen", job.rank - 1, gen)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{side}", control), rank=rank,
                            world_size=size, timeout=timedelta(seconds=120))
    return control, side, rank


def change_(model, fraction: float, step: int, how: str) -> int:
    """Change ``fraction`` of every param's elements (seeded by step and name); returns how
    many elements changed bits."""
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{name}".encode()))
            flat = p.data.view(-1)
            pick = torch.rand(flat.numel(), generator=g) < fraction
            if how == "ulp":
                bits = flat.view(torch.int16)
                up = torch.rand(flat.numel(), generator=g) < 0.5
                bits[pick & up] += 1
                bits[pick & ~up] -= 1
            else:
                flat[pick] = flat[pick] * 1.5 + 0.0625
            changed += int(pick.sum())
    return changed


def _train(job, control, opts: dict) -> dict:
    gen = opts["gen"]
    model, source, _, _ = tiny_source("dense", gen, seed=0, timeout_minutes=2,
                                      num_layers=opts["layers"], hidden_size=opts["hidden"],
                                      ffn_hidden_size=opts["ffn"], vocab_size=opts["vocab"])
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 1 + gen, "gloo", TIMEOUT_S,
                               who="train rank 0", label="refit group")
    config = DeltaConfig(budget_bytes=1 << 40, keep="pinned")
    sender = RefitSender(source, group, verify_checksums=opts["checksums"], delta=config)
    params = sum(p.numel() for p in model.parameters())

    def timed() -> tuple[float, dict]:
        t0 = time.perf_counter()
        out = sender.refit()
        return time.perf_counter() - t0, out

    rows = []
    sender.delta = None  # the vote says off: full refits through the engine
    full_s = [timed()[0] for _ in range(opts["iters"] + 1)][1:]
    sender.delta = config
    _, first = timed()  # full again: the vote saw the last refit's base, now it holds one
    step = 0
    for fraction in opts["fractions"]:
        times, outs = [], []
        for _ in range(opts["iters"]):
            step += 1
            changed = change_(model, fraction, step, opts["change"])
            dt, out = timed()
            times.append(dt)
            outs.append(out)
        control.set(f"done/{fraction}", "1")
        rows.append({"fraction": fraction, "changed_last": changed, "refit_s": times,
                     "modes": [o["mode"] for o in outs], "bytes_sent": outs[-1]["bytes_sent"],
                     "delta": outs[-1].get("delta"), "full_reason": outs[-1]["full_reason"]})
    raw = _raw(group, control, gen, opts)
    destroy_refit_group(group, TIMEOUT_S)
    return {"params": params, "full_refit_s": full_s, "full_bytes_sent": first["bytes_sent"],
            "rows": rows, "raw": raw}


def _raw(group, control, gen: int, opts: dict) -> dict:
    """The raw figure: per fraction, each gen rank's received bytes as one message."""
    out = {}
    for fraction in opts["fractions"]:
        sizes = [int(control.get(f"got/{fraction}/{g}")) for g in range(gen)]
        times = []
        for _ in range(opts["iters"]):
            bufs = [torch.zeros(max(1, n), dtype=torch.uint8) for n in sizes]
            t0 = time.perf_counter()
            works = [group.send([b], 1 + g, 1) for g, b in enumerate(bufs)]
            for w in works:
                w.wait()
            group.recv([torch.zeros(1, dtype=torch.uint8)], 1, 2).wait()  # all arrived
            times.append(time.perf_counter() - t0)
        out[str(fraction)] = {"bytes": sizes, "s": times}
    return out


def _gen(job, control, gen_rank: int, opts: dict) -> dict:
    gen = opts["gen"]
    control.wait(["payload"])
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(RefitPayload.of(payload).hf_config, gen_rank, gen, 1, torch.bfloat16)
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1]], 1 + gen_rank, 1 + gen, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload, {"verify_checksums": opts["checksums"]})
    reports = []
    for _ in range(opts["iters"] + 2):
        worker.refit()
    full = worker.report()
    for fraction in opts["fractions"]:
        for _ in range(opts["iters"]):
            worker.refit()
        report = worker.report()
        reports.append({"fraction": fraction, "mode": report["mode"],
                        "bytes_received": report["bytes_received"],
                        "full_bytes": report["full_bytes"]})
        control.set(f"got/{fraction}/{gen_rank}", str(report["bytes_received"]))
    _raw_recv(worker, gen_rank, opts, reports)
    worker.destroy_refit_groups(TIMEOUT_S)
    return {"full": {"bytes_received": full["bytes_received"], "full_bytes": full["full_bytes"],
                     "mode": full["mode"]}, "rows": reports}


def _raw_recv(worker, gen_rank: int, opts: dict, reports: list) -> None:
    group = worker.refit_worker_state.groups[0]  # the worker's refit group (stage 0)
    for row in reports:
        n = max(1, row["bytes_received"])
        for _ in range(opts["iters"]):
            group.recv([torch.empty(n, dtype=torch.uint8)], 0, 1).wait()
            if gen_rank == 0:
                group.send([torch.ones(1, dtype=torch.uint8)], 0, 2).wait()


def delta_job(job, opts: dict):
    control, side, rank = _join(job, opts["gen"])
    if side == "train":
        return _train(job, control, opts)
    return _gen(job, control, rank, opts)


def summarize(results: list, opts: dict) -> dict:
    train, gens = results[0], results[1:]
    full_s = statistics.median(train["full_refit_s"])
    full_bytes = max(g["full"]["full_bytes"] for g in gens)
    rows = []
    for k, row in enumerate(train["rows"]):
        got = [g["rows"][k] for g in gens]
        recv = max(r["bytes_received"] for r in got)
        fb = max(r["full_bytes"] for r in got)
        raw = train["raw"][str(row["fraction"])]
        d = row["delta"] or {}
        rows.append({"fraction": row["fraction"], "modes": sorted(set(row["modes"])),
                     "full_reason": row["full_reason"],
                     "bytes_received_max": recv, "full_bytes": fb,
                     "received_vs_full": recv / fb if fb else None,
                     "bytes_sent": row["bytes_sent"],
                     "sent_vs_full": row["bytes_sent"] / train["full_bytes_sent"],
                     "messages_sent": d.get("messages"), "regions_sent": d.get("ops"),
                     "encodings": d.get("encodings"),
                     "refit_s": statistics.median(row["refit_s"]),
                     "vs_full_time": statistics.median(row["refit_s"]) / full_s,
                     "raw_s": statistics.median(raw["s"])})
    return {"params": train["params"], "gen": opts["gen"], "change": opts["change"],
            "full_refit_s": full_s, "full_bytes_per_gen_rank": full_bytes,
            "full_bytes_sent": train["full_bytes_sent"], "rows": rows}


def table(summary: dict) -> str:
    lines = [f"{summary['params']:,} params (bf16), train 1 -> gen TP{summary['gen']}, "
             f"change {summary['change']}; full refit {1e3 * summary['full_refit_s']:.1f} ms, "
             f"{summary['full_bytes_per_gen_rank']:,} bytes into each gen rank",
             "", "| changed | mode | bytes into a gen rank | of full | msgs sent | refit ms "
                 "| of full time | raw same bytes ms | encodings |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {100 * r['fraction']:g}% | {'/'.join(r['modes'])} "
                     f"| {r['bytes_received_max']:,} | {100 * r['received_vs_full']:.2f}% "
                     f"| {r['messages_sent']} | {1e3 * r['refit_s']:.1f} "
                     f"| {100 * r['vs_full_time']:.0f}% | {1e3 * r['raw_s']:.2f} "
                     f"| {r['encodings']} |")
    return "\n".join(lines)


def run(opts: dict, pool=None) -> dict:
    own = pool is None
    pool = pool or WorkerPool(1 + opts["gen"])
    try:
        results = pool.run(delta_job, 1 + opts["gen"], opts, num_ports=2,
                           timeout_s=opts.get("timeout_s", 1200))
    finally:
        if own:
            pool.close()
    return summarize(results, opts)


def default_opts(**over) -> dict:
    opts = dict(gen=2, layers=4, hidden=512, ffn=1536, vocab=8000, iters=3,
                fractions=list(FRACTIONS), change="ulp", checksums=False)
    opts.update(over)
    return opts


__all__ = ["FRACTIONS", "change_", "default_opts", "delta_job", "run", "summarize", "table"]
