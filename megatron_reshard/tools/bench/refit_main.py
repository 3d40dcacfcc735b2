"""Refit benchmark: a whole-model refit against raw P2P and gather+broadcast, same run.

One torchrun launch of 4 processes: ranks 0,1 are the Megatron training world, ranks 2,3
the generation world (gen TP2), joined by a refit group (``megatron_reshard.tools.e2e``, the
same two-world run as the demo and ``scripts/refit_torchrun.py``)::

    torchrun --nproc-per-node 4 -m megatron_reshard.tools.bench.refit_main [--case moe|dense|all] \\
        [--layers 4] [--iters 5] [--out bench_out/refit] [--p2p-channels N]
    torchrun --nproc-per-node 4 -m megatron_reshard.tools.bench.refit_main \\
        --device cpu --backend gloo --small                           # CPU smoke (tiny shapes)
    megatron-reshard bench refit -- [options]                         # the CLI runs this module

Cases (bf16):

- ``moe``: a Qwen3-30B-A3B-proportioned slice: hidden 2048, 32 heads, 4 KV heads, head_dim
  128, 128 experts of FFN 768 (top-8), vocab 151936, ``--layers`` layers; train EP2 (experts
  Shard(0) over the two training ranks, attention replicated) → gen TP2 (experts sharded
  on the intermediate dim).
- ``dense``: a Qwen3-8B-proportioned slice: hidden 4096, 32 heads, 8 KV heads, head_dim 128,
  FFN 12288, vocab 151936; train TP2 → gen TP2.

Per case: the model is built (and initialised) on the device, then filled with a cheap
deterministic pattern keyed by each parameter's global identity (equal on
replicas; see ``fill_fast_``); setup and the first refit run through ``e2e.run_rank``, which
verifies that refit bit for bit against the reference (full HF tensors gathered on the
training side, digests compared on the generation side; ``--no-verify`` skips it: the reference
gathers the full model on each training rank and hashes it on the CPU, heavy for many
layers; verify a big run with the default layer count instead). Then, on the refit
group: ``--warmup`` untimed refits, ``--iters`` timed refits (each barrier-aligned, the
slowest rank's time; median), one refit under peak-memory tracking, the raw P2P figures
with the same bytes per generation GPU (one pair 0→2, and fan-in 0,1→2), and the naive
gather+broadcast refit of the bulk (FFN/expert) params.

Columns: refit ms (whole refit: other-param gather + bulk + packed broadcast of the other
params) and bulk ms (the exact engine path only); bytes into each generation GPU per
refit (max over gen ranks); GB/s per generation GPU for both; raw pair and fan-in GB/s;
refit/raw and bulk/raw against the better of the two raw figures (the link's ceiling);
g+b ms and GB/s (useful bulk bytes per gen GPU / time) and bulk/g+b; peak extra GPU memory
of one refit on the train and gen side (``max_memory_allocated`` after a reset, minus what
was allocated before; NCCL's own buffers are not counted) next to the staging budget.

The gather+broadcast baseline (kept simple, and favourable to itself): per layer and FFN
projection, the training ranks all-gather their shards over the training world (for
experts: the rank's local experts stacked into one tensor once, outside the timed loop),
training rank 0 broadcasts the full tensor over the refit group, and each generation rank
copies its ``torch.chunk`` part along the gen TP dim into a destination buffer (the
gate/up split of fc1 is not modelled: the copied bytes are the same). The vocab matrices,
which the refit also moves on its exact path, go the same way (the gen rank keeps the real
rows of vLLM's padded chunk), and so do attention (q/k/v as one column-parallel matrix:
same bytes), norms and router. Full and
destination buffers are allocated once per shape and reused.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
import zlib
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_reshard.vllm_layout import padded_vocab_rows

from .memory import measure_cpu_peak_extra, measure_peak_extra
from .report import Column, format_table, plot_bandwidth, sig, write_report
from .timing import GroupOps, synchronize, time_collective

QWEN3_VOCAB = 151936

# Full-size cases: (e2e preset, overrides, train layout, gen layout). Layers come from --layers.
CASES: dict[str, dict[str, Any]] = {
    "moe": dict(model="moe", label="Qwen3-30B-A3B slice, train EP{n} → gen TP{n}",
                overrides=dict(hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                               head_dim=128, num_moe_experts=128, moe_ffn_hidden_size=768,
                               ffn_hidden_size=6144, moe_router_topk=8, vocab_size=QWEN3_VOCAB),
                train=dict(train_tp=1, train_pp=1, train_ep=2)),
    "dense": dict(model="dense", label="Qwen3-8B slice, train TP{n} → gen TP{n}",
                  overrides=dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                 head_dim=128, ffn_hidden_size=12288, vocab_size=QWEN3_VOCAB),
                  train=dict(train_tp=2, train_pp=1, train_ep=1)),
}
# --small: tiny shapes with the same structure (head_dim != hidden / heads as in Qwen3).
SMALL_OVERRIDES = {
    "moe": dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, head_dim=16,
                num_moe_experts=8, moe_ffn_hidden_size=32, ffn_hidden_size=128,
                moe_router_topk=2, vocab_size=500),
    "dense": dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, head_dim=16,
                  ffn_hidden_size=160, vocab_size=500),
}


# ----------------------------------------------------------------------------- fast model


_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def param_identity(model, name: str, param, tp_rank: int, ep_rank: int) -> str:
    """The global identity of a local param: global layer, global expert, TP shard (as in
    ``megatron.models.fill_distinct_``): equal on replicas, different for anything else."""
    layers = model.decoder.layers
    key = name
    m = _LOCAL_LAYER.search(name)
    if m is not None:
        key = key.replace(m.group(0), f"decoder.layers.<{layers[int(m.group(1))].layer_number}>.")
    e = _LOCAL_EXPERT.search(name)
    if e is not None:
        n_local = len(layers[int(m.group(1))].mlp.experts.local_experts)
        key = key.replace(e.group(0), f"experts.<{ep_rank * n_local + int(e.group(1))}>.")
    sharded = getattr(param, "tensor_model_parallel", False) and e is None
    if sharded:
        key += f"|tp{tp_rank}"
    if getattr(param, "shared_embedding", False):
        key = "embedding.word_embeddings.weight" + (f"|tp{tp_rank}" if sharded else "")
    return key


@torch.no_grad()
def fill_pattern_(param: torch.Tensor, key: int, chunk: int = 1 << 24) -> None:
    """Overwrite ``param`` with a cheap integer-hash pattern of (element index, key), values
    in [-2, 2]: identical on any device (no RNG), computed in chunks on the param's device."""
    flat = param.view(-1)
    n = flat.numel()
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        idx = torch.arange(lo, hi, dtype=torch.int64, device=param.device)
        h = (idx * 2654435761 + key * 97 + 12345) % 2147483647
        vals = ((h >> 7) % 4001 - 2000).to(torch.float32) / 1000.0
        flat[lo:hi].copy_(vals.to(param.dtype))


