"""One refit end to end: a Megatron training world and a generation world, joined by refit groups.

Shared by ``megatron-reshard demo`` (CPU, gloo, spawned workers) and the torchrun launchers
(``scripts/refit_torchrun.py``, NCCL, one process per GPU). Process ``rank`` of a launch of
``train_world + gen_world`` processes plays training rank ``rank`` if ``rank < train_world``,
else generation rank ``rank - train_world``. The two sides get separate default worlds
(each built from an explicit store, as two launchers would), and one refit group per
training PP stage is built from its own ``TCPStore`` (``comm.create_refit_group``).

Verification is independent of the refit path: the training ranks gather the full HF
tensors with the reference oracle (``megatron.reference``), training rank 0 slices the
expected vLLM shard of every generation parameter (``testing.vllm_like.expected_vllm_shard``)
and publishes its SHA-256; each generation rank compares the digests of its live storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_reshard.receiver import MegatronReshardWorkerExtension

# Model presets: tiny Qwen3-shaped models (GQA, QK norm), a Qwen2-shaped dense model (GQA,
# q/k/v biases) and a DeepSeek-V3-shaped one (MLA with q LoRA, sigmoid routing with
# score-correction bias, a shared expert, first layer dense). Plain data: crosses into workers.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "moe": dict(family="qwen3_moe", num_layers=4, hidden_size=64, num_attention_heads=8,
                num_query_groups=2, ffn_hidden_size=128, num_moe_experts=8,
                moe_ffn_hidden_size=32, vocab_size=500, qk_layernorm=True),
    "dense": dict(family="qwen3", num_layers=4, hidden_size=64, num_attention_heads=8,
                  num_query_groups=2, ffn_hidden_size=160, vocab_size=500, qk_layernorm=True),
    "qwen2": dict(family="qwen2", num_layers=4, hidden_size=64, num_attention_heads=8,
                  num_query_groups=2, ffn_hidden_size=160, vocab_size=500, add_qkv_bias=True),
    "deepseek": dict(family="deepseek_v3", num_layers=4, hidden_size=64, num_attention_heads=8,
                     num_query_groups=8, ffn_hidden_size=128, num_moe_experts=8,
                     moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                     moe_layer_freq=[0, 1, 1, 1], vocab_size=500, multi_latent_attention=True,
                     q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                     v_head_dim=16, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                     layernorm_epsilon=1e-6),
}

# --gen-precision fp8: the preset's dims made whole 128x128 blocks per TP shard (head_dim
# 128, hidden 256, FFN 512 / experts 256), as vLLM's block-FP8 layers require
FP8_MODEL_OVERRIDES: dict[str, Any] = dict(hidden_size=256, num_attention_heads=4,
                                           num_query_groups=2, head_dim=128, ffn_hidden_size=512,
                                           moe_ffn_hidden_size=256, num_moe_experts=4,
                                           num_layers=2)
GEN_PRECISIONS = ("bf16", "fp8", "mxfp8")


def model_preset(cfg: "RefitRunConfig") -> dict[str, Any]:
    """The model's spec values (family included) for this run."""
    preset = dict(MODEL_PRESETS[cfg.model])
    if cfg.gen_precision in ("fp8", "mxfp8"):
        preset.update({k: v for k, v in FP8_MODEL_OVERRIDES.items()
                       if k in preset or k == "head_dim"})
    preset.update(cfg.model_overrides)
    return preset


