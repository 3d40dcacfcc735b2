"""Staged refits against in-place ones (issue 53): the generation pause, the flip against a
memcpy of the same bytes, staging memory, and generation's speed while the transfer runs.

    python scripts/bench_staged.py                    # CPU: two worlds (1 train, 1 gen rank)
    python scripts/bench_staged.py --small            # CPU smoke (a tiny model)
    python scripts/bench_staged.py --device cuda      # one GPU, colocated (CUDA IPC)

Process 0 is a training world of one rank (a real megatron-core Qwen3-shaped model, PP1
TP1, ``RefitSender``); process 1 a generation world of one rank (vLLM's per-rank params,
``testing.vllm_like``, through the worker extension ``tools.e2e.ModuleWorker``). On a GPU
both share the device and the refit group moves bytes with the colocated transport. Both
ranks meet at a barrier before each refit (the training rank has already changed its
weights), then:

- ``in_place``: the generation rank calls ``refit()``; generation would stop for all of it:
  the pause is that call's time;
- ``staged``: ``start_staged_refit()`` returns at once; meanwhile the generation rank runs
  "generation" passes (``x @ W.T`` over every 2-D live param: reads of the weights being
  served) until the transfer has committed; then ``flip_staged_refit()``: the pause;
- ``staged_budget``: staged with ``staging_budget_bytes`` = half the model: the rest is
  received in place inside the pause (from the first batch of ``--batch-mib`` that holds
  an in-place param on);
- ``staged_host``: every param staged in host memory (pinned on a GPU), received through
  the one-batch device bounce (``receiver.staging_tiers``);
- ``in_place_delta``, ``staged_delta``, ``staged_delta_copy``: the same with a delta sender
  (one unit in the last place on ~2% of every param between refits; the first refit of
  each is full and not counted; the colocated transport of one GPU refits in full, so
  there these report none); ``staged_delta_copy`` flips by copying
  (``staged_delta_flip="copy"``), ``staged_delta`` by applying the payloads.

Each staged pause is broken down (``wait`` for the transfer thread, ``plan`` what the flip
copies whole and what takes deltas, ``check`` a delta flip's base check: the live bytes of
the params it does not copy whole digested against the base of the refit's start,
``receiver.flip_base``; ``copy``, ``apply``, ``commit``, ``outside`` the flip in the
worker) with its range over the refits and the host's load average. The training rank idles from its refit's end to the generation
rank's pause end (``--overlap``: it changes its weights for the next refit meanwhile).

Reported (median of ``--iters`` per mode): the pause, the pause as % of the in-place one,
the flip's copy time against ``dst.copy_(src)`` of one buffer of the same bytes in the same
run (GB/s, ratio), staging bytes, and the generation pass time during the transfer against
the same passes with no transfer just before each staged refit (the slowdown). The last
refit is checked bit for bit against the reference (full HF tensors sliced by vLLM's
layout).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

MODES = ("in_place", "staged", "staged_budget", "staged_host", "in_place_delta", "staged_delta",
         "staged_delta_copy")
PARTS = ("wait", "plan", "check", "copy", "apply", "commit", "outside")  # a staged pause, in order
DELTA_FRACTION = 0.02  # delta modes: one unit in the last place on ~2% of every param


def refits_of(mode: str, iters: int) -> int:
    """Refits a mode runs: a delta mode's first one is full (no base yet), not counted."""
    return iters + 1 if "_delta" in mode else iters


def _change_sparsely(model, step: int) -> None:
    """One unit in the last place on ~DELTA_FRACTION of every param (seeded, bf16 bits)."""
    for i, p in enumerate(model.parameters()):
        g = torch.Generator(device=p.device).manual_seed(step * 100_003 + i)
        bits = p.data.view(-1).view(torch.int16)
        bits[torch.rand(bits.numel(), generator=g, device=p.device) < DELTA_FRACTION] += 1


def _barrier(control, name: str, n: int = 2) -> None:
    control.add(name, 1)
    while int(control.add(name, 0)) < n:
        time.sleep(0.001)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _job(job, args):
    if args.hang_dump:  # a run past this prints every thread's stack (GPU runs hung silently)
        faulthandler.dump_traceback_later(args.hang_dump, repeat=True)
    try:
        return _side(job, args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _side(job, args):
    warnings_off()
    control = dist.TCPStore(job.host, job.ports[0], 2, job.rank == 0,
                            timeout=timedelta(seconds=args.timeout))
    side = "train" if job.rank == 0 else "gen"
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{side}", control), rank=0,
                            world_size=1, timeout=timedelta(seconds=args.timeout))
    transport = "colocated" if device.type == "cuda" else None
    if side == "train":
        return _train(job, args, control, device, transport)
    return _gen(job, args, control, device, transport)