def build_model_fast(spec, device: torch.device, dtype: torch.dtype):
    """``build_gpt_model`` fast on a GPU: parameters are created and initialised on ``device``
    (CUDA: ``use_cpu_initialization=False``), then overwritten by ``fill_pattern_`` keyed by
    their global identity (``models.fill_distinct_`` draws CPU random numbers instead)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_reshard.testing.megatron_models import padded_vocab_size, transformer_config

    config = transformer_config(spec)
    # Megatron sets the tensor-parallel attributes of a weight only inside its
    # initialisation, so keep it (on the GPU it is cheap); its RNG tracker needs a seed.
    config.use_cpu_initialization = device.type != "cuda"
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                            normalization="RMSNorm")
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by,
                                     ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope")
    model = model.to(device=device, dtype=dtype)
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            ident = param_identity(model, name, param, tp_rank, ep_rank)
            fill_pattern_(param.data, (zlib.crc32(ident.encode()) ^ spec.seed) & 0x7FFFFFFF)
    synchronize(device)
    return model


# ----------------------------------------------------------------------------- baseline

_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_DENSE = re.compile(r"decoder\.layers\.(\d+)\.mlp\.linear_fc([12])\.weight$")


_VOCAB = re.compile(r"(embedding\.word_embeddings|output_layer)\.weight$")
# what the refit's exact path moves besides FFN and vocab (megatron_reshard.megatron.source)
_ROW = re.compile(r"self_attention\.linear_proj\.weight$")
_QKV = re.compile(r"self_attention\.linear_qkv\.weight$")
_REPLICATED = re.compile(r"(layernorm\.weight|mlp\.router\.weight)$")


def _baseline_items_train(model, train_world: int, vocab_size: int
                          ) -> tuple[list[dict], list[torch.Tensor], str]:
    """Train side: (specs, local tensors, note). Specs are plain data shared with the gen
    side: full shape, gather dim (None: replicated), gen slice dim; vocab matrices also
    carry the real vocab size and vLLM's padded size (the gen side keeps its padded chunk's
    real rows), as the refit moves them on its exact path too."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    experts: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
    specs, locals_, notes = [], [], []
    for name, p in model.named_parameters():
        m = _EXPERT.search(name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), []).append((int(m.group(2)), p))
            continue
        if _VOCAB.search(name) and tp in (1, train_world):
            full = [p.shape[0] * tp, p.shape[1]]
            specs.append({"full": full, "src_dim": 0 if tp > 1 else None, "gen_dim": 0,
                          "vocab": vocab_size, "gen_pad": padded_vocab_rows(vocab_size)})
            locals_.append(p.detach())
            continue
        if _REPLICATED.search(name) and "shared_experts" not in name:
            specs.append({"full": list(p.shape), "src_dim": None, "gen_dim": None})
            locals_.append(p.detach())
            continue
        if _QKV.search(name) and tp in (1, train_world):
            # gen keeps a TP chunk of rows: the bytes of its q_r, k_r, v_r (gen TP <= KV heads)
            specs.append({"full": [p.shape[0] * tp, p.shape[1]], "src_dim": 0 if tp > 1 else None,
                          "gen_dim": 0})
            locals_.append(p.detach())
            continue
        if _ROW.search(name) and tp in (1, train_world):
            specs.append({"full": [p.shape[0], p.shape[1] * tp], "src_dim": 1 if tp > 1 else None,
                          "gen_dim": 1})
            locals_.append(p.detach())
            continue
        m = _DENSE.search(name)
        if m:
            dim = 0 if m.group(2) == "1" else 1
            if tp not in (1, train_world):
                notes.append(f"dense TP {tp} != train world {train_world}: dense FFN skipped")
                continue
            n = tp
            full = list(p.shape)
            full[dim] *= n
            specs.append({"full": full, "src_dim": dim if n > 1 else None, "gen_dim": dim})
            locals_.append(p.detach())
    for (_, fc), items in sorted(experts.items()):
        if ep not in (1, train_world):
            notes.append(f"EP {ep} != train world {train_world}: experts skipped")
            break
        stacked = torch.stack([t.detach() for _, t in sorted(items, key=lambda x: x[0])])
        full = list(stacked.shape)
        full[0] *= ep
        specs.append({"full": full, "src_dim": 0 if ep > 1 else None,
                      "gen_dim": 1 if fc == "1" else 2})
        locals_.append(stacked)
    return specs, locals_, "; ".join(sorted(set(notes)))


