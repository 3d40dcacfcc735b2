"""``megatron-reshard plan``: show what a refit would move, computed from layouts alone.

Builds the refit info of a model preset for a training/generation layout (no Megatron, no
communication: HF shapes come from the model's dimensions), plans every bulk param with
the engine's planner and prints, per training PP stage, the bytes each training rank sends
to each generation rank, local copies, replica completion, and the plan fingerprint.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from megatron_reshard.e2e import MODEL_PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS) + ["qwen3-30b-a3b", "qwen3-8b"],
                        default="moe", help="model dimensions (presets of the demo, or full-size "
                                            "Qwen3 shapes)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    for side, tp, pp, ep, world in (("train", 2, 2, 2, 4), ("gen", 2, 1, 1, 2)):
        parser.add_argument(f"--{side}-world", type=int, default=world)
        parser.add_argument(f"--{side}-tp", type=int, default=tp)
        parser.add_argument(f"--{side}-ep", type=int, default=ep)
        if side == "train":
            parser.add_argument("--train-pp", type=int, default=pp)
    parser.add_argument("--verbose", action="store_true", help="one line per param")


_FULL_SIZE = {
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_hidden_layers=48, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, num_hidden_layers=36,
                     vocab_size=151936),
}


def hf_config_for(model: str, layers=None) -> dict:
    """HF-style config of a preset (the keys the receiver and the shape helpers read)."""
    if model in _FULL_SIZE:
        cfg = dict(_FULL_SIZE[model], qk_norm=True, gated=True, tie_word_embeddings=False)
    else:
        p = MODEL_PRESETS[model]
        cfg = dict(hidden_size=p["hidden_size"], num_attention_heads=p["num_attention_heads"],
                   num_key_value_heads=p["num_query_groups"],
                   head_dim=p["hidden_size"] // p["num_attention_heads"],
                   intermediate_size=p["ffn_hidden_size"],
                   moe_intermediate_size=p.get("moe_ffn_hidden_size"),
                   num_experts=p.get("num_moe_experts") or 0, num_hidden_layers=p["num_layers"],
                   vocab_size=p["vocab_size"], qk_norm=p.get("qk_layernorm", False), gated=True,
                   tie_word_embeddings=False)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def _stage_map(names, layers: int, pp: int) -> dict:
    from megatron_reshard.metadata import _extract_layer_name

    per = -(-layers // pp)
    out = {}
    for name in names:
        key = _extract_layer_name(name)
        if ".layers." in f".{key}.":
            out[key] = min(int(key.rsplit(".", 1)[1]) // per, pp - 1)
        else:
            out[key] = 0 if "embed" in key else pp - 1
    return out


def run(args: argparse.Namespace) -> int:
    from megatron_reshard.engine import Planner, layout_key
    from megatron_reshard.engine.geometry import box_numel
    from megatron_reshard.layout import is_nccl_reshard_param
    from megatron_reshard.metadata import _STR_TO_DTYPE, build_nccl_reshard_refit_info
    from megatron_reshard.testing.vllm_like import hf_param_shapes

    cfg = hf_config_for(args.model, args.layers)
    shapes = hf_param_shapes(cfg)
    meta = {n: {"shape": list(s), "dtype": "torch.bfloat16"} for n, s in shapes.items()
            if is_nccl_reshard_param(n)}
    info = build_nccl_reshard_refit_info(
        meta, {"tp_size": args.train_tp, "ep_size": args.train_ep, "pp_size": args.train_pp},
        {"tp_size": args.gen_tp, "ep_size": args.gen_ep, "pp_size": 1},
        args.train_world, args.gen_world,
        _stage_map(meta, cfg["num_hidden_layers"], args.train_pp) if args.train_pp > 1 else None)
    stage_world = args.train_world // args.train_pp
    planner = Planner()
    t0 = time.perf_counter()
    moved = defaultdict(lambda: defaultdict(int))  # stage -> (src, dst, phase) -> bytes
    count = 0
    for layer in info["layer_names"]:
        for p in info["per_layer_params"][layer]:
            key = layout_key(p["global_shape"], p["src_mesh_info"], p["src_placements"],
                             p["dst_mesh_info"], p["dst_placements"], p["name"])
            plan = planner.plan(key)
            itemsize = _STR_TO_DTYPE[p["dtype"]].itemsize
            stage = p.get("pp_stage", 0)
            for op in plan.ops:
                moved[stage][(op.src, op.dst, op.phase)] += box_numel(op.box) * itemsize
            count += 1
            if args.verbose:
                print(f"{p['name']}: {list(p['global_shape'])} {p['src_placements']} -> "
                      f"{p['dst_placements']}: {len(plan.ops)} ops, fingerprint {plan.fingerprint[:12]}")
    elapsed = time.perf_counter() - t0
    print(f"{count} bulk params planned in {elapsed * 1e3:.1f} ms "
          f"({len(planner)} distinct layouts); training ranks 0..{stage_world - 1} of each "
          f"stage's refit group send, generation ranks {stage_world}..{stage_world + args.gen_world - 1} receive")
    for stage in sorted(moved):
        print(f"\nstage {stage}: MiB moved (rows: sender group rank, columns: receiver)")
        ranks = range(stage_world + args.gen_world)
        print("| from \\ to | " + " | ".join(str(r) for r in ranks) + " |")
        print("|---" * (len(ranks) + 1) + "|")
        for s in ranks:
            cells = [sum(b for (a, d, _), b in moved[stage].items() if a == s and d == r) / 2**20
                     for r in ranks]
            if any(cells):
                print(f"| {s} | " + " | ".join(f"{c:.2f}" if c else "." for c in cells) + " |")
        local = sum(b for (a, d, _), b in moved[stage].items() if a == d) / 2**20
        replica = sum(b for (_, _, ph), b in moved[stage].items() if ph == 1) / 2**20
        print(f"local copies: {local:.2f} MiB; replica completion inside generation groups: "
              f"{replica:.2f} MiB")
    return 0