def warnings_off() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)


def _model_overrides(args) -> dict:
    if args.small:
        return {}
    return dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=16,
                num_query_groups=4, ffn_hidden_size=args.ffn, vocab_size=args.vocab)


def _train(job, args, control, device, transport):
    from megatron.core import parallel_state as ps

    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.testing.vllm_like import expected_vllm_shard, vllm_param_shapes
    from megatron_reshard.tools.e2e import perturb_, tensor_digest
    from megatron_reshard.tools.run_config import MODEL_PRESETS

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    preset = dict(MODEL_PRESETS["dense"], **_model_overrides(args))
    family = preset.pop("family")
    spec = TinyGPTSpec(dtype="bfloat16", **preset)
    torch.manual_seed(0)
    model = build_gpt_model(spec).to(device=device, dtype=torch.bfloat16)
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": 1, "ep_size": 1, "pp_size": 1},
                                 gen_world_size=1, family=family, vocab_size=spec.vocab_size)
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 2, "gloo", args.timeout,
                               who="train rank 0", transport=transport)
    k = 0
    with torch.no_grad():
        for mode in MODES:
            delta = "_delta" in mode
            sender = RefitSender(source, group, device=device, batch_bytes=args.batch_mib << 20,
                                 delta=delta)
            for _ in range(refits_of(mode, args.iters)):
                (_change_sparsely if delta else perturb_)(model, k + 1)
                _barrier(control, f"go/{k}")
                sender.refit()
                if not args.overlap:  # idle until the generation side's pause has ended
                    _barrier(control, f"done/{k}")
                k += 1
    full = gather_full_hf_state_dict(model, family=family, vocab_size=spec.vocab_size)
    full = {n: t.to("cpu") for n, t in full.items()}
    control.set("expected", json.dumps({
        n: tensor_digest(expected_vllm_shard(source.hf_config, n, full, 0, 1, 1))
        for n in vllm_param_shapes(source.hf_config, 0, 1, 1)}))
    _barrier(control, "end")
    destroy_refit_group(group, args.timeout)
    return {"params": sum(p.numel() for p in model.parameters())}


def _generation_pass(weights: list, xs: list, device) -> float:
    """One "generation" pass: every 2-D live param read by a small matmul; seconds."""
    t0 = time.perf_counter()
    for w, x in zip(weights, xs):
        torch.matmul(x, w.t())
    _sync(device)
    return time.perf_counter() - t0


def _staged_refit(worker, weights, xs, device, args) -> dict:
    """One staged refit with generation passes during its transfer; its pause broken down:
    ``wait`` (the flip joins the transfer thread: the in-place params' receive, or 0),
    ``plan`` (what is copied whole, what takes deltas), ``check`` (a delta flip's base
    check, ``receiver.flip_base``), ``copy`` (staged params
    copied whole), ``apply`` (a delta refit's payloads applied), ``commit`` (the live
    version advanced), ``outside`` (the worker around the flip: vLLM's derived weights, the
    result)."""
    t0 = time.perf_counter()
    worker.start_staged_refit()
    passes = []
    while worker.refit_weights_state()["staged"]["phase"] == "receiving":
        passes.append(_generation_pass(weights, xs, device))
    state = worker.wait_staged_refit(args.timeout)
    ready_s = time.perf_counter() - t0
    load = os.getloadavg()[0]
    t1 = time.perf_counter()
    out = worker.flip_staged_refit()
    pause = time.perf_counter() - t1
    flip = out["staged"]
    return {"pause_s": pause, "ready_s": ready_s, "passes": passes, "mode": out["mode"],
            "load": load, "flip_copy_s": flip["flip_copy_s"], "flip_bytes": flip["flip_bytes"],
            "flip_copy_bytes": flip["flip_copy_bytes"],
            "breakdown_s": {"wait": flip["flip_wait_s"], "plan": flip["flip_plan_s"],
                            "check": flip["flip_base_check_s"],
                            "copy": flip["flip_whole_copy_s"],
                            "apply": flip["flip_delta_apply_s"], "commit": flip["flip_commit_s"],
                            "outside": pause - flip["flip_s"]},
            "staging_bytes": state["staging_bytes"], "in_place_bytes": state["in_place_bytes"],
            "base_check_bytes": flip["flip_base_check_bytes"],
            "base_changed": len(flip["flip_base_changed"]),
            "mirror_s": flip.get("mirror_s")}