class GatherBroadcast:
    """The naive refit of the bulk params on one rank (see module docstring)."""

    def __init__(self, role: str, specs: list[dict], locals_: Optional[list[torch.Tensor]],
                 group, device: torch.device, n_train: int, gen_tp_rank: int, gen_tp: int):
        self.role, self.specs, self.group, self.device = role, specs, group, device
        self.locals = locals_ or []
        self.n_train = n_train
        self.full: dict[tuple, torch.Tensor] = {}
        self.gathered: dict[tuple, torch.Tensor] = {}
        self.dst: dict[tuple, torch.Tensor] = {}
        self.views = []
        self.useful_bytes = 0
        for i, s in enumerate(specs):
            shape = tuple(s["full"])
            if shape not in self.full:
                self.full[shape] = torch.empty(shape, dtype=s["dtype_t"], device=device)
            full = self.full[shape]
            if role == "train" and s["src_dim"] not in (None, 0):
                local = self.locals[i]
                key = (n_train, *local.shape)
                if key not in self.gathered:
                    self.gathered[key] = torch.empty(key, dtype=local.dtype, device=device)
            if role == "gen":
                d = s["gen_dim"]
                if d is None:  # replicated on the generation side: the whole tensor
                    view = full
                else:
                    size = s.get("vocab", shape[d])  # vocab: the real rows of vLLM's padded chunk
                    step = s["gen_pad"] // gen_tp if "gen_pad" in s else -(-size // gen_tp)
                    lo, hi = min(size, gen_tp_rank * step), min(size, (gen_tp_rank + 1) * step)
                    view = full.narrow(d, lo, hi - lo)
                key = (shape, d)
                if key not in self.dst:
                    self.dst[key] = torch.empty(view.shape, dtype=full.dtype, device=device)
                self.views.append((view, self.dst[key]))
                self.useful_bytes += view.numel() * view.element_size()

    def run(self) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        for i, s in enumerate(self.specs):
            full = self.full[tuple(s["full"])]
            if self.role == "train":
                local, d = self.locals[i], s["src_dim"]
                if d is None:
                    full.copy_(local)
                elif d == 0:
                    dist.all_gather_into_tensor(full.view(-1), local.reshape(-1))
                else:
                    g = self.gathered[(self.n_train, *local.shape)]
                    dist.all_gather_into_tensor(g.view(-1), local.reshape(-1))
                    torch.cat(list(g.unbind(0)), dim=d, out=full)
            self.group.broadcast([full], opts).wait()
            if self.role == "gen":
                view, dst = self.views[i]
                dst.copy_(view)