@dataclass(frozen=True)
class RefitRunConfig:
    """Everything a process needs to play its part (plain data)."""

    model: str = "moe"
    model_overrides: dict = field(default_factory=dict)
    train_world: int = 4
    train_tp: int = 2
    train_pp: int = 2
    train_ep: int = 2
    gen_world: int = 2
    gen_tp: int = 2
    gen_ep: int = 1
    refits: int = 3
    verify: bool = True
    backend: str = "gloo"
    device: str = "cpu"
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    ports: tuple = ()  # control store, then one refit-group store per training PP stage
    timeout_s: float = 120.0
    num_streams: int = 2
    staging_mib: float = 256.0
    quiet: bool = False
    packed_params: Optional[str] = None  # regex of HF params sent by packed broadcast instead

    gen_precision: str = "bf16"  # "fp8": block-FP8 generation model (fp8_plan); "mxfp8"
    # "fp8_blockwise": linear weights held in blockwise FP8 for training (testing.fp8_training,
    # the CPU stand-in for TE fp8_param); needs gen_precision "fp8"
    train_precision: str = "bf16"

    @property
    def gen_quant(self):
        return {"fp8": "block_fp8", "mxfp8": "mxfp8"}.get(self.gen_precision)

    @property
    def staging_bytes(self) -> int:
        """Engine staging budget, also the size bound of each packed misc buffer."""
        return max(64, int(self.staging_mib * (1 << 20)))

    @property
    def stage_world(self) -> int:
        return self.train_world // self.train_pp

    def problems(self) -> list[str]:
        """What keeps this run from starting, one line each naming the option, what was
        expected and what was found (empty when it can start). Checked before any process
        is spawned: a layout the model cannot be split into fails here, not in a worker."""
        out = _basic_problems(self)
        if out:
            return out  # sizes below 1 or an unknown model: the checks below would divide by them
        tp, pp, ep, world = self.train_tp, self.train_pp, self.train_ep, self.train_world
        if world % (tp * pp):
            out.append(f"--train-world {world}: expected a multiple of --train-tp × --train-pp "
                       f"= {tp}×{pp} = {tp * pp}; {world} is not divisible by {tp * pp}")
        elif (world // pp) % ep:
            out.append(f"--train-ep {ep}: expected a divisor of the {world // pp} training ranks "
                       f"per PP stage (--train-world {world} / --train-pp {pp})")
        if self.gen_world % self.gen_tp:
            out.append(f"--gen-world {self.gen_world}: expected a multiple of --gen-tp "
                       f"{self.gen_tp}; {self.gen_world} is not divisible by {self.gen_tp}")
        if self.gen_ep not in (1, self.gen_tp):
            out.append(f"--gen-ep {self.gen_ep}: expected 1 or --gen-tp ({self.gen_tp}); "
                       "vLLM's expert parallelism spans its TP ranks")
        out += _model_problems(self)
        if len(self.ports) < 1 + pp:
            out.append(f"ports: need {1 + pp} (control + one per PP stage), got {len(self.ports)}")
        return out


def _basic_problems(cfg: RefitRunConfig) -> list[str]:
    """Option values that are wrong whatever the model: sizes, counts, names."""
    out = []
    for option, value in (("--train-world", cfg.train_world), ("--train-tp", cfg.train_tp),
                          ("--train-pp", cfg.train_pp), ("--train-ep", cfg.train_ep),
                          ("--gen-world", cfg.gen_world), ("--gen-tp", cfg.gen_tp),
                          ("--gen-ep", cfg.gen_ep), ("--refits", cfg.refits),
                          ("--streams", cfg.num_streams)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append(f"{option} {value}: expected an integer >= 1")
    for option, number in (("--staging-mib", cfg.staging_mib), ("--timeout-s", cfg.timeout_s)):
        if not number > 0:
            out.append(f"{option} {number}: expected a number > 0")
    if cfg.model not in MODEL_PRESETS:
        out.append(f"--model {cfg.model!r}: expected one of {', '.join(sorted(MODEL_PRESETS))}")
    if cfg.backend not in ("gloo", "nccl"):
        out.append(f"--backend {cfg.backend!r}: expected gloo or nccl")
    if cfg.device not in ("cpu", "cuda"):
        out.append(f"--device {cfg.device!r}: expected cpu or cuda")
    elif cfg.backend == "nccl" and cfg.device != "cuda":
        out.append(f"--backend nccl: expected --device cuda, found --device {cfg.device}")
    if cfg.train_precision not in ("bf16", "fp8_blockwise"):
        out.append(f"--train-precision {cfg.train_precision!r}: expected bf16 or fp8_blockwise")
    elif cfg.train_precision == "fp8_blockwise" and cfg.gen_precision != "fp8":
        out.append("--train-precision fp8_blockwise: expected --gen-precision fp8 (blockwise FP8 "
                   f"training weights refit into block-FP8 generation), found {cfg.gen_precision}")
    if cfg.gen_precision not in GEN_PRECISIONS:
        out.append(f"--gen-precision {cfg.gen_precision!r}: expected one of {', '.join(GEN_PRECISIONS)}")
    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        out.append(f"--dtype {cfg.dtype!r}: expected bfloat16, float16 or float32")
    if cfg.packed_params is not None:
        import re

        try:
            re.compile(cfg.packed_params)
        except re.error as err:
            out.append(f"--packed-params {cfg.packed_params!r}: expected a regular expression ({err})")
    return out


def _split_refusals(cfg: RefitRunConfig) -> dict[str, Any]:
    """Per layout option, a function from a size to why the model cannot be split by it
    (``None``: it can).

    Training (Megatron-Core, expert TP 1): TP divides the attention heads and the dense
    FFN, and divides the KV heads or is a multiple of them (Megatron replicates them); EP divides
    the experts; PP divides the layers. Generation (vLLM
    layout): TP divides the attention heads, divides or is a multiple of the KV heads
    (vLLM replicates a KV head over TP/nkv ranks), divides the dense FFN, the expert FFN
    (gen EP 1) and the padded vocab rows; gen EP is at most the experts (vLLM gives the
    first ranks one expert more when they do not divide).
    """
    from megatron_reshard.vllm_layout import padded_vocab_rows

    m = model_preset(cfg)
    heads = m["num_attention_heads"]
    kv = m.get("num_query_groups") or heads
    experts = m.get("num_moe_experts") or 0
    # MLA (local spec): the down projections are column-parallel over training TP
    mla_down = ((m.get("q_lora_rank") or 0, m["kv_lora_rank"] + m["qk_pos_emb_head_dim"])
                if m.get("multi_latent_attention") else ())
    layers = m["num_layers"]
    # the dense FFN exists unless every layer is an MoE layer
    ffn = m["ffn_hidden_size"] if not experts or m.get("moe_layer_freq", 1) != 1 else None
    shared = m.get("moe_shared_expert_intermediate_size")
    expert_ffn = m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]
    vocab_rows = padded_vocab_rows(m["vocab_size"])
    uneven_pp = (m.get("num_layers_in_first_pipeline_stage")
                 or m.get("num_layers_in_last_pipeline_stage"))

    def tp_common(t: int) -> Optional[str]:
        if heads % t:
            return f"does not divide its {heads} attention heads"
        if ffn and ffn % t:
            return f"does not divide its FFN size {ffn}"
        if shared and shared % t:
            return f"does not divide its shared-expert FFN size {shared}"
        return None

    def train_tp(t: int) -> Optional[str]:
        for rows in mla_down:
            if rows % t:
                return f"does not divide the {rows} output rows of an MLA down projection"
        if t <= kv and kv % t:
            return f"does not divide its {kv} KV heads (query groups)"
        if t > kv and t % kv:
            return f"neither divides nor is a multiple of its {kv} KV heads (query groups)"
        return tp_common(t)

    def gen_tp(t: int) -> Optional[str]:
        if kv % t if t <= kv else t % kv:
            return f"neither divides nor is a multiple of its {kv} KV heads"
        if experts and cfg.gen_ep == 1 and expert_ffn % t:
            return (f"does not divide its expert FFN size {expert_ffn} (with --gen-ep 1 every "
                    "rank holds a TP slice of every expert)")
        if vocab_rows % t:
            return (f"does not divide its {vocab_rows} vocab rows (vocab {m['vocab_size']} "
                    "padded as vLLM pads it)")
        if cfg.gen_quant == "block_fp8":  # MXFP8 cuts are refused by fp8_plan.plan_mxfp8
            return tp_common(t) or fp8_blocks(t)
        return tp_common(t)

    def fp8_blocks(t: int) -> Optional[str]:
        """vLLM's block-FP8 layers hold whole 128-row/column blocks on every TP rank."""
        head_dim = m.get("head_dim") or m["hidden_size"] // heads
        sizes = {"attention rows per rank": heads * head_dim // t,
                 "KV rows per rank": max(1, kv // t) * head_dim}
        if ffn:
            sizes["FFN rows per rank"] = ffn // t
        if experts:
            sizes["expert FFN rows per rank"] = expert_ffn // (t if cfg.gen_ep == 1 else 1)
        cut = {k: v for k, v in sizes.items() if t > 1 and v % 128}
        if cut:
            return f"cuts 128x128 FP8 blocks ({cut}) with --gen-precision fp8"
        return None

    def ep(e: int) -> Optional[str]:
        if not experts:
            return None if e == 1 else "is not 1: the model has no experts"
        return f"does not divide its {experts} experts" if experts % e else None

    def gen_ep(e: int) -> Optional[str]:
        if not experts:
            return None if e == 1 else "is not 1: the model has no experts"
        return f"is more than its {experts} experts" if e > experts else None

    def pp(p: int) -> Optional[str]:
        return f"does not divide its {layers} layers" if not uneven_pp and layers % p else None

    return {"--train-tp": train_tp, "--train-pp": pp, "--train-ep": ep, "--gen-tp": gen_tp,
            "--gen-ep": gen_ep}


def _model_problems(cfg: RefitRunConfig) -> list[str]:
    """One line per layout option the model cannot be split by, with the sizes it can."""
    refusals = _split_refusals(cfg)
    sizes = {"--train-tp": cfg.train_tp, "--train-pp": cfg.train_pp, "--train-ep": cfg.train_ep,
             "--gen-tp": cfg.gen_tp, "--gen-ep": cfg.gen_ep}
    out = []
    for option, size in sizes.items():
        why = refusals[option](size)
        if why is not None:
            valid = [str(n) for n in range(1, 129) if refusals[option](n) is None]
            expected = valid[0] if len(valid) == 1 else "one of " + ", ".join(valid)
            out.append(f"{option} {size}: expected {expected} for the {cfg.model} model; "
                       f"{size} {why}")
    return out


def _say(cfg: RefitRunConfig, who: str, msg: str) -> None:
    if not cfg.quiet:
        # one write with its newline: print's two writes let another rank's line in between
        sys.stderr.write(f"[{who}] {msg}\n")
        sys.stderr.flush()


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (shape and dtype included): equal digests ⇔ equal bits."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    h = hashlib.sha256(f"{tuple(t.shape)}|{t.dtype}|".encode())
    h.update(flat.numpy().tobytes())
    return h.hexdigest()


def _device_for(cfg: RefitRunConfig, rank: int) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"rank {rank}: device 'cuda' asked for, but this machine has no "
                               f"CUDA device; run with --device cpu --backend gloo")
        index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_world(cfg: RefitRunConfig, control: dist.Store, name: str, rank: int, size: int,
                device: torch.device) -> None:
    kwargs = dict(store=dist.PrefixStore(f"world/{name}", control), rank=rank, world_size=size,
                  timeout=timedelta(seconds=cfg.timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(cfg.backend, **kwargs)


@torch.no_grad()
def perturb_(model: torch.nn.Module, step: int) -> None:
    """A deterministic weight change between refits, identical on every replica."""
    for p in model.parameters():
        p.mul_(-1.5).add_(0.125 * step)


def run_rank(rank: int, cfg: RefitRunConfig, *, model_builder=None, after_refits=None) -> dict:
    """Play process ``rank`` of the launch; returns a plain-data summary of this rank.

    Optional hooks (keyword-only; the benchmark uses them, the demo does not):
    ``model_builder(spec, device, dtype) -> model`` replaces ``build_gpt_model(spec).to(...)``
    on the training ranks (it must give replicas equal values); ``after_refits(ctx) -> dict``
    runs on every rank after the refit loop, with ``ctx`` holding ``role``, ``rank``,
    ``cfg``, ``device``, ``group`` (the refit group of stage 0 for generation ranks, of
    the rank's stage for training ranks), ``control`` (the store), ``model`` and ``sender``
    (train) or ``worker`` (gen); its result is stored under the key ``"bench"``.
    """
    problems = cfg.problems()
    if problems:
        raise ValueError("invalid refit run configuration:\n  - " + "\n  - ".join(problems))
    device = _device_for(cfg, rank)
    control = dist.TCPStore(cfg.host, cfg.ports[0], cfg.train_world + cfg.gen_world, rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if rank < cfg.train_world:
        return run_training_rank(rank, cfg, control, device, model_builder, after_refits)
    return _gen_rank(rank - cfg.train_world, cfg, control, device, after_refits)


def run_training_rank(rank: int, cfg: RefitRunConfig, control, device: torch.device,
                      model_builder=None, after_refits=None) -> dict:
    """Training rank ``rank``: join the training world through ``control`` (a store), build
    the model, publish the payload (rank 0, key ``payload``), refit ``cfg.refits`` times and,
    with ``cfg.verify``, publish each refit's expected digests (``expected/{step}/{gen}``)."""
    # megatron-core's notices about optional packages (Apex, TE) and CPU-only settings
    # would repeat once per process and bury the run's own progress lines
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron.core import parallel_state as ps

    from megatron_reshard.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict

    who = f"train {rank}"
    t0 = time.perf_counter()
    _init_world(cfg, control, "train", rank, cfg.train_world, device)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.train_tp,
                                 pipeline_model_parallel_size=cfg.train_pp,
                                 expert_model_parallel_size=cfg.train_ep,
                                 expert_tensor_parallel_size=1,
                                 distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)))
    preset = model_preset(cfg)
    family = preset.pop("family")
    spec = TinyGPTSpec(dtype=cfg.dtype, **preset)
    # All params in the training dtype, as Float16Module leaves them (the local layer spec
    # keeps norms in fp32 otherwise; vLLM holds them in the model dtype).
    if model_builder is not None:
        model = model_builder(spec, device, getattr(torch, cfg.dtype))
    else:
        model = build_gpt_model(spec).to(device=device, dtype=getattr(torch, cfg.dtype))
    keep_expert_bias_fp32_(model)
    if cfg.train_precision == "fp8_blockwise":
        from megatron_reshard.testing.fp8_training import attach_blockwise_fp8_

        attach_blockwise_fp8_(model)
    if rank == 0:
        _say(cfg, who, f"training world up: tp{cfg.train_tp} pp{cfg.train_pp} ep{cfg.train_ep} "
                       f"on {cfg.train_world} ranks; model built ({cfg.model}, "
                       f"{sum(p.numel() for p in model.parameters())} params on rank 0)")
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": cfg.gen_tp, "ep_size": cfg.gen_ep,
                                                         "pp_size": 1},
                                 gen_world_size=cfg.gen_world, family=family,
                                 vocab_size=spec.vocab_size, packed_params=cfg.packed_params,
                                 gen_quant=cfg.gen_quant)
    if rank == 0:
        payload = source.payload_bytes()
        control.set("payload", payload)
        bulk = sum(len(ps) for ps in source.payload["per_layer_params"].values())
        packed = len(source.payload.get("other_params") or [])
        _say(cfg, who, f"payload {len(payload)} bytes published: {bulk + packed} refit tensors "
                       f"({bulk} on the exact path, {packed} packed; experts go as one tensor "
                       f"per projection)")
    group = create_refit_group(cfg.host, cfg.ports[1 + source.stage], source.stage_local_rank,
                               cfg.stage_world + cfg.gen_world, cfg.backend, cfg.timeout_s,
                               device=device if device.type == "cuda" else None,
                               who=f"train rank {rank} (PP stage {source.stage})",
                               label=f"refit group of PP stage {source.stage}")
    sender = RefitSender(source, group, device=device, num_streams=cfg.num_streams,
                         staging_bytes=cfg.staging_bytes, verify_checksums=cfg.verify)
    setup_s = time.perf_counter() - t0
    refits = []
    for step in range(cfg.refits):
        if step:
            perturb_(model, step)
            if cfg.train_precision == "fp8_blockwise":  # an optimizer step re-quantizes
                attach_blockwise_fp8_(model)
        stats = sender.refit()
        refits.append(stats)
        if cfg.verify:
            full = gather_full_hf_state_dict(model, family=family, vocab_size=spec.vocab_size)
            if rank == 0:
                _publish_expected(cfg, control, source.hf_config, full, step)
        if rank == 0:
            _say(cfg, who, f"refit {step + 1}/{cfg.refits} sent in {stats['refit_s'] * 1e3:.1f} ms")
    out = {"role": "train", "rank": rank, "setup_s": setup_s, "refits": refits}
    if after_refits is not None:
        out["bench"] = after_refits({"role": "train", "rank": rank, "cfg": cfg, "device": device,
                                     "group": group, "control": control, "model": model,
                                     "sender": sender, "source": source})
    destroy_refit_group(group, cfg.timeout_s)
    return out


