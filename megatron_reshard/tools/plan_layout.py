"""The plan tool's layouts on paper, without torch: training and generation parallel sizes,
their checks against a model, and Megatron's split of layers over PP stages.

Kept free of torch (and of the engine) so that ``megatron-reshard plan`` refuses a bad
option in the time it takes to parse it; ``plan_inputs`` turns a checked layout into
engine layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .presets import attention_heads, is_moe_layer, num_experts

# The most ranks per side the simulator plans: its tables grow with ranks × params, and
# 2,048 ranks (DeepSeek-V3 shapes) is what docs/SCALE.md measured; beyond it a job of 100,000
# ranks was killed by the kernel at 24 GB before printing anything.
MAX_RANKS_PER_SIDE = 2048
# The most layers it plans: the largest published models have 126 (Llama-3.1-405B); the
# parameter list grows with layers × experts (Kimi-K2: 1,152 expert tensors a layer)
MAX_LAYERS = 1024
# vLLM pads its embedding and LM head rows to a multiple of this
# (``vllm_layout.dense.padded_vocab_rows``, which imports torch; a test keeps the two equal)
VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True)
class RefitParallelism:
    """Training and generation parallel sizes (ETP 1; generation PP 1)."""

    train_world: int
    gen_world: int
    train_tp: int = 1
    train_cp: int = 1
    train_ep: int = 1
    train_pp: int = 1
    pp_layers: Optional[tuple] = None  # layers per training PP stage; None: even split
    gen_tp: int = 1
    gen_ep: int = 1

    @property
    def stage_world(self) -> int:
        return self.train_world // self.train_pp

    @property
    def train_dp(self) -> int:
        return self.stage_world // (self.train_tp * self.train_cp)

    @property
    def gen_dp(self) -> int:
        return self.gen_world // self.gen_tp

    def describe(self, has_experts: bool = True) -> str:
        """One line; ``has_experts`` False leaves out the expert sizes a dense model lacks."""
        pp = f"PP{self.train_pp}" + (f" (layers {','.join(map(str, self.pp_layers))})"
                                     if self.pp_layers else "")
        train_ep = (f" EP{self.train_ep}" if has_experts else "")
        expert_dp = (f" (expert DP {self.stage_world // self.train_ep})" if has_experts else "")
        gen_ep = f" EP{self.gen_ep}" if has_experts else ""
        return (f"train {self.train_world} ranks: TP{self.train_tp} CP{self.train_cp} {pp}"
                f"{train_ep} DP{self.train_dp}{expert_dp} -> gen {self.gen_world} ranks: "
                f"TP{self.gen_tp}{gen_ep} DP{self.gen_dp}")

    def to_plain(self) -> dict:
        return {"train": {"world": self.train_world, "tp": self.train_tp, "cp": self.train_cp,
                          "ep": self.train_ep, "pp": self.train_pp, "dp": self.train_dp,
                          "pp_layers": list(self.stage_layers_counts())},
                "gen": {"world": self.gen_world, "tp": self.gen_tp, "ep": self.gen_ep,
                        "dp": self.gen_dp}}

    def stage_layers_counts(self) -> tuple:
        return tuple(self.pp_layers) if self.pp_layers else ()


def megatron_pp_split(layers: int, pp: int) -> tuple[tuple[int, ...], dict[str, int]]:
    """(layers per stage, the Megatron settings that give them) for ``layers`` over ``pp``
    stages, as megatron-core 0.16.1 can build it.

    Megatron splits evenly when ``pp`` divides the layers (no setting). Otherwise it needs
    ``num_layers_in_first_pipeline_stage`` and/or ``num_layers_in_last_pipeline_stage``,
    and the stages between them all take the same count
    (``TransformerConfig.__post_init__``, ``get_num_layers_to_build``). Of the splits it
    accepts, this one has the fewest layers on the busiest stage; then the fewest settings,
    the last stage before the first (it also holds the LM head and the loss); then first
    and last closest to each other. DeepSeek-V3's 61 layers over PP16: 4 × 15 then 1
    (``num_layers_in_last_pipeline_stage=1``). ``layers < pp``: ``((), {})`` (no split).
    """
    if layers < pp:
        return (), {}
    if layers % pp == 0:
        return (layers // pp,) * pp, {}
    best = None
    for first, last in _first_last_candidates(layers, pp):
        counts = _uneven_split(layers, pp, first, last)
        if counts is None:
            continue
        rank = (max(counts), (first is not None) + (last is not None), first is not None,
                abs((first or 0) - (last or 0)), last or 0)
        if best is None or rank < best[0]:
            best = (rank, counts, first, last)
    _, counts, first, last = best  # never None: the last stage can always take the rest
    settings = {k: v for k, v in (("num_layers_in_first_pipeline_stage", first),
                                  ("num_layers_in_last_pipeline_stage", last)) if v is not None}
    return counts, settings


def _first_last_candidates(layers: int, pp: int):
    """(first, last) settings worth trying: for every middle-stage count, the first or last
    stage alone taking the rest, or both sharing it as evenly as possible (O(layers))."""
    for each in range(0, layers + 1):
        rest = layers - (pp - 1) * each
        if rest >= 1:
            yield None, rest
            yield rest, None
        rest = layers - (pp - 2) * each
        if rest >= 2 and pp >= 2:
            yield rest - rest // 2, rest // 2


def _uneven_split(layers: int, pp: int, first: Optional[int], last: Optional[int]
                  ) -> Optional[tuple[int, ...]]:
    """Megatron's stage counts with these first/last settings, or None where it refuses them."""
    middle_layers, middle_stages = layers, pp
    for n in (first, last):
        if n is not None:
            middle_layers -= n
            middle_stages -= 1
    if middle_stages < 0 or middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        return None
    if middle_stages and middle_layers % middle_stages:
        return None
    each = middle_layers // middle_stages if middle_stages else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def parallelism_problems(lay: RefitParallelism, cfg: Mapping[str, Any]) -> list[str]:
    """Why the model cannot be refitted with these parallel sizes, one line per option (empty: it can)."""
    sizes = {"--train-world": lay.train_world, "--gen-world": lay.gen_world,
             "--train-tp": lay.train_tp, "--train-cp": lay.train_cp, "--train-ep": lay.train_ep,
             "--train-pp": lay.train_pp, "--gen-tp": lay.gen_tp, "--gen-ep": lay.gen_ep}
    out = [f"{opt} {v}: expected an integer >= 1" for opt, v in sizes.items()
           if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if out:
        return out
    for opt, world in (("--train-world", lay.train_world), ("--gen-world", lay.gen_world)):
        if world > MAX_RANKS_PER_SIDE:
            out.append(f"{opt} {world}: expected at most {MAX_RANKS_PER_SIDE} ranks (the most "
                       "ranks per side the simulator plans)")
    if out:
        return out
    nh, nkv = attention_heads(cfg)
    layers, E = int(cfg["num_hidden_layers"]), num_experts(cfg)
    dense_ffn = int(cfg["intermediate_size"]) if any(
        not is_moe_layer(cfg, i) for i in range(layers)) else None
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg.get("moe_intermediate_size") or 0)
    per = lay.train_tp * lay.train_cp * lay.train_pp
    if lay.train_world % per:
        out.append(f"--train-world {lay.train_world}: expected a multiple of TP×CP×PP = {per}")
    elif lay.stage_world % lay.train_ep:
        out.append(f"--train-ep {lay.train_ep}: expected a divisor of the {lay.stage_world} "
                   "training ranks per PP stage (expert TP is 1)")
    if lay.gen_world % lay.gen_tp:
        out.append(f"--gen-world {lay.gen_world}: expected a multiple of --gen-tp {lay.gen_tp}")
    if lay.gen_world % lay.gen_ep:
        out.append(f"--gen-ep {lay.gen_ep}: expected a divisor of --gen-world {lay.gen_world}")
    for opt, ep in (("--train-ep", lay.train_ep), ("--gen-ep", lay.gen_ep)):
        if not E and ep != 1:
            out.append(f"{opt} {ep}: expected 1, the model has no experts")
        elif E and opt == "--train-ep" and E % ep:
            out.append(f"{opt} {ep}: expected a divisor of the model's {E} experts")
        elif E and ep > E:  # vLLM: uneven blocks, the first E % ep ranks one expert more
            out.append(f"{opt} {ep}: expected at most the model's {E} experts")
    for opt, t in (("--train-tp", lay.train_tp), ("--gen-tp", lay.gen_tp)):
        if nh % t:
            out.append(f"{opt} {t}: expected a divisor of the {nh} attention heads")
        elif nkv % t if t <= nkv else t % nkv:
            out.append(f"{opt} {t}: expected a divisor or a multiple of the {nkv} KV heads")
        for what, n in (("dense FFN size", dense_ffn), ("shared-expert FFN size", shared)):
            if n and n % t:
                out.append(f"{opt} {t}: expected a divisor of the {what} {n}")
    if E and lay.gen_ep == 1 and int(cfg["moe_intermediate_size"]) % lay.gen_tp:
        out.append(f"--gen-tp {lay.gen_tp}: expected a divisor of the expert FFN size "
                   f"{cfg['moe_intermediate_size']} (with --gen-ep 1 each rank holds a TP slice "
                   "of every expert)")
    vocab_rows = -(-int(cfg["vocab_size"]) // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if vocab_rows % lay.gen_tp:
        out.append(f"--gen-tp {lay.gen_tp}: expected a divisor of the {vocab_rows} vocab rows "
                   f"(padded to a multiple of {VLLM_VOCAB_PADDING} as vLLM pads them)")
    if lay.pp_layers is not None:
        counts = list(lay.pp_layers)
        if len(counts) != lay.train_pp or any(c < 1 for c in counts) or sum(counts) != layers:
            out.append(f"--train-pp-layers {','.join(map(str, counts))}: expected {lay.train_pp} "
                       f"counts >= 1 (one per PP stage) adding up to the {layers} layers")
    elif layers < lay.train_pp:  # any other count has a Megatron split (a last stage of the rest)
        out.append(f"--train-pp {lay.train_pp}: expected at most the {layers} layers "
                   "(every stage holds at least one)")
    return out


def stage_layer_counts(lay: RefitParallelism, layers: int) -> tuple[int, ...]:
    """Layers per training PP stage: the given counts, else Megatron's split."""
    return tuple(lay.pp_layers) if lay.pp_layers else megatron_pp_split(layers, lay.train_pp)[0]


__all__ = ["MAX_LAYERS", "MAX_RANKS_PER_SIDE", "RefitParallelism", "megatron_pp_split", "parallelism_problems",
           "stage_layer_counts"]