# ----------------------------------------------------------------------------- one case


def _profile_one_refit(refit, device: torch.device, out_dir: str, label: str) -> None:
    """Profile one refit (CPU + CUDA) and write the op table to ``out_dir/profile_<label>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        refit()
        synchronize(device)
    os.makedirs(out_dir, exist_ok=True)
    averages = prof.key_averages()
    with open(os.path.join(out_dir, f"profile_{label}.txt"), "w") as f:
        f.write(averages.table(sort_by="cuda_time_total", row_limit=25))
        f.write("\n")
        f.write(averages.table(sort_by="cpu_time_total", row_limit=25))


def _bench_side(ctx: dict, args: argparse.Namespace, case: str) -> dict:
    """Runs on every rank of the refit group after the verified refit; returns figures
    identical on every rank of the group."""
    role, cfg, device, group = ctx["role"], ctx["cfg"], ctx["device"], ctx["group"]
    ops = GroupOps(group, device)
    n_train, n_gen = cfg.stage_world, cfg.gen_world
    src_ranks, dst_ranks = list(range(n_train)), list(range(n_train, n_train + n_gen))
    refit = ctx["sender"].refit if role == "train" else ctx["worker"].refit
    me = ops.rank
    say = (lambda msg: print(f"[{case}] {msg}", file=sys.stderr, flush=True)) if me == 0 else (lambda msg: None)

    say(f"warm-up: {args.warmup} refits")
    for _ in range(args.warmup):
        ops.barrier()
        refit()
    synchronize(device)
    times, bulks = [], []
    last: dict = {}
    for _ in range(args.iters):
        ops.barrier()
        t0 = time.perf_counter()
        last = refit()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        bulks.append(last["bulk_s"])
    slow = ops.allreduce_max(torch.tensor(times + bulks, dtype=torch.float64)).tolist()
    times, bulks = slow[:args.iters], slow[args.iters:]
    # Bytes into each generation GPU (slot per gen rank; train ranks contribute zeros).
    vec = torch.zeros(2 * n_gen, dtype=torch.float64)
    if role == "gen":
        vec[me - n_train] = last.get("bulk_bytes", 0) + last.get("misc_bytes", 0)
        vec[n_gen + me - n_train] = last.get("bulk_bytes", 0)
    vec = ops.allreduce_max(vec).tolist()
    total_per_gen, bulk_per_gen = vec[:n_gen], vec[n_gen:]
    say(f"timed {args.iters} refits: median {1e3 * _median(times):.2f} ms")

    if args.profile and device.type == "cuda":
        _profile_one_refit(refit, device, args.profile, f"{case}_{role}{me}")

    # the staging slots kept since the last refit are given back, so that the measured
    # refit allocates (and counts) them again
    release = (ctx["sender"].release_staging if role == "train"
               else ctx["worker"].release_refit_staging)
    release()
    if device.type == "cuda":
        _, peak = measure_peak_extra(refit, device)
        extra, alloc = float(peak.extra_bytes), float(peak.allocated_extra_bytes)
    else:  # the CPU allocator's events (bench/memory.py), one figure for both
        _, cpu_peak = measure_cpu_peak_extra(refit)
        extra = alloc = float(cpu_peak)
    mine = [x if role == side else 0.0 for x in (extra, alloc) for side in ("train", "gen")]
    pk = ops.allreduce_max(torch.tensor(mine, dtype=torch.float64))  # [extra tr, gen, alloc tr, gen]
    out: dict[str, Any] = {
        "refit_times_s": times, "bulk_times_s": bulks,
        "bytes_per_gen": total_per_gen, "bulk_bytes_per_gen": bulk_per_gen,
        "peak_extra_train_bytes": float(pk[0]), "peak_extra_gen_bytes": float(pk[1]),
        # the allocated-bytes peak (bench/memory.py), what earlier reports showed
        "peak_allocated_extra_train_bytes": float(pk[2]),
        "peak_allocated_extra_gen_bytes": float(pk[3]),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()

    from .baselines import raw_p2p

    nbytes = int(max(total_per_gen))
    if not args.no_raw and nbytes > 0:
        say(f"raw P2P, {nbytes / 2**20:.1f} MiB per destination")
        for pattern in ("pair", "fanin"):
            m = raw_p2p(group, src_ranks, dst_ranks, nbytes, device, iters=args.iters,
                        warmup=max(1, args.warmup), pattern=pattern)
            out[f"raw_{pattern}_gbps"] = m.gbps
            out[f"raw_{pattern}_ms"] = 1e3 * m.median_s
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if not args.no_baseline:
        say("gather+broadcast baseline")
        out.update(_run_baseline(ctx, args, case, ops))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _run_baseline(ctx: dict, args: argparse.Namespace, case: str, ops: GroupOps) -> dict:
    role, cfg, device, group, control = (ctx["role"], ctx["cfg"], ctx["device"], ctx["group"],
                                         ctx["control"])
    key = f"bench/{case}/baseline_specs"
    locals_ = None
    if role == "train":
        specs, locals_, note = _baseline_items_train(ctx["model"], cfg.train_world,
                                                     ctx["sender"].source.vocab_size)
        if ctx["rank"] == 0:
            control.set(key, json.dumps({"specs": specs, "note": note,
                                         "dtype": str(locals_[0].dtype) if locals_ else cfg.dtype}))
    plain = json.loads(control.get(key))
    if not plain["specs"]:
        return {"baseline_note": plain["note"] or "no bulk params found"}
    dtype = getattr(torch, plain["dtype"].replace("torch.", ""))
    specs = [dict(s, dtype_t=dtype) for s in plain["specs"]]
    gen_rank = ctx["rank"] if role == "gen" else 0
    naive = GatherBroadcast(role, specs, locals_, group, device, cfg.train_world,
                            gen_rank % cfg.gen_tp, cfg.gen_tp)
    timing = time_collective(naive.run, group, device=device, iters=args.iters,
                             warmup=max(1, args.warmup))
    useful = ops.allreduce_max(torch.tensor([float(naive.useful_bytes)], dtype=torch.float64))
    out = {"baseline_ms": 1e3 * timing.median_s, "baseline_bytes_per_gen": float(useful[0]),
           "baseline_gbps": float(useful[0]) / timing.median_s / 1e9 if timing.median_s > 0 else None}
    if plain["note"]:
        out["baseline_note"] = plain["note"]
    del naive, locals_
    return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])) if n else float("nan")


def run_case(case: str, args: argparse.Namespace, rank: int, ports: tuple, bench_store) -> Optional[dict]:
    """Play ``rank`` in one case; returns the row on rank 0 (None elsewhere)."""
    from megatron_reshard.tools.e2e import run_rank, summarize
    from megatron_reshard.tools.run_config import RefitRunConfig

    spec = CASES[case]
    overrides = dict(SMALL_OVERRIDES[case] if args.small else spec["overrides"])
    fp8 = getattr(args, "gen_precision", "bf16") == "fp8"
    if fp8 and args.small:
        overrides = {}  # run_config.FP8_MODEL_OVERRIDES: tiny dims made of whole 128x128 blocks
    layers = args.layers if args.layers is not None else (2 if args.small else 4)
    overrides["num_layers"] = layers
    device_type = "cuda" if args.device == "cuda" else "cpu"
    half = int(os.environ["WORLD_SIZE"]) // 2  # N train ranks, N gen ranks (gen TP N)
    train = {k: (half if v == 2 else v) for k, v in spec["train"].items()}
    cfg = RefitRunConfig(model=spec["model"], model_overrides=overrides, train_world=half,
                         gen_world=half, gen_tp=half, gen_ep=1, refits=1, verify=not args.no_verify,
                         backend=args.backend, device=device_type, dtype="bfloat16",
                         host=os.environ.get("MASTER_ADDR", "127.0.0.1"), ports=ports,
                         timeout_s=args.timeout_s, num_streams=args.streams,
                         staging_mib=args.staging_mib, quiet=rank not in (0, half),
                         gen_precision="fp8" if fp8 else "bf16", **train)
    t0 = time.perf_counter()
    result = run_rank(rank, cfg, model_builder=build_model_fast,
                      after_refits=lambda ctx: _bench_side(ctx, args, case))
    bench_store.set(f"{case}/result/{rank}", json.dumps(result, default=str))
    _teardown(rank < cfg.train_world)
    if rank != 0:
        return None
    results = [json.loads(bench_store.get(f"{case}/result/{r}")) for r in range(2 * half)]
    summary = summarize(cfg, results)
    b = results[0]["bench"]
    refit_s, bulk_s = _median(b["refit_times_s"]), _median(b["bulk_times_s"])
    per_gen, bulk_gen = max(b["bytes_per_gen"]), max(b["bulk_bytes_per_gen"])
    row: dict[str, Any] = {
        "case": case, "layout": spec["label"].format(n=cfg.gen_tp), "layers": layers,
        "params_per_gen": summary["params"],
        "bytes_per_gen": per_gen, "mib_per_gen": per_gen / 2**20,
        "bulk_bytes_per_gen": bulk_gen,
        "exact_path_fraction": summary["exact_path_fraction"],
        "refit_ms": 1e3 * refit_s, "refit_min_ms": 1e3 * min(b["refit_times_s"]),
        "bulk_ms": 1e3 * bulk_s,
        "refit_gbps": per_gen / refit_s / 1e9 if refit_s > 0 else None,
        "bulk_gbps": bulk_gen / bulk_s / 1e9 if bulk_s > 0 else None,
        "raw_pair_gbps": b.get("raw_pair_gbps"), "raw_fanin_gbps": b.get("raw_fanin_gbps"),
        "baseline_ms": b.get("baseline_ms"), "baseline_gbps": b.get("baseline_gbps"),
        "baseline_bytes_per_gen": b.get("baseline_bytes_per_gen"),
        "baseline_note": b.get("baseline_note"),
        "peak_extra_train_mib": _mib(b.get("peak_extra_train_bytes")),
        "peak_extra_gen_mib": _mib(b.get("peak_extra_gen_bytes")),
        "peak_allocated_extra_train_mib": _mib(b.get("peak_allocated_extra_train_bytes")),
        "peak_allocated_extra_gen_mib": _mib(b.get("peak_allocated_extra_gen_bytes")),
        "staging_mib": args.staging_mib,
        # the target: either side's peak extra memory within the staging budget
        "extra_vs_staging": (max(b["peak_extra_train_bytes"], b["peak_extra_gen_bytes"])
                             / (args.staging_mib * 2**20) if args.staging_mib else None),
        "setup_s": summary["setup_s"], "case_s": time.perf_counter() - t0,
        "verified_refit_ms": 1e3 * summary["refit_s"][0] if summary["refit_s"] else None,
        "check": ("exact" if summary["verified"] else "MISMATCH") if cfg.verify else "not verified",
        "mismatched": sorted({n for g in summary["per_gen_rank"] for n in g["mismatched"]})[:20],
        "bytes_per_gen_rank": b["bytes_per_gen"],
        "gen_precision": summary["gen_precision"],
        "bytes_vs_unquantized": summary["bytes_vs_unquantized"],
    }
    raws = [x for x in (row["raw_pair_gbps"], row["raw_fanin_gbps"]) if x]
    if raws:
        row["raw_gbps"] = max(raws)
        row["refit_vs_raw"] = row["refit_gbps"] / row["raw_gbps"] if row["refit_gbps"] else None
        row["bulk_vs_raw"] = row["bulk_gbps"] / row["raw_gbps"] if row["bulk_gbps"] else None
    if row["baseline_gbps"] and row["bulk_gbps"]:
        row["bulk_vs_baseline"] = row["bulk_gbps"] / row["baseline_gbps"]
        if row["baseline_bytes_per_gen"] != bulk_gen:
            row["baseline_note"] = ((row["baseline_note"] or "") + f" baseline moves "
                                    f"{row['baseline_bytes_per_gen']:.0f} useful B/gen vs refit "
                                    f"bulk {bulk_gen:.0f}").strip()
    return row


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else x / 2**20


def _teardown(train: bool) -> None:
    """Leave no world behind: the next case builds its own."""
    if train:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- main

COLUMNS = [
    Column("case", "case"),
    Column("layout", "layout"),
    Column("layers", "layers"),
    Column("params_per_gen", "params/gen"),
    Column("mib_per_gen", "MiB into each gen GPU", "{:.1f}"),
    Column("refit_ms", "refit ms", sig),
    Column("bulk_ms", "bulk ms", sig),
    Column("refit_gbps", "refit GB/s/gen", sig),
    Column("bulk_gbps", "bulk GB/s/gen", sig),
    Column("raw_pair_gbps", "raw pair GB/s", sig),
    Column("raw_fanin_gbps", "raw fan-in GB/s", sig),
    Column("refit_vs_raw", "refit/raw", "{:.0%}"),
    Column("bulk_vs_raw", "bulk/raw", "{:.0%}"),
    Column("baseline_ms", "g+b ms", sig),
    Column("baseline_gbps", "g+b GB/s/gen", sig),
    Column("bulk_vs_baseline", "bulk/g+b", "{:.2f}×"),
    Column("peak_extra_train_mib", "peak extra train MiB", "{:.0f}"),
    Column("peak_extra_gen_mib", "peak extra gen MiB", "{:.0f}"),
    Column("staging_mib", "staging MiB"),
    Column("extra_vs_staging", "max extra/staging", "{:.0%}"),
    Column("check", "check"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_refit",
        description=__doc__.split("\n\n")[0] + " Run under torchrun with 4 processes.",
        epilog="See megatron_reshard/tools/bench/refit_main.py for the cases and columns.")
    p.add_argument("--case", choices=["moe", "dense", "all"], default="all")
    p.add_argument("--layers", type=int, default=None,
                   help="transformer layers per case (default 4; 2 with --small)")
    p.add_argument("--iters", type=int, default=None, help="timed refits (default 5; 2 with --small)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed refits after the verified one (default 2; 1 with --small)")
    p.add_argument("--out", default="bench_out/refit", help="output folder (md, json, png)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when available")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke runs)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the bit-exact check of the first refit (heavy for many layers)")
    p.add_argument("--no-baseline", action="store_true", help="skip gather+broadcast")
    p.add_argument("--no-raw", action="store_true", help="skip the raw P2P figures")
    p.add_argument("--staging-mib", type=int, default=256, help="engine staging budget per rank")
    p.add_argument("--gen-precision", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: block-FP8 generation model (linear weights quantized on the "
                        "sending side where shards own whole 128x128 blocks); the row's "
                        "bytes_vs_unquantized compares with the same refit in bf16")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one refit per rank (torch.profiler) into DIR/profile_*.txt")
    p.add_argument("--streams", type=int, default=2, help="CUDA streams for PP stages")
    p.add_argument("--p2p-channels", type=int, default=None, metavar="N",
                   help="set NCCL_MIN_P2P_NCHANNELS and NCCL_MAX_P2P_NCHANNELS to N before init")
    p.add_argument("--nccl-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable before init (repeatable)")
    p.add_argument("--port-base", type=int, default=None,
                   help="first TCP port used (default MASTER_PORT + 200; 1 + 10 per case)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="timeout of every process group and store (default 600; 120 with --small)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .transfer_main import apply_env

    env = apply_env(args)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.iters is None:
        args.iters = 2 if args.small else 5
    if args.warmup is None:
        args.warmup = 1 if args.small else 2
    if args.timeout_s is None:
        args.timeout_s = 120.0 if args.small else 600.0
    if args.iters < 1 or args.warmup < 0:
        print("bench_refit: need --iters >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_refit: --device cuda but no CUDA device; use --device cpu --backend gloo",
              file=sys.stderr)
        return 2
    if args.device == "cpu" and args.backend == "nccl":
        print("bench_refit: nccl needs --device cuda", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("bench_refit: run under torchrun, e.g. torchrun --nproc-per-node 4 -m "
              "megatron_reshard.tools.bench.refit_main", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world not in (2, 4):
        if rank == 0:
            print(f"bench_refit: needs 4 processes (2 train + 2 gen) or 2 (1 + 1), got {world}",
                  file=sys.stderr)
        return 2
    if args.device == "cuda" and torch.cuda.device_count() < 1:
        return 2
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    base = args.port_base or int(os.environ.get("MASTER_PORT", "29500")) + 200
    store = dist.TCPStore(host, base, world, rank == 0, timeout=timedelta(seconds=args.timeout_s))
    cases = ["moe", "dense"] if args.case == "all" else [args.case]
    rows = []
    for i, case in enumerate(cases):
        ports = (base + 1 + 10 * i, base + 2 + 10 * i)
        if rank == 0:
            print(f"bench_refit: case {case} ({CASES[case]['label'].format(n=world // 2)}) on {args.device} "
                  f"({args.backend}), {'small shapes' if args.small else 'full shapes'}", flush=True)
        row = run_case(case, args, rank, ports, store)
        if row is not None:
            rows.append(row)
            print(f"bench_refit: case {case} done in {row['case_s']:.1f}s: {row['check']}",
                  flush=True)
    if rank == 0:
        dev = (torch.cuda.get_device_name(torch.cuda.current_device())
               if args.device == "cuda" else "cpu")
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev,
                "backend": args.backend, "torch": torch.__version__,
                "nccl": (".".join(map(str, torch.cuda.nccl.version()))
                         if args.device == "cuda" else None),
                "ranks": "train 0,1 / gen 2,3 (gen TP2)" if world == 4 else "train 0 / gen 1",
                "iters": args.iters,
                "warmup": args.warmup, "small": args.small, "verify": not args.no_verify,
                "staging_mib": args.staging_mib,
                "raw": "raw = better of pair (0→2) and fan-in (0,1→2), same bytes per gen GPU",
                "env": env, "argv": sys.argv}
        table = format_table(rows, COLUMNS)
        print(table, flush=True)
        for r in rows:
            if r.get("baseline_note"):
                print(f"{r['case']}: baseline: {r['baseline_note']}")
            if r.get("mismatched"):
                print(f"{r['case']}: MISMATCH in {r['mismatched']}")
        paths = write_report(
            args.out, rows, COLUMNS, meta=meta, stem="refit",
            title="Refit benchmark: whole-model refit vs raw P2P vs gather+broadcast",
            plot=lambda rs, path: plot_bandwidth(
                rs, path, title="GB/s into each generation GPU",
                series={"refit_gbps": "refit", "bulk_gbps": "refit (bulk only)",
                        "raw_pair_gbps": "raw P2P (pair)", "raw_fanin_gbps": "raw P2P (fan-in)",
                        "baseline_gbps": "gather+broadcast (bulk)"}))
        print(f"wrote {paths.markdown}, {paths.json}" + (f", {paths.png}" if paths.png else ""),
              flush=True)
        bad = any(r["check"] == "MISMATCH" for r in rows)
        verdict = "fail" if bad else "ok"
    from megatron_reshard.tools.e2e import share_verdict

    verdict = share_verdict(store, rank, world, verdict if rank == 0 else None)
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