def _publish_expected(cfg: RefitRunConfig, control, hf_config: dict, full: dict, step: int) -> None:
    from megatron_reshard.testing.fp8_reference import expected_vllm_fp8_params, quantize_full_hf
    from megatron_reshard.testing.vllm_like import expected_vllm_shard, vllm_param_shapes

    full = {k: v.to("cpu") for k, v in full.items()}
    pow2 = cfg.train_precision == "fp8_blockwise"
    quantized = quantize_full_hf(full, cfg.gen_quant, pow2) if cfg.gen_quant else None
    for g in range(cfg.gen_world):
        tp_rank = g % cfg.gen_tp
        if cfg.gen_quant:  # the independent quantizer on the full HF tensors, then sliced
            expected = expected_vllm_fp8_params(hf_config, full, tp_rank, cfg.gen_tp, cfg.gen_ep,
                                                pow2=pow2, fmt=cfg.gen_quant, quantized=quantized)
            control.set(f"expected/{step}/{g}",
                        json.dumps({n: tensor_digest(t) for n, t in expected.items()}))
            continue
        names = vllm_param_shapes(hf_config, tp_rank, cfg.gen_tp, cfg.gen_ep)
        digests = {n: tensor_digest(expected_vllm_shard(hf_config, n, full, tp_rank, cfg.gen_tp,
                                                        cfg.gen_ep)) for n in names}
        control.set(f"expected/{step}/{g}", json.dumps(digests))


