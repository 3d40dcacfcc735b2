"""What a refit run is, and whether it can start: the configuration shared by the demo, the
torchrun launchers and the refit benchmark (``megatron_reshard.tools.e2e`` runs it).

The model presets (``MODEL_PRESETS``, the FP8 overrides), ``RefitRunConfig`` (plain data:
it crosses into spawned workers) with its up-front validation (``problems``: option values,
the world sizes, and the layouts the model can be split into), and the command-line options
that build it (``add_run_arguments``, ``config_from_args``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# The Qwen3-Next / Qwen3.5 presets share their sizes (below)
_QWEN3_NEXT = dict(family="qwen3_next", num_layers=4, hidden_size=64, num_attention_heads=8,
                   num_query_groups=2, head_dim=16, ffn_hidden_size=128, num_moe_experts=8,
                   moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                   moe_shared_expert_gate=True, vocab_size=500, qk_layernorm=True,
                   experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                   attention_output_gate=True, linear_num_key_heads=4, linear_num_value_heads=8,
                   linear_key_head_dim=16, linear_value_head_dim=16)

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
    # GLM-4.5-shaped: GQA with q/k/v biases, partial RoPE, sigmoid routing with the
    # score-correction bias, 8 experts + a shared one, first layer dense
    "glm": dict(family="glm4_moe", num_layers=4, hidden_size=64, num_attention_heads=8,
                num_query_groups=2, head_dim=16, ffn_hidden_size=128, num_moe_experts=8,
                moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                moe_layer_freq=[0, 1, 1, 1], vocab_size=500, add_qkv_bias=True, rotary_percent=0.5,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5),
    # Qwen3-Next-shaped: megatron-core's GatedDeltaNet in three of four layers, gated full
    # attention in the fourth, 8 experts + a gated shared expert
    "qwen3-next": _QWEN3_NEXT,
    # Qwen3.5-MoE-shaped (qwen3_5_moe_text): Qwen3-Next's layers, the checkpoint's in_proj
    # streams flat and named apart (in_proj_qkv / _z / _b / _a)
    "qwen3.5": {**_QWEN3_NEXT, "family": "qwen3_5_moe_text"},
    # gpt-oss-shaped: sinks, a bias on every linear and the router, alternating sliding
    # windows, gpt-oss's clamped GLU; 8 experts of 128 (vLLM's swigluoai experts want I/TP a
    # multiple of 32)
    "gpt-oss": dict(family="gpt_oss", num_layers=4, hidden_size=64, num_attention_heads=8,
                    num_query_groups=4, head_dim=16, ffn_hidden_size=128, num_moe_experts=8,
                    moe_ffn_hidden_size=128, vocab_size=500, softmax_type="learnable",
                    add_bias_linear=True, window_size=(15, 0), window_attn_skip_freq=2,
                    gpt_oss_activation=True),
}

# What each preset is, for the demo's --help and error messages (one entry per preset: a
# test holds the two dicts to the same keys)
MODEL_ABOUT: dict[str, str] = {
    "moe": "Qwen3-MoE-shaped, 8 experts, GQA",
    "dense": "Qwen3-shaped, GQA",
    "qwen2": "Qwen2-shaped, GQA, q/k/v biases",
    "deepseek": "DeepSeek-V3-shaped: MLA, 8 experts + a shared one, first layer dense",
    "glm": "GLM-4.5-shaped: GQA with q/k/v biases, 8 experts + a shared one, first layer dense",
    "qwen3-next": "Qwen3-Next-shaped: Gated-DeltaNet in 3 of 4 layers, gated attention, "
                  "8 experts + a gated shared one",
    "qwen3.5": "Qwen3.5-MoE-shaped: Qwen3-Next's layers, the in_proj streams named apart",
    "gpt-oss": "gpt-oss-shaped: sinks, biases, sliding windows, 8 experts",
}


def describe_models() -> str:
    """The presets and what each is, one clause per preset (``--model``'s help)."""
    return "; ".join(f"{name} ({MODEL_ABOUT[name]})" for name in MODEL_PRESETS)


# --gen-precision fp8: the preset's dims made whole 128x128 blocks per TP shard (head_dim
# 128, hidden 256, FFN 512 / experts 256), as vLLM's block-FP8 layers require; for MLA
# (deepseek) the q/kv up-projections' rows per head 128 + 64, v 64 per head, q LoRA rank 128
# (vLLM fuses q_a above kv_a in one block-FP8 tensor), the shared expert 256 (keys a preset
# lacks are not added)
FP8_MODEL_OVERRIDES: dict[str, Any] = dict(hidden_size=256, num_attention_heads=4,
                                           num_query_groups=2, head_dim=128, ffn_hidden_size=512,
                                           moe_ffn_hidden_size=256, num_moe_experts=4,
                                           num_layers=2, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                           v_head_dim=64, q_lora_rank=128,
                                           moe_shared_expert_intermediate_size=256)
GEN_PRECISIONS = ("bf16", "fp8", "fp8_online", "mxfp8")


def model_preset(cfg: "RefitRunConfig") -> dict[str, Any]:
    """The model's spec values (family included) for this run."""
    preset = dict(MODEL_PRESETS[cfg.model])
    if cfg.gen_precision in ("fp8", "fp8_online", "mxfp8"):
        preset.update({k: v for k, v in FP8_MODEL_OVERRIDES.items()
                       if k in preset or k == "head_dim"})
    preset.update(cfg.model_overrides)
    freq = preset.get("moe_layer_freq")
    if isinstance(freq, list) and len(freq) != preset["num_layers"]:
        # a per-layer pattern follows the layer count (FP8's 2 layers, an override): the
        # preset's first-k dense layers, then MoE layers (Megatron wants one entry per layer)
        dense_first = min(freq.index(1) if 1 in freq else len(freq), preset["num_layers"])
        preset["moe_layer_freq"] = [0] * dense_first + [1] * (preset["num_layers"] - dense_first)
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
    # expert TP for initialize_model_parallel: None leaves Megatron's default (the TP size),
    # which a dense model takes as it is; a model with experts needs 1 (expert TP is refused)
    train_etp: Optional[int] = 1
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

    gen_precision: str = "bf16"  # "fp8": block-FP8 generation model (fp8.plan); "mxfp8"
    # "fp8_blockwise": linear weights held in blockwise FP8 for training (testing.fp8_training,
    # the CPU stand-in for TE fp8_param); needs gen_precision "fp8"
    train_precision: str = "bf16"
    # how the refit groups move bytes (engine.refit_transport): None = the default ("p2p"),
    # "colocated" = copies out of the training ranks' mapped memory (gloo only)
    transport: Optional[str] = None
    # the senders' RefitSender(delta=...): False, True or a delta.DeltaConfig (stdlib
    # here: any value the sender takes); "adam": between refits the training model takes
    # Adam steps over FP32 master weights (testing.optimizer_steps), "perturb": every
    # weight changes (tools.e2e.perturb_)
    delta: Any = False
    update: str = "perturb"
    # before each weight change the training ranks move their params to new memory
    # (testing.moves: "apply", "data", "data_rank0"); None: they stay where they are
    move: Optional[str] = None

    @property
    def gen_quant(self):
        return {"fp8": "block_fp8", "fp8_online": "block_fp8_online",
                "mxfp8": "mxfp8"}.get(self.gen_precision)

    @property
    def gen_storage(self):
        """The generation model's storage format (None: the training dtype): online block
        FP8 holds block FP8, quantized on the receiver."""
        return "block_fp8" if self.gen_quant == "block_fp8_online" else self.gen_quant

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
    if cfg.transport not in (None, "p2p", "colocated"):
        out.append(f"transport {cfg.transport!r}: expected p2p or colocated")
    elif cfg.transport == "colocated" and cfg.backend != "gloo":
        out.append(f"transport colocated: expected --backend gloo (its control group), "
                   f"found --backend {cfg.backend}")
    if cfg.device not in ("cpu", "cuda"):
        out.append(f"--device {cfg.device!r}: expected cpu or cuda")
    elif cfg.backend == "nccl" and cfg.device != "cuda":
        out.append(f"--backend nccl: expected --device cuda, found --device {cfg.device}")
    elif cfg.backend == "gloo" and cfg.device == "cuda" and cfg.transport != "colocated":
        # gloo moves CPU tensors only; the engine would refuse every param at the first batch
        out.append("--backend gloo: expected --device cpu (gloo moves CPU tensors; CUDA "
                   "tensors go over --backend nccl, or the colocated transport), found "
                   "--device cuda")
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
    from megatron_reshard.megatron.gen_split import gen_tp_problem
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

    # Qwen3-Next: both sides split Gated-DeltaNet by whole key-head groups
    linear_heads = m.get("linear_num_key_heads") if m.get("experimental_attention_variant") else None

    def tp_common(t: int) -> Optional[str]:
        if heads % t:
            return f"does not divide its {heads} attention heads"
        if linear_heads and linear_heads % t:
            return f"does not divide its {linear_heads} Gated-DeltaNet key heads"
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
        attention = gen_tp_problem(t, heads, heads if mla_down else kv, linear_heads or 0)
        if attention is not None:  # the library's own check (MegatronRefitSource runs it)
            return f"does not split its attention: {attention}"
        if experts and cfg.gen_ep == 1 and expert_ffn % t:
            return (f"does not divide its expert FFN size {expert_ffn} (with --gen-ep 1 every "
                    "rank holds a TP slice of every expert)")
        if vocab_rows % t:
            return (f"does not divide its {vocab_rows} vocab rows (vocab {m['vocab_size']} "
                    "padded as vLLM pads it)")
        if cfg.gen_storage == "block_fp8":  # MXFP8 cuts are refused by fp8.plan.plan_mxfp8
            return tp_common(t) or fp8_blocks(t)
        return tp_common(t)

    def fp8_blocks(t: int) -> Optional[str]:
        """vLLM's block-FP8 layers hold whole 128-row/column blocks on every TP rank."""
        head_dim = m.get("head_dim") or m["hidden_size"] // heads
        if mla_down:  # MLA: q/kv up-projection rows and o_proj columns per rank
            qk = m["qk_head_dim"] + m["qk_pos_emb_head_dim"]
            sizes = {"q up-projection rows per rank": heads * qk // t,
                     "kv up-projection rows per rank": heads * (m["qk_head_dim"] + m["v_head_dim"]) // t,
                     "o_proj columns per rank": heads * m["v_head_dim"] // t}
        else:
            sizes = {"attention rows per rank": heads * head_dim // t,
                     "KV rows per rank": max(1, kv // t) * head_dim}
        if ffn:
            sizes["FFN rows per rank"] = ffn // t
        if shared:
            sizes["shared-expert FFN rows per rank"] = shared // t
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
            expected = (valid[0] if len(valid) == 1 else "one of " + ", ".join(valid) if valid
                        else "a size, but none of 1..128 fits")
            out.append(f"{option} {size}: expected {expected} for the {cfg.model} model; "
                       f"{size} {why}")
    m = model_preset(cfg)
    q_lora = m.get("q_lora_rank") if m.get("multi_latent_attention") else None
    if cfg.gen_storage == "block_fp8" and q_lora and q_lora % 128:
        out.append(f"--gen-precision fp8: expected a q_lora_rank that is a multiple of 128 for "
                   f"the {cfg.model} model (vLLM's fused_qkv_a_proj holds q_a's rows above "
                   f"kv_a's, in whole 128-row FP8 blocks); found {q_lora}")
    return out


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
                          train_precision=getattr(args, "train_precision", "bf16"),
                          delta=getattr(args, "delta", False),
                          update=getattr(args, "update", "perturb"))


def add_run_arguments(parser) -> None:
    """Options shared by the demo and the torchrun launcher (each help states its default)."""
    d = RefitRunConfig()
    ep_defaults = ", ".join(f"{default_train_ep(m)} for {m}" for m in sorted(MODEL_PRESETS))
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default=d.model,
                        help=f"tiny model: {describe_models()} (default: %(default)s)")
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
                             "sending side where a shard owns whole blocks, else on the receiver), "
                             "fp8_online (the same storage, as vLLM's --quantization "
                             "fp8_per_block holds it: BF16 sent, quantized by vLLM's own "
                             "function on the receiver) "
                             "or mxfp8 (e4m3 + E8M0 scale per 32 elements, quantized on the "
                             "receiver); with fp8/mxfp8 the model dims become multiples of 128 "
                             "(default: %(default)s)")
    parser.add_argument("--train-precision", choices=["bf16", "fp8_blockwise"],
                        default=d.train_precision,
                        help="fp8_blockwise: linear weights held in blockwise FP8 on the training "
                             "side (a plain-tensor stand-in for Megatron fp8_param with TE's "
                             "blockwise recipe); their bytes and scales move as they are; needs "
                             "--gen-precision fp8 (default: %(default)s)")
    parser.add_argument("--delta", action="store_true",
                        help="RefitSender(delta=True): from the second committed refit on, send "
                             "only the changed elements (experimental, process-group path)")
    parser.add_argument("--update", choices=["perturb", "adam"], default=d.update,
                        help="between refits: perturb every weight, or take Adam steps over "
                             "FP32 master weights (few BF16 bits change, as in RL) "
                             "(default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s,
                        help="seconds every process group and store waits before failing "
                             "(default: %(default)s)")


__all__ = ["FP8_MODEL_OVERRIDES", "GEN_PRECISIONS", "MODEL_PRESETS", "RefitRunConfig",
           "add_run_arguments", "config_from_args", "default_train_ep", "model_preset"]
