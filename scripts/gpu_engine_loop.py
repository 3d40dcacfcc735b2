"""The RL loop on one GPU: a megatron-core trainer refits a running vLLM ``LLM`` in place.

    source /tmp/vsite.env     # vLLM 0.25.1 on the GPU machine (../shared/gpu_vllm)
    python scripts/gpu_engine_loop.py --model dense --graphs off [--refits 3] [--speed 5]
    bash scripts/gpu_engine_loop.sh   # every case, one process each (docs/GPU_ENGINE.md)
    python scripts/gpu_engine_loop.py --model moe --tp 2   # 2 GPUs: Megatron TP2 -> vLLM TP2

One process per case. The training process (``gpu_engine_trainer.py``: megatron-core, local
spec, BF16) is spawned first; then this process starts a vLLM ``LLM`` (engine core
in-process, ``load_format="dummy"``, sleep mode on, prefix caching off) with
``WeightTransferConfig(backend="megatron_reshard")``, the backend found through vLLM's own
plugin loader (the installed package's entry point). The inference side is driven only
through ``LLM``'s methods: ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``, ``sleep``, ``wake_up``, ``generate``,
``collective_rpc`` (to read the worker's tensors and to run vLLM's own loader).

Refits (each after an optimizer step but the first), in an RL frameworks' order:
1. awake; 2. ``sleep(level=1)``, step, ``wake_up(["weights"])``, refit, ``wake_up(["kv_cache"])``;
3. the same with ``sleep(level=2)`` (the weights' memory is discarded: the refit must
rewrite all of it, at the addresses vLLM maps again); 4+. awake. After every refit:
- every parameter and buffer of the engine, read with ``collective_rpc``, is bit-equal to
  what vLLM's own loader makes of the trainer's full HF tensors of that step (the same
  engine reloaded with vLLM's ``reload_weights``: ``load_weights`` + its post-load step,
  in place, after the snapshot), and no tensor moved (same ``data_ptr``);
- greedy tokens and their logprobs equal those of that reference;
then one more refit with a planted fault (one byte of one parameter changed after the
refit), which the comparison must report, alone. ``--speed N``: N refits of this backend
and N of vLLM's ``ipc`` backend (swapped into the same worker; the trainer sends full HF
tensors through CUDA IPC handles) alternated, against a device memcpy of the same bytes.
With ``--tp N`` (N GPUs; written, not yet run: no multi-GPU machine was lent) one trainer per
GPU runs Megatron TP N and vLLM runs TP N; each worker is compared with its own reload; the
model gets max(2, N) KV heads (Megatron TP N splits them; vLLM would replicate, Megatron
cannot). ``--plan`` (no GPU, no vLLM) spawns the N trainers on the CPU as the run would
(gloo), checks what each built (the same payload bytes, aimed at vLLM TP N, a refit group of
2N ranks), runs one optimizer step and the full-tensor gather over them, and prints the plan.
``--quant fp8_per_block`` under ``--tp N``: sizes whose vLLM rank slices are not whole
128-row FP8 tiles are raised (tiny) or refused before anything starts (``quant_problem``).
Prints one line per check, ``ENGINE_LOOP {json}`` last; exit 0 when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine_trainer import import_ipc_engine, trainer_main  # noqa: E402

_COMMON = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
               head_dim=32, ffn_hidden_size=512, vocab_size=1024, qk_layernorm=True)
MODELS = {  # TinyGPTSpec fields, family, HF architecture
    "dense": (dict(_COMMON), "qwen3", "Qwen3ForCausalLM"),
    "moe": (dict(_COMMON, num_moe_experts=64, moe_ffn_hidden_size=128, moe_router_topk=4),
            "qwen3_moe", "Qwen3MoeForCausalLM"),
}
# for --size large (speed): shapes of a real model's layers, fewer of them
LARGE = {"dense": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                       head_dim=128, ffn_hidden_size=6144, vocab_size=32768),
         "moe": dict(num_layers=2, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                     head_dim=128, ffn_hidden_size=6144, vocab_size=32768, num_moe_experts=64,
                     moe_ffn_hidden_size=768, moe_router_topk=8)}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 37, 999, 5], list(range(50, 82))]
GEN_TOKENS = 16
TRAINER_DEVICE = "cuda"  # the trainers' device type (one device each)
QUANT = {"none": (None, None), "fp8_per_block": ("fp8_per_block", "block_fp8_online")}  # vLLM's, ours
FP8_TILE = 128  # vLLM's block FP8: weight_block_size [128, 128]


def model_spec(model: str, size: str, tp: int, quant: str = "none") -> dict:
    """The trainer's TinyGPTSpec fields for ``--model`` / ``--size`` under TP ``tp``: at
    least one KV head per GPU (Megatron TP splits the KV heads, it cannot replicate them).
    Under ``--quant fp8_per_block`` each vLLM rank's slice of a linear weight must be whole
    128-row tiles (vLLM and the library refuse a split that cuts one; at TP1 k and v of
    2 x 32 rows shared a tile, seen on an H100): the KV rows per rank (head_dim) and, for the
    tiny model, the MLP and expert intermediate sizes are raised."""
    spec = dict(MODELS[model][0], **(LARGE[model] if size == "large" else {}))
    spec["num_query_groups"] = max(spec["num_query_groups"], tp)
    if quant != "none":
        groups_per_rank = max(1, spec["num_query_groups"] // max(tp, 1))
        spec["head_dim"] = max(spec["head_dim"], FP8_TILE // groups_per_rank)
        for key in ("ffn_hidden_size", "moe_ffn_hidden_size"):
            if size == "tiny" and spec.get(key):
                spec[key] = max(spec[key], FP8_TILE * tp)
    return spec


def tp_problem(spec: dict, tp: int, gpus: int | None) -> str | None:
    """Why ``--tp tp`` cannot run this model (``gpus``: the devices there are, None: not
    asked), or None."""
    if tp < 1:
        return f"--tp {tp}: expected at least 1"
    if spec["num_attention_heads"] % tp:
        return (f"--tp {tp}: the model's {spec['num_attention_heads']} attention heads do not "
                f"split over {tp} ranks")
    if gpus is not None and gpus < tp:
        return f"--tp {tp}: one GPU per trainer and vLLM worker, {gpus} visible"
    return None


def fp8_cut(spec: dict, tp: int) -> str | None:
    """The first weight whose slice on a vLLM TP ``tp`` rank is not whole FP8 tiles, or None."""
    hd = spec["head_dim"]
    split = {"q_proj / o_proj": spec["num_attention_heads"] * hd,
             "k_proj / v_proj": spec["num_query_groups"] * hd}
    if spec.get("num_moe_experts"):  # vLLM TP splits every expert (no EP)
        split["the experts' gate / up / down"] = spec["moe_ffn_hidden_size"]
    else:
        split["gate / up / down_proj"] = spec["ffn_hidden_size"]
    for name, rows in split.items():
        if rows % tp or (rows // tp) % FP8_TILE:
            return (f"{name}: {rows / tp:g} of its {rows} rows per vLLM rank under TP {tp}, "
                    f"not whole {FP8_TILE}-row FP8 tiles")
    return None


def quant_problem(model: str, size: str, tp: int, quant: str) -> str | None:
    """Why ``--quant`` cannot run ``--model`` / ``--size`` under ``--tp`` (checked before
    anything starts: the library would refuse it at the trainers' init), or None."""
    if quant == "none":
        return None
    cut = fp8_cut(model_spec(model, size, tp, quant), tp)
    if cut is None:
        return None
    fits = [t for t in (1, 2, 4, 8) if not tp_problem(model_spec(model, size, t, quant), t, None)
            and not fp8_cut(model_spec(model, size, t, quant), t)]
    other = ", --size tiny" if size != "tiny" else ""
    return (f"--quant {quant} --model {model} --size {size} --tp {tp}: {cut}; use --tp "
            f"{' or '.join(map(str, fits)) or '(none fits)'}{other} or --quant none")


def hf_config(spec: dict, arch: str) -> dict:
    """The config.json vLLM reads for the Megatron spec (as tests/hf_configs.py maps it)."""
    cfg = dict(architectures=[arch], model_type="qwen3_moe" if "Moe" in arch else "qwen3",
               vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
               intermediate_size=spec["ffn_hidden_size"], num_hidden_layers=spec["num_layers"],
               num_attention_heads=spec["num_attention_heads"],
               num_key_value_heads=spec["num_query_groups"], head_dim=spec["head_dim"],
               hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
               max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
               torch_dtype="bfloat16")
    if spec.get("num_moe_experts"):
        cfg.update(num_experts=spec["num_moe_experts"], num_experts_per_tok=spec["moe_router_topk"],
                   moe_intermediate_size=spec["moe_ffn_hidden_size"], norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


# ---- run inside the vLLM worker through collective_rpc (the worker is the first argument)

def _model(worker):
    return worker.model_runner.get_model()  # under a CUDA-graph wrapper, if any


def _inner(worker):
    """The GPU ``Worker`` itself: collective_rpc hands over vLLM's ``WorkerWrapperBase``,
    which reads through to it but keeps attributes set on it for itself."""
    return getattr(worker, "worker", worker)


def rpc_snapshot(worker) -> dict:
    model = _model(worker)
    out = {f"param:{n}": p.detach().to("cpu").clone() for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": b.detach().to("cpu").clone() for n, b in model.named_buffers()})
    return out


def rpc_pointers(worker) -> dict:
    model = _model(worker)
    return {n: (t.data_ptr(), tuple(t.shape), str(t.dtype))
            for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def rpc_plant(worker, name: str) -> int:
    """On worker 0, flip the lowest bit of the middle byte of param ``name`` (any dtype)."""
    if _inner(worker).rank != 0:
        return -1
    flat = dict(_model(worker).named_parameters())[name].data.view(-1).view(torch.uint8)
    i = flat.numel() // 2
    flat[i] ^= 1
    if flat.is_cuda:
        torch.cuda.synchronize(flat.device)
    return i


_BACKEND_ATTRS = ("unquantized_backend", "fp8_backend", "moe_backend", "backend", "use_marlin",
                  "flashinfer_moe_backend", "allow_deep_gemm", "block_quant")


def rpc_describe(worker) -> dict:
    """What the engine runs: the weight-transfer engine, each kind of MoE and linear method
    and the kernel it chose (item 3 of issue 51)."""
    model = _model(worker)
    moe, linear = {}, {}
    for name, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        if method is None:
            continue
        if hasattr(mod, "w13_weight"):
            key = type(method).__name__
            info = {k: str(getattr(method, k)) for k in _BACKEND_ATTRS if hasattr(method, k)}
            kernel = getattr(method, "moe_kernel", None) or getattr(method, "kernel", None)
            info["kernel"] = type(kernel).__name__ if kernel is not None else None
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None:
                info["experts"] = type(experts).__name__
            moe.setdefault(key, dict(info, layers=0))["layers"] += 1
        elif type(mod).__name__.endswith("Linear"):
            kernel = getattr(method, "kernel", None) or getattr(method, "w8a8_block_fp8_linear", None)
            key = type(method).__name__ + (f":{type(kernel).__name__}" if kernel is not None else "")
            linear[key] = linear.get(key, 0) + 1
    cc = worker.vllm_config.compilation_config
    return {"engine": type(worker.weight_transfer_engine).__name__, "moe": moe, "linear": linear,
            "cudagraph_mode": str(cc.cudagraph_mode), "compilation_mode": str(cc.mode),
            "graph_sizes": list(getattr(cc, "cudagraph_capture_sizes", None) or [])[:8]}


def rpc_last_phases(worker) -> dict:
    """Seconds of the last refit's phases inside the worker (``RefitResult.stats``)."""
    last = _inner(worker).weight_transfer_engine.last_refit
    keys = ("refit_s", "follow_s", "version_s", "bulk_s", "misc_s", "commit_s", "derived_s")
    return {k: last.stats.get(k) for k in keys} if last is not None else {}


def rpc_engine_state(worker) -> dict:
    return worker.weight_transfer_engine.refit_weights_state()


def rpc_shutdown_engine(worker) -> None:
    _inner(worker).weight_transfer_engine.shutdown()


def rpc_swap_engine(worker, to: str) -> str:
    """``to="ipc"``: vLLM's own IPC engine on the same model (ours kept aside); "ours": back."""
    worker = _inner(worker)
    if to == "ipc":
        from vllm.config import WeightTransferConfig

        ipc = import_ipc_engine().IPCWeightTransferEngine
        worker._megatron_reshard_engine = worker.weight_transfer_engine
        worker.weight_transfer_engine = ipc(WeightTransferConfig(backend="ipc"), worker.vllm_config,
                                            worker.device, _model(worker))
    else:
        worker.weight_transfer_engine = worker._megatron_reshard_engine
    return type(worker.weight_transfer_engine).__name__


def rpc_memcpy(worker, nbytes: int, iters: int) -> float:
    """Median seconds of one device copy of ``nbytes`` (CUDA events)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=worker.device)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    ok = torch.equal(src, dst)
    del src, dst
    return statistics.median(times) if ok else float("nan")


# ---- the loop ---------------------------------------------------------------------------

def element_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How two same-shaped tensors differ: elements, the first positions, values as float."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"shape": [list(a.shape), list(b.shape)], "dtype": [str(a.dtype), str(b.dtype)]}
    raw = lambda t: t.reshape(-1).view(torch.uint8).reshape(t.numel(), -1)  # noqa: E731
    ne = (raw(a) != raw(b)).any(dim=1)
    idx = ne.nonzero().flatten()[:8]
    fa, fb = a.reshape(-1).float(), b.reshape(-1).float()
    return {"elements": int(ne.sum()), "of": a.numel(), "first": idx.tolist(),
            "ours": fa[idx].tolist(), "ref": fb[idx].tolist(),
            "max_abs": float((fa - fb).abs().max())}


def differences(a: dict, b: dict) -> list:
    """Names whose bytes, shape or dtype differ (or that only one side has)."""
    bad = sorted(set(a) ^ set(b))
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(n)
    return bad


class Loop:
    def __init__(self, args):
        self.args = args
        _, self.family, self.arch = MODELS[args.model]
        self.spec = model_spec(args.model, args.size, args.tp, args.quant)
        self.vllm_quant, self.gen_quant = QUANT[args.quant]
        self.report: dict = {"case": vars(args), "checks": [], "refits": [], "ok": True}
        self.version = 0
        self.last_snapshot = self.last_gen = None
        self.prepare_options: dict | None = None  # the backend's (scripts/gpu_engine_staged.py)

    # -- the trainers (one per GPU): each has its command queue and its answer queue
    def send(self, *command, ranks=None) -> None:
        for rank in (range(len(self.cmds)) if ranks is None else ranks):
            self.cmds[rank].put(command)

    def expect(self, kind: str, ranks=None, timeout_s: float = 300.0) -> list:
        """Each trainer's (of ``ranks``, default all) answer ``kind``, in rank order."""
        return [self._answer(r, kind, timeout_s)
                for r in (range(len(self.ress)) if ranks is None else ranks)]

    def _answer(self, rank: int, kind: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got, value = self.ress[rank].get(timeout=1.0)
            except queue.Empty:
                if not self.trainers[rank].is_alive():
                    raise RuntimeError(f"trainer rank {rank} exited "
                                       f"({self.trainers[rank].exitcode}) while {kind!r} was awaited")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind!r} from trainer rank {rank} in {timeout_s:g} s")
                continue
            if got == "error":
                raise RuntimeError(f"trainer rank {rank} failed:\n{value}")
            if got != kind:
                raise RuntimeError(f"trainer rank {rank}: expected {kind!r}, found {got!r}")
            return value

    # -- the workers: one dict over all of them, names prefixed by the worker's rank
    def gather(self, fn, *args) -> dict:
        return {f"w{i}/{k}": v for i, out in enumerate(self.llm.collective_rpc(fn, args=args))
                for k, v in out.items()}

    def say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def check(self, name: str, ok: bool, detail="") -> None:
        self.report["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.report["ok"] &= bool(ok)
        self.say(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail != "" else ""))

    # -- start
    def spawn_trainers(self, device_type: str) -> list[dict]:
        """One training process per rank of Megatron TP ``--tp`` (``device_type`` ``cuda``:
        rank r on GPU r, where vLLM's worker r runs too); returns their configs."""
        from megatron_reshard.tools.worlds import free_ports

        tp = self.args.tp
        world_port, self.refit_port = free_ports(2)
        ctx = mp.get_context("spawn")
        self.cmds = [ctx.Queue() for _ in range(tp)]
        self.ress = [ctx.Queue() for _ in range(tp)]
        self.trainers, configs = [], []
        for rank in range(tp):
            device = f"{device_type}:{rank}" if device_type == "cuda" else device_type
            cfg = {"device": device, "rank": rank, "world": tp, "world_port": world_port,
                   "refit_port": self.refit_port, "spec": self.spec, "family": self.family,
                   "gen_quant": self.gen_quant, "timeout_s": self.args.timeout_s,
                   "lr": self.args.lr}
            self.trainers.append(ctx.Process(target=trainer_main, daemon=True,
                                             args=(cfg, self.cmds[rank], self.ress[rank])))
            self.trainers[-1].start()
            configs.append(cfg)
        return configs

    def start(self) -> None:
        tp = self.args.tp
        problem = tp_problem(self.spec, tp, torch.cuda.device_count())
        if problem:
            raise ValueError(problem)
        self.spawn_trainers(TRAINER_DEVICE)
        refit_port = self.refit_port
        model_dir = tempfile.mkdtemp(prefix="engine_loop_")
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config(self.spec, self.arch), f)
        # vLLM's worker processes (TP > 1) unpickle the rpc functions: they import this folder
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH"))
                                                   if p)
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        built = self.expect("payload")[0]  # the trainers' memory is in place before vLLM's profile
        self.model_bytes = built["bytes"]  # of rank 0's shards
        self.say(f"vllm {vllm.__version__}, torch {torch.__version__}, "
                 f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; trainer: {self.args.model} model, TP{tp}, "
                 f"{built['params']} params on rank 0, built in {built['build_s']:.1f} s")
        graphs = self.args.graphs
        kw = dict(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                  seed=0, gpu_memory_utilization=0.25, max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=512, enable_sleep_mode=True, enable_prefix_caching=False,
                  enforce_eager=graphs == "off", quantization=self.vllm_quant,
                  tensor_parallel_size=tp,
                  weight_transfer_config=WeightTransferConfig(backend="megatron_reshard"))
        if graphs == "on":  # full CUDA graphs for decode, without torch.compile
            kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        t1 = time.perf_counter()
        self.llm = LLM(**kw)
        self.report["llm_up_s"] = time.perf_counter() - t1
        self.say(f"LLM up in {self.report['llm_up_s']:.1f} s (vLLM import {t1 - t0:.1f} s)")
        desc = self.llm.collective_rpc(rpc_describe)[0]
        self.report["engine"] = desc
        self.say(f"engine: {json.dumps(desc)}")
        self.check("vLLM's plugin loader registered megatron_reshard and the worker built it",
                   "megatron_reshard" in WeightTransferEngineFactory._registry
                   and desc["engine"] == "MegatronReshardWeightTransferEngine", desc["engine"])
        self.send("connect")
        t2 = time.perf_counter()
        self.llm.init_weight_transfer_engine({"init_info": {
            "host": "127.0.0.1", "ports_by_stage": [refit_port], "group_sizes": 2 * tp,
            "payload": built["payload"], "backend": "gloo", "timeout_s": self.args.timeout_s,
            "prepare_options": self.prepare_options}})
        self.expect("ready")
        self.say(f"init_weight_transfer_engine: {time.perf_counter() - t2:.2f} s")

    # -- one refit through LLM's weight-transfer methods
    def step(self) -> None:
        self.send("step", self.version + 1)
        self.expect("stepped")

    def refit(self) -> dict:
        self.version += 1
        self.send("refit", self.version)
        t0 = time.perf_counter()
        self.llm.start_weight_update()
        ta = time.perf_counter()
        self.llm.update_weights({"update_info": {"version": self.version}})
        tb = time.perf_counter()
        self.llm.finish_weight_update()
        t1 = time.perf_counter()
        sent = self.expect("refitted")
        self.llm.reset_prefix_cache()
        return {"version": self.version, "pause_s": t1 - t0,
                "refit_s": max([t1] + [s["t1"] for s in sent]) - min([t0] + [s["t0"] for s in sent]),
                "sender_refit_s": max(s.get("refit_s", 0.0) for s in sent),
                # where the pause goes: each LLM call as the caller sees it
                "start_call_s": ta - t0, "update_call_s": tb - ta, "finish_call_s": t1 - tb,
                # the trainers' side (perf_counter is system-wide on Linux): how late they
                # entered their refit after start_weight_update, their version vote, commit
                "trainer_lag_s": max(s["t0"] for s in sent) - t0,
                "trainer_version_s": max(s.get("version_s") or 0.0 for s in sent),
                "trainer_commit_s": max(s.get("commit_s") or 0.0 for s in sent),
                "trainer_bulk_s": max(s.get("bulk_s") or 0.0 for s in sent)}

    def generate(self) -> tuple:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                    for o in outs]
        return tokens, logprobs

    def verify(self, label: str, plant: str | None = None) -> dict:
        """The engine after the refit against vLLM's own loading of the same step."""
        rpc = self.llm.collective_rpc
        self.send("full")
        full = self.expect("full")[0]
        ptrs = self.gather(rpc_pointers)
        if plant is not None:
            rpc(rpc_plant, args=(plant,))
        refitted = self.gather(rpc_snapshot)
        gen = self.generate()
        t0 = time.perf_counter()
        rpc("reload_weights", kwargs={"weights_iterator": list(full.items())})
        reload_s = time.perf_counter() - t0
        self.llm.reset_prefix_cache()
        reference = self.gather(rpc_snapshot)
        ref_gen = self.generate()
        moved = sorted(n for n, v in self.gather(rpc_pointers).items() if ptrs.get(n) != v)
        bad = differences(refitted, reference)
        if bad and plant is None:  # vLLM's own reload twice: is the reference itself stable?
            rpc("reload_weights", kwargs={"weights_iterator": list(full.items())})
            again = self.gather(rpc_snapshot)
            self.report.setdefault("diagnose", []).append({
                "label": label, "reload_twice_differs": differences(reference, again)[:6],
                "elements": {n: element_diff(refitted[n], reference[n]) for n in bad[:4]}})
            self.say(f"diagnose: {self.report['diagnose'][-1]}")
        changed = (None if self.last_snapshot is None
                   else len(differences(self.last_snapshot, refitted)))
        self.last_snapshot = reference
        outputs_moved = None if self.last_gen is None else ref_gen[1] != self.last_gen[1]
        self.last_gen = ref_gen
        states = sorted({s["state"] for s in rpc(rpc_engine_state)})
        out = {"label": label, "differ": bad, "moved": moved, "tokens_equal": gen[0] == ref_gen[0],
               "logprobs_equal": gen[1] == ref_gen[1], "tensors": len(reference),
               "changed_since_last_refit": changed, "reload_s": reload_s,
               "tokens": gen[0][0][:8], "state": "/".join(states)}
        if plant is None:
            self.check(f"{label}: {len(reference)} params+buffers bit-equal to vLLM's reload_weights"
                       f" ({changed} changed since the last refit)", not bad, bad[:6])
            self.check(f"{label}: no tensor moved (reload and refit wrote in place)", not moved,
                       moved[:6])
            self.check(f"{label}: greedy tokens and logprobs equal the reference's",
                       out["tokens_equal"] and out["logprobs_equal"], f"first {gen[0][0][:8]}")
            if outputs_moved is not None:  # the engine computes with the new weights (with
                # CUDA graphs: the captured graphs read the storage the refit wrote)
                self.check(f"{label}: logprobs changed since the last refit", outputs_moved)
            self.check(f"{label}: weight state consistent", states == ["consistent"], states)
        else:
            self.check(f"{label}: the planted fault in worker 0's {plant} is reported, alone",
                       bad == [f"w0/param:{plant}"], bad[:6])
        return out

    # -- the cases
    def run(self) -> None:
        self.start()
        for i in range(self.args.refits):
            level = {1: 1, 2: 2}.get(i, 0)
            if level:
                before = self.gather(rpc_pointers)
                asleep_from = self.last_snapshot
                self.llm.sleep(level=level)
                self.step()  # the trainer trains while vLLM sleeps
                self.llm.wake_up(tags=["weights"])
                woke = self.gather(rpc_snapshot)
                lost = len([n for n in differences(asleep_from, woke) if "/param:" in n])
                same_place = self.gather(rpc_pointers) == before
                self.check(f"sleep(level={level}) + wake_up(weights): tensors at the same "
                           f"addresses ({lost} params lost their values while asleep)",
                           same_place and (level == 2 or lost == 0))
            elif i:
                self.step()
            r = self.refit()
            if level:
                self.llm.wake_up(tags=["kv_cache"])
            r.update(self.verify(f"refit {r['version']}" + (f" after sleep({level})" if level else "")))
            r["sleep_level"] = level
            self.report["refits"].append(r)
            self.say(f"refit {r['version']}: pause {r['pause_s'] * 1e3:.1f} ms, refit "
                     f"{r['refit_s'] * 1e3:.1f} ms, reference reload {r['reload_s'] * 1e3:.1f} ms")
        if self.args.refits:
            self.step()
            self.refit()
            names = [n.split("/param:", 1)[1] for n in self.last_snapshot
                     if n.startswith("w0/param:")]
            layer2 = [n for n in names if "layers.2.mlp." in n] or names
            target = next((n for n in layer2 if "experts" in n), layer2[0])  # experts first
            self.report["planted"] = self.verify(f"refit {self.version}, planted", plant=target)
        if self.args.speed:
            self.speed(self.args.speed)
        self.send("stop")  # both sides leave the refit group together
        self.llm.collective_rpc(rpc_shutdown_engine)
        for t in self.trainers:
            t.join(timeout=60)

    def plan(self) -> None:
        """``--plan``: the run's training side on the CPU, as far as it goes without vLLM."""
        from megatron_reshard.wire.codec import decode_payload
        from megatron_reshard.wire.records import RefitPayload

        tp = self.args.tp
        configs = self.spawn_trainers("cpu")
        built = self.expect("payload")
        info = RefitPayload.of(decode_payload(built[0]["payload"]))
        plan = {"trainers": [{k: c[k] for k in ("rank", "world", "device", "world_port", "refit_port")}
                             for c in configs],
                "refit_group": {"size": 2 * tp, "trainers": list(range(tp)),
                                "vllm_workers": list(range(tp, 2 * tp))},
                "llm": {"tensor_parallel_size": tp, "quantization": self.vllm_quant},
                "init_info": {"ports_by_stage": [self.refit_port], "group_sizes": 2 * tp},
                "model": {k: self.spec[k] for k in ("num_attention_heads", "num_query_groups")},
                "payload": {"train_world_size": info.train_world_size,
                            "gen_world_size": info.gen_world_size, "gen_tp_size": info.gen_tp_size,
                            "bytes": len(built[0]["payload"])}}
        self.report["plan"] = plan
        self.say(f"plan: {json.dumps(plan)}")
        self.check(f"the {tp} trainers built the same payload bytes",
                   all(b["payload"] == built[0]["payload"] for b in built))
        self.check(f"the payload aims at vLLM TP{tp} over {tp} workers from Megatron TP{tp}",
                   (info.gen_tp_size, info.gen_world_size, info.train_world_size) == (tp, tp, tp),
                   plan["payload"])
        self.step()
        self.send("full")
        full = self.expect("full")
        self.check("an optimizer step ran on every trainer; rank 0 answers the full tensors",
                   bool(full[0]) and all(f is None for f in full[1:]), f"{len(full[0] or {})} tensors")
        self.send("stop")
        for t in self.trainers:
            t.join(timeout=60)
        codes = [t.exitcode for t in self.trainers]
        self.check("every trainer stopped cleanly", codes == [0] * tp, codes)

    def ipc_refit(self) -> dict:
        self.send("ipc")
        update = self.expect("ipc_update", ranks=[0])[0]
        t0 = time.perf_counter()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": update})
        self.send("ipc_done", ranks=[0])
        self.llm.finish_weight_update()
        t1 = time.perf_counter()
        sent = self.expect("ipc_sent")
        # from the full HF tensors on the trainers' GPUs (the oracle's gather goes through the
        # CPU, which a trainer's conversion would not: timed apart)
        return {"pause_s": t1 - t0, "refit_s": t1 - max(s["gathered"] for s in sent),
                "trainer_gather_s": max(s["gathered"] - s["t0"] for s in sent)}

    def speed(self, iters: int) -> None:
        rpc = self.llm.collective_rpc
        ours, ipc = [], []
        before = self.gather(rpc_pointers)
        for _ in range(iters + 1):  # the first of each warms up
            ours.append(self.refit())
            ours[-1]["worker"] = rpc(rpc_last_phases)[0]
            rpc(rpc_swap_engine, args=("ipc",))
            ipc.append(self.ipc_refit())
            rpc(rpc_swap_engine, args=("ours",))
        ours, ipc = ours[1:], ipc[1:]
        self.check("vLLM's ipc backend wrote in place too", self.gather(rpc_pointers) == before)
        if self.args.refits:
            self.step()
        self.refit()
        self.verify(f"refit {self.version}, after the timed refits")
        copy_s = rpc(rpc_memcpy, args=(self.model_bytes, 20))[0]
        med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
        table = {"bytes": self.model_bytes, "memcpy_ms": copy_s * 1e3,
                 "ours_refit_ms": med(ours, "refit_s") * 1e3, "ours_pause_ms": med(ours, "pause_s") * 1e3,
                 "ipc_refit_ms": med(ipc, "refit_s") * 1e3, "ipc_pause_ms": med(ipc, "pause_s") * 1e3,
                 "ipc_trainer_gather_ms": med(ipc, "trainer_gather_s") * 1e3, "iters": iters,
                 "ours_ms": [r["refit_s"] * 1e3 for r in ours],
                 "ipc_ms": [r["refit_s"] * 1e3 for r in ipc]}
        # the pause of this backend, phase by phase (median ms): the LLM calls as the caller
        # sees them, inside update_weights the worker's refit and its phases
        phases = {k: med(ours, k) * 1e3 for k in ("start_call_s", "update_call_s", "finish_call_s",
                                                  "trainer_lag_s", "trainer_version_s",
                                                  "trainer_commit_s", "trainer_bulk_s")}
        phases.update({f"worker_{k}": statistics.median(r["worker"][k] or 0.0 for r in ours) * 1e3
                       for k in ours[0]["worker"]})
        table["ours_phases_ms"] = phases
        self.report["speed"] = table
        self.say("phases of this backend's pause (median ms): "
                 + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        self.say("| what | median ms | × memcpy | vs ipc |\n|---|---|---|---|")
        for name, key, ref in (("this backend: refit", "ours_refit_ms", "ipc_refit_ms"),
                               ("this backend: generation pause", "ours_pause_ms", "ipc_pause_ms"),
                               ("vLLM ipc: refit", "ipc_refit_ms", None),
                               ("vLLM ipc: generation pause", "ipc_pause_ms", None),
                               ("device memcpy of the same bytes", "memcpy_ms", None)):
            ratio = f"{table[ref] / table[key]:.2f}× faster" if ref else ""
            print(f"| {name} | {table[key]:.3f} | {table[key] / table['memcpy_ms']:.1f} | {ratio} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="dense")
    p.add_argument("--graphs", choices=["off", "on"], default="off",
                   help="on: full CUDA graphs for decode (no torch.compile)")
    p.add_argument("--quant", choices=sorted(QUANT), default="none",
                   help="vLLM's quantization of the BF16 checkpoint (fp8_per_block: online)")
    p.add_argument("--size", choices=["tiny", "large"], default="tiny",
                   help="large: real layer shapes, for --speed (with --refits 0)")
    p.add_argument("--refits", type=int, default=4, help="checked refits (>= 3: both sleeps)")
    p.add_argument("--speed", type=int, default=0, help="timed refits of each backend")
    p.add_argument("--tp", type=int, default=1,
                   help="GPUs: Megatron TP and vLLM TP over all of them (one trainer per GPU)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--lr", type=float, default=1e-3,
                   help="AdamW learning rate of the steps (large enough to change greedy tokens)")
    p.add_argument("--json", default=None, help="write the report here too")
    p.add_argument("--plan", action="store_true",
                   help="no GPU, no vLLM: the trainers on the CPU, what they build, the plan")
    args = p.parse_args(argv)
    problem = (tp_problem(model_spec(args.model, args.size, args.tp, args.quant), args.tp, None)
               or quant_problem(args.model, args.size, args.tp, args.quant))
    if problem:
        p.error(problem)
    loop = Loop(args)
    return run_and_report(loop, loop.plan if args.plan else loop.run, args.json, "ENGINE_LOOP")


def run_and_report(loop: "Loop", body, json_path: str | None, tag: str) -> int:
    """Run ``body``; an exception is reported with what ran before it. The report is
    written to ``json_path`` (if given) and printed after ``tag``; 0 when every check held."""
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - reported with what ran before it
        traceback.print_exc()
        loop.report.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
    line = json.dumps(loop.report, default=str)
    if json_path:
        with open(json_path, "w") as f:
            f.write(line)
    print(f"{tag} " + line[:6000], flush=True)
    return 0 if loop.report["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # vLLM's in-process engine leaves threads behind; the report is out