class _ModuleWorker(MegatronReshardWorkerExtension):
    """The vLLM worker extension, with the model given directly instead of by vLLM."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def get_refit_model(self) -> torch.nn.Module:
        return self._model


def _gen_rank(gen_rank: int, cfg: RefitRunConfig, control, device: torch.device,
              after_refits=None) -> dict:
    from megatron_reshard.megatron.payload import decode_payload  # msgspec: the launcher decodes
    from megatron_reshard.testing.vllm_like import build_vllm_like_model

    who = f"gen {gen_rank}"
    t0 = time.perf_counter()
    _init_world(cfg, control, "gen", gen_rank, cfg.gen_world, device)
    payload = decode_payload(control.get("payload"))
    tp_rank = gen_rank % cfg.gen_tp
    model = build_vllm_like_model(payload["hf_config"], tp_rank, cfg.gen_tp, cfg.gen_ep,
                                  getattr(torch, cfg.dtype), device=device, quant=cfg.gen_quant)
    worker = _ModuleWorker(model)
    # group_rank=None: each worker derives it from its rank in the generation world, as
    # vLLM workers do when collective_rpc sends every worker the same arguments
    worker.init_refit_groups(cfg.host, list(cfg.ports[1:1 + cfg.train_pp]), None,
                             cfg.stage_world + cfg.gen_world, cfg.backend, cfg.timeout_s)
    summary = worker.prepare_refit(payload, {"num_streams": cfg.num_streams,
                                             "staging_bytes": cfg.staging_bytes,
                                             "verify_checksums": cfg.verify})
    setup_s = time.perf_counter() - t0
    if gen_rank == 0:
        _say(cfg, who, f"generation world up: tp{cfg.gen_tp} ep{cfg.gen_ep} on {cfg.gen_world} "
                       f"ranks; the refit tensors mapped onto {len(list(model.parameters()))} "
                       f"vLLM-layout model params")
    refits, mismatches = [], []
    for step in range(cfg.refits):
        stats = worker.refit()
        refits.append(stats)
        if cfg.verify:
            expected = json.loads(control.get(f"expected/{step}/{gen_rank}"))
            actual = {n: tensor_digest(p) for n, p in model.named_parameters()}
            bad = sorted(n for n in set(expected) | set(actual) if expected.get(n) != actual.get(n))
            mismatches.append(bad)
            if gen_rank == 0:
                verdict = "bit-exact" if not bad else f"{len(bad)} params differ"
                _say(cfg, who, f"refit {step + 1}/{cfg.refits} received in "
                               f"{stats['refit_s'] * 1e3:.1f} ms, committed as version "
                               f"{stats['version']} (checksums matched): {verdict}")
    # what the same weights take in the training dtype (block scales excluded): the bytes a
    # BF16 refit lands in this rank's storage, to compare an FP8 refit against
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    unquantized = sum(p.numel() * itemsize for n, p in model.named_parameters()
                      if not n.endswith(("_scale_inv", "_scale")))
    out = {"role": "gen", "rank": gen_rank, "setup_s": setup_s, "refits": refits,
           "unquantized_bytes": unquantized, "mismatches": mismatches,
           "report": worker.report(), "summary": summary,
           "verified": cfg.verify and not any(mismatches)}
    if after_refits is not None:
        groups = worker._refit_state()["groups"]
        out["bench"] = after_refits({"role": "gen", "rank": gen_rank, "cfg": cfg, "device": device,
                                     "group": groups[min(groups)], "control": control,
                                     "model": model, "worker": worker})
    worker.destroy_refit_groups(cfg.timeout_s)
    return out


def share_verdict(store, rank: int, world: int, verdict: Optional[str] = None) -> str:
    """Rank 0 publishes ``verdict`` in ``store`` (which it hosts); every rank returns it.

    Rank 0 waits until every rank has read it, so its store outlives the readers.
    """
    if rank == 0:
        store.set("verdict", verdict or "fail")
    value = store.get("verdict").decode()
    store.add("verdict_read", 1)
    if rank == 0:
        deadline = time.monotonic() + 60
        while int(store.add("verdict_read", 0)) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    return value


def summarize(cfg: RefitRunConfig, results: list[dict]) -> dict:
    """One plain-data summary of a run from every rank's result."""
    gens = [r for r in results if r["role"] == "gen"]
    per_gen = []
    for r in gens:
        last = r["refits"][-1] if r["refits"] else {}
        bulk, misc = last.get("bulk_bytes", 0), last.get("misc_bytes", 0)
        per_gen.append({"gen_rank": r["rank"], "params": r["report"]["params"] + r["report"]["misc_params"],
                        "bulk_params": r["report"]["params"], "other_params": r["report"]["misc_params"],
                        "bytes": bulk + misc, "bulk_bytes": bulk, "misc_bytes": misc,
                        "misc_wire_bytes": last.get("misc_wire_bytes", 0),
                        "unquantized_bytes": r.get("unquantized_bytes", bulk + misc),
                        "mismatched": sorted({n for bad in r["mismatches"] for n in bad})})
    total = sum(g["bytes"] for g in per_gen)
    refit_s = [max(r["refits"][i]["refit_s"] for r in results) for i in range(cfg.refits)]
    return {
        "verified": bool(cfg.verify) and all(r["verified"] for r in gens),
        "refits": cfg.refits,
        "params": max((g["params"] for g in per_gen), default=0),
        "bytes_per_gen_rank": {str(g["gen_rank"]): g["bytes"] for g in per_gen},
        "exact_path_fraction": (sum(g["bulk_bytes"] for g in per_gen) / total) if total else 0.0,
        "setup_s": max(r["setup_s"] for r in results),
        "refit_s": refit_s,
        "per_gen_rank": per_gen,
        "gen_precision": cfg.gen_precision,
        # bytes received over what the same refit in the training dtype would land
        "bytes_vs_unquantized": (total / sum(g["unquantized_bytes"] for g in per_gen)) if total else 0.0,
        "layout": {"model": cfg.model, "train": {"world": cfg.train_world, "tp": cfg.train_tp,
                                                  "pp": cfg.train_pp, "ep": cfg.train_ep},
                   "gen": {"world": cfg.gen_world, "tp": cfg.gen_tp, "ep": cfg.gen_ep},
                   "backend": cfg.backend, "device": cfg.device, "dtype": cfg.dtype},
    }