def _gen(job, args, control, device, transport):
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.tools.e2e import ModuleWorker, tensor_digest
    from megatron_reshard.wire.codec import decode_payload

    control.wait(["payload"], timedelta(seconds=args.timeout))
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], 0, 1, 1, torch.bfloat16, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1]], 1, 2, "gloo", args.timeout)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = [p for p in model.parameters() if p.dim() == 2]
    xs = [torch.randn(args.batch, w.shape[1], dtype=w.dtype, device=device) for w in weights]
    _generation_pass(weights, xs, device)  # first touch
    idle = []
    rows = {m: [] for m in MODES}
    k = 0
    for mode in MODES:
        options = {"batch_bytes": args.batch_mib << 20}
        if mode.startswith("staged"):
            options["staged"] = True
        if mode == "staged_budget":
            options["staging_budget_bytes"] = model_bytes // 2
        if mode == "staged_host":  # every param in (pinned) host memory, through the bounce
            options.update(staging_budget_bytes=0, host_staging_budget_bytes=None)
        if mode == "staged_delta_copy":  # the same delta refits, flipped as copies
            options["staged_delta_flip"] = "copy"
        worker.prepare_refit(payload, options)
        for _ in range(refits_of(mode, args.iters)):
            if mode == "staged":  # the same passes with no transfer, next to the busy ones
                idle += [_generation_pass(weights, xs, device) for _ in range(args.passes)]
            _barrier(control, f"go/{k}")
            print(f"bench_staged: gen {mode} refit {k} starts", file=sys.stderr, flush=True)
            if mode.startswith("in_place"):
                t0 = time.perf_counter()
                out = worker.refit()
                _sync(device)
                rows[mode].append({"pause_s": time.perf_counter() - t0, "mode": out["mode"],
                                   "load": os.getloadavg()[0]})
            else:
                rows[mode].append(_staged_refit(worker, weights, xs, device, args))
            if not args.overlap:
                _barrier(control, f"done/{k}")
            k += 1
    # the flip's copy against one memcpy of the same bytes, same run
    nbytes = rows["staged"][-1]["flip_bytes"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    memcpy = []
    for _ in range(max(3, args.iters)):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        memcpy.append(time.perf_counter() - t0)
    control.wait(["expected"], timedelta(seconds=args.timeout))
    want = json.loads(control.get("expected"))
    wrong = sorted(n for n, p in model.named_parameters() if want.get(n) != tensor_digest(p))
    _barrier(control, "end")
    # the training rank hosts the group's store: its destroy waits (up to the timeout) for
    # every rank's; without this one the run sat there for --timeout at its end
    worker.destroy_refit_groups(args.timeout)
    return {"rows": rows, "idle_pass_s": idle, "memcpy_s": memcpy, "model_bytes": model_bytes,
            "wrong": wrong, "names": len(want)}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _counted(rows: list, mode: str) -> list:
    """A delta mode's rows that moved as deltas (its first refit is full: no base yet)."""
    return [r for r in rows if r["mode"] == "delta"] if "_delta" in mode else rows


def summarize(gen: dict) -> dict:
    rows = {m: _counted(rs, m) for m, rs in gen["rows"].items()}
    baseline = {"staged": "in_place", "staged_budget": "in_place", "staged_host": "in_place",
                "staged_delta": "in_place_delta",
                "staged_delta_copy": "in_place_delta"}
    out = {"model_bytes": gen["model_bytes"], "bit_exact": not gen["wrong"],
           "wrong": gen["wrong"][:5]}
    for mode in ("in_place", "in_place_delta"):
        out[f"{mode}_pause_ms"] = _median([r["pause_s"] for r in rows[mode]]) * 1e3
        out[f"{mode}_refits"] = len(rows[mode])
    idle = _median(gen["idle_pass_s"])
    memcpy = _median(gen["memcpy_s"])
    for mode, base in baseline.items():
        rs = rows[mode]
        if not rs:  # the colocated transport (one GPU) refits in full: no delta to stage
            out[mode] = None
            continue
        pause = _median([r["pause_s"] for r in rs])
        copy = _median([r["flip_copy_s"] for r in rs])
        busy = [p for r in rs for p in r["passes"]]
        out[mode] = {
            "refits": len(rs), "pause_ms": pause * 1e3,
            "pause_range_ms": [min(r["pause_s"] for r in rs) * 1e3,
                               max(r["pause_s"] for r in rs) * 1e3],
            "pause_pct_of_in_place": 100 * pause / (out[f"{base}_pause_ms"] / 1e3),
            "baseline": base,
            "pause_breakdown_ms": {part: _median([r["breakdown_s"][part] for r in rs]) * 1e3
                                   for part in PARTS},
            "load_avg_1min": _median([r["load"] for r in rs]),
            "ready_ms": _median([r["ready_s"] for r in rs]) * 1e3,
            "flip_copy_ms": copy * 1e3, "flip_bytes": rs[-1]["flip_bytes"],
            "flip_copy_bytes": rs[-1]["flip_copy_bytes"],
            "base_check_bytes": rs[-1]["base_check_bytes"],
            "base_check_pct_of_pause": 100 * _median(
                [r["breakdown_s"]["check"] / r["pause_s"] for r in rs]),
            "base_changed": max(r["base_changed"] for r in rs),
            "staging_bytes": rs[-1]["staging_bytes"], "in_place_bytes": rs[-1]["in_place_bytes"],
            "generation_passes_during_transfer": len(busy),
            "pass_ms_during_transfer": _median(busy) * 1e3,
        }
        if mode == "staged":
            gbps = rs[-1]["flip_bytes"] / copy / 1e9
            out[mode].update(flip_gbps=gbps, memcpy_ms=memcpy * 1e3,
                             memcpy_gbps=rs[-1]["flip_bytes"] / memcpy / 1e9,
                             flip_vs_memcpy=memcpy / copy)
    out["pass_ms_idle"] = idle * 1e3
    out["slowdown_during_transfer"] = out["staged"]["pass_ms_during_transfer"] / (idle * 1e3)
    return out


def breakdown_table(summary: dict) -> str:
    """The pauses side by side, each staged one broken down (ms, medians)."""
    lines = [f"{'mode':<18}{'pause':>9}{'% base':>8}{'wait':>8}{'plan':>8}{'check':>8}{'copy':>8}"
             f"{'apply':>8}{'commit':>8}{'outside':>8}{'range':>17}{'load':>6}"]
    for mode in ("in_place", "in_place_delta"):
        lines.append(f"{mode:<18}{summary[f'{mode}_pause_ms']:>9.1f}"
                     f"{'':>8}{summary[f'{mode}_refits']:>8} refits counted")
    for mode in ("staged", "staged_budget", "staged_host", "staged_delta", "staged_delta_copy"):
        m = summary[mode]
        if m is None:
            lines.append(f"{mode:<18}{'none: every refit went full (colocated transport)':>50}")
            continue
        b = m["pause_breakdown_ms"]
        lo, hi = m["pause_range_ms"]
        lines.append(f"{mode:<18}{m['pause_ms']:>9.1f}{m['pause_pct_of_in_place']:>7.1f}%"
                     f"{b['wait']:>8.1f}{b['plan']:>8.1f}{b['check']:>8.1f}{b['copy']:>8.1f}"
                     f"{b['apply']:>8.1f}"
                     f"{b['commit']:>8.2f}{b['outside']:>8.2f}{f'{lo:.1f}-{hi:.1f}':>17}"
                     f"{m['load_avg_1min']:>6.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--small", action="store_true", help="the tiny test model")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--passes", type=int, default=5,
                    help="generation passes with no transfer before each staged refit")
    ap.add_argument("--batch-mib", type=int, default=64,
                    help="the refit loop's batch_bytes on both sides (MiB): the gate of "
                         "staged_budget waits at the first batch holding an in-place param")
    ap.add_argument("--batch", type=int, default=4, help="rows of a generation pass's input")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--overlap", action="store_true",
                    help="the training rank changes its weights for the next refit while the "
                         "generation rank flips (default: it waits for the pause to end)")
    ap.add_argument("--json", action="store_true", help="print the raw rows too")
    ap.add_argument("--hang-dump", type=float, default=120.0,
                    help="seconds after which each process prints its threads' stacks (again "
                         "every as many seconds); 0: never")
    args = ap.parse_args(argv)
    from megatron_reshard.tools.worlds import WorkerPool

    pool = WorkerPool(2)
    try:
        results = pool.run(_job, 2, args, num_ports=2, timeout_s=args.timeout * 4)
    finally:
        pool.close()
    gen = results[1]
    summary = summarize(gen)
    env = {"torch": torch.__version__, "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
           "model_params": results[0]["params"], "iters": args.iters, "overlap": args.overlap,
           "batch_mib": args.batch_mib}
    print(json.dumps({"env": env, **summary}, indent=1))
    print(breakdown_table(summary))
    if args.json:
        print(json.dumps(gen["rows"]))
    return 0 if summary["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