def default_train_ep(model: str) -> int:
    """The demo's training EP size for ``model``: EP over the experts, none for a dense model."""
    return 2 if (MODEL_PRESETS.get(model) or {}).get("num_moe_experts") else 1


def config_from_args(args, ports: tuple) -> RefitRunConfig:
    """The run's configuration from parsed options (``--train-ep`` left out: per model)."""
    train_ep = args.train_ep if args.train_ep is not None else default_train_ep(args.model)
    return RefitRunConfig(model=args.model, train_world=args.train_world, train_tp=args.train_tp,
                          train_pp=args.train_pp, train_ep=train_ep,
                          gen_world=args.gen_world, gen_tp=args.gen_tp, gen_ep=args.gen_ep,
                          refits=args.refits, verify=not args.no_verify, backend=args.backend,
                          device=args.device, dtype=args.dtype, ports=ports,
                          timeout_s=args.timeout_s, num_streams=args.streams,
                          staging_mib=args.staging_mib, quiet=getattr(args, "json", False),
                          packed_params=getattr(args, "packed_params", None),
                          gen_precision=getattr(args, "gen_precision", "bf16"),
                          train_precision=getattr(args, "train_precision", "bf16"))


def keep_expert_bias_fp32_(model: torch.nn.Module) -> None:
    """The router's score-correction bias stays float32 under a low-precision model, as
    Megatron's router keeps it (``_maintain_float32_expert_bias``) and vLLM holds it."""
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            buf.data = buf.data.float()


def add_run_arguments(parser) -> None:
    """Options shared by the demo and the torchrun launcher (each help states its default)."""
    d = RefitRunConfig()
    ep_defaults = ", ".join(f"{default_train_ep(m)} for {m}" for m in sorted(MODEL_PRESETS))
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default=d.model,
                        help="tiny model: moe (Qwen3-MoE-shaped, 8 experts, GQA), dense "
                             "(Qwen3-shaped, GQA), qwen2 (Qwen2-shaped, GQA, q/k/v biases) or "
                             "deepseek (DeepSeek-V3-shaped: MLA, 8 experts + a shared one, first "
                             "layer dense) (default: %(default)s)")
    parser.add_argument("--train-world", type=int, default=d.train_world,
                        help="training ranks (default: %(default)s)")
    parser.add_argument("--train-tp", type=int, default=d.train_tp,
                        help="training TP size (default: %(default)s)")
    parser.add_argument("--train-pp", type=int, default=d.train_pp,
                        help="training PP size (default: %(default)s)")
    parser.add_argument("--train-ep", type=int, default=None,
                        help=f"training EP size, expert TP 1 (default: per model, {ep_defaults})")
    parser.add_argument("--gen-world", type=int, default=d.gen_world,
                        help="generation ranks; a multiple of --gen-tp, the rest are replicas "
                             "(default: %(default)s)")
    parser.add_argument("--gen-tp", type=int, default=d.gen_tp,
                        help="generation TP size (default: %(default)s)")
    parser.add_argument("--gen-ep", type=int, default=d.gen_ep,
                        help="generation EP size: 1 or --gen-tp (default: %(default)s)")
    parser.add_argument("--refits", type=int, default=d.refits,
                        help="refits to run, at least 1; weights change between them "
                             "(default: %(default)s)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip the bit-exact check against the reference")
    parser.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32", "float16"],
                        help="parameter dtype on both sides (default: %(default)s)")
    parser.add_argument("--streams", type=int, default=d.num_streams,
                        help="on GPUs: how many side streams the refit spreads the training PP "
                             "stages over, round robin; on CPU: no effect, CPU has no streams "
                             "(default: %(default)s)")
    parser.add_argument("--staging-mib", type=float, default=d.staging_mib,
                        help="per-rank staging budget of the engine, also the size bound of a "
                             "packed buffer, in MiB (default: %(default)s)")
    parser.add_argument("--packed-params", default=None, metavar="REGEX",
                        help="HF params (matched with re.search) to send by packed broadcast from "
                             "each stage's first training rank instead of shard to shard "
                             "(default: none, every byte on the exact path)")
    parser.add_argument("--gen-precision", choices=GEN_PRECISIONS, default=d.gen_precision,
                        help="generation weights: bf16 (the training dtype), fp8 (vLLM block "
                             "FP8, 128x128 e4m3 + fp32 scale_inv; linear weights quantized on the "
                             "sending side where a shard owns whole blocks, else on the receiver) "
                             "or mxfp8 (e4m3 + E8M0 scale per 32 elements, quantized on the "
                             "receiver); with fp8/mxfp8 the model dims become multiples of 128 "
                             "(default: %(default)s)")
    parser.add_argument("--train-precision", choices=["bf16", "fp8_blockwise"],
                        default=d.train_precision,
                        help="fp8_blockwise: linear weights held in blockwise FP8 on the training "
                             "side (a plain-tensor stand-in for Megatron fp8_param with TE's "
                             "blockwise recipe); their bytes and scales move as they are; needs "
                             "--gen-precision fp8 (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s,
                        help="seconds every process group and store waits before failing "
                             "(default: %(default)s)")


__all__ = ["MODEL_PRESETS", "RefitRunConfig", "run_rank", "run_training_rank", "summarize",
           "share_verdict", "tensor_digest",
           "add_run_arguments", "config_from_args", "default_train_ep", "perturb_"]
