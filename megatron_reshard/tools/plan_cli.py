"""``megatron-reshard plan``: what a refit would move and how long it would take, computed
from layouts alone (no GPU, no communication, no Megatron model).

Takes a model preset (the demo's small models, or full-size Qwen3-8B, Qwen3-30B-A3B,
Qwen3-235B-A22B, Qwen3-Next-80B-A3B, DeepSeek-V3, Kimi-K2, GLM-4.5(-Air), gpt-oss-20b/120b,
Llama-3.1 8B/70B/405B shapes from their HF configs)
or any model's HF config.json (--hf-config: hidden size, layers, heads, experts... as the
file states them), and a training layout (TP, CP, EP, PP; DP from the world size) ->
generation layout (TP, EP, DP replicas). Any size not given comes from the model's default
layout (listed at the end of --help: for the full-size presets the layout their RL users
run); a world not given is the default's, or the smallest that fits the sizes given. PP
that does not divide the layers is split as Megatron splits it (equal middle stages, the
rest on the last and/or first stage: num_layers_in_{first,last}_pipeline_stage), or as
--train-pp-layers says. It plans every parameter with the engine's planner and prints:

- the layout used and every parameter the refit moves, all shard to shard through the
  engine as the refit moves them (FFN/expert weights and the others: attention, norms,
  router, embeddings); --others broadcast models the packed-broadcast option instead;
- planning time for one rank's own plan and for the whole job;
- bytes each training rank sends and each generation rank receives (min / mean / max),
  and how far the busiest rank is above the ideal (total over ranks);
- an estimated refit time under a link model (stated with the result) for the planner the
  refit uses today and for the link-aware planner, beside gather + broadcast;
- the plan fingerprint: a digest of every engine plan in payload order (equal on every
  rank; two runs with equal fingerprints move the same boxes between the same ranks).

--json prints all of it as one object; --plot FILE draws the per-rank bytes (needs the
optional extra `plot`: pip install 'megatron-reshard[plot]'). Assumptions: docs/SCALE.md.
Exit status: 0, or 2 for a layout the model cannot be split by (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Optional

from megatron_reshard.tools.presets import (default_plan_parallelism, describe_plan_parallelism,
                                            model_config, model_names, num_experts)

DEFAULT_LINK = dict(gpus_per_node=8, nvlink_gbps=450.0, net_gbps=50.0, latency_us=5.0)


PARALLELISM_OPTIONS = ("train_world", "train_tp", "train_cp", "train_ep", "train_pp", "gen_world",
                  "gen_tp", "gen_ep")


def defaults_epilog() -> str:
    """The per-model default layouts, as --help lists them."""
    lines = ["default layout per model (any layout option given replaces its part):"]
    for name in model_names():
        sizes = default_plan_parallelism(model_config(name), name)
        lines.append(f"  {name:16} {describe_plan_parallelism(sizes)}")
    lines.append(f"  {'a config file':16} {describe_plan_parallelism(default_plan_parallelism({'num_experts': 1}))}"
                 " (EP1 without experts)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = defaults_epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", choices=model_names(), default="moe",
                        help="model shapes: the demo's small models or a full-size preset")
    parser.add_argument("--hf-config", default=None, metavar="FILE",
                        help="any model's shapes from its HF config.json instead of --model "
                             "(hidden_size, num_hidden_layers, num_attention_heads, "
                             "num_key_value_heads, head_dim, intermediate_size, vocab_size, "
                             "experts and MLA keys as DeepSeek/Qwen configs name them; "
                             "default: none)")
    parser.add_argument("--layers", type=int, default=None,
                        help="override the model's layer count (default: the model's own)")
    per_model = "default: the model's, listed below"
    for side in ("train", "gen"):
        parser.add_argument(f"--{side}-world", type=int, default=None, help=per_model)
        parser.add_argument(f"--{side}-tp", type=int, default=None, help=per_model)
        parser.add_argument(f"--{side}-ep", type=int, default=None, help=per_model)
        if side == "train":
            parser.add_argument("--train-pp", type=int, default=None,
                                help=f"{per_model}; with --train-pp-layers: its stage count")
            parser.add_argument("--train-cp", type=int, default=None,
                                help="context parallel size (CP ranks hold the same weights; "
                                     f"{per_model})")
            parser.add_argument("--train-pp-layers", default=None, metavar="N,N,...",
                                help="uneven PP: layers per stage, first to last (default: "
                                     "an even split)")
    parser.add_argument("--others", choices=["broadcast", "sharded"], default="sharded",
                        help="how the params other than FFN/experts move: 'sharded' shard to "
                             "shard through the engine with Megatron/vLLM placements, as the "
                             "refit moves them; 'broadcast' as one packed broadcast per PP "
                             "stage, the refit's explicit packed option "
                             "(default: %(default)s)")
    parser.add_argument("--wire", choices=["bf16", "fp8"], default="bf16",
                        help="dtype on the wire: 'fp8' counts every linear weight as block FP8 "
                             "(128x128 blocks, fp32 scales), as the refit sends them to a "
                             "block-FP8 generation model (gen_quant='block_fp8': quantized "
                             "by the training rank where its shard holds whole blocks; a "
                             "weight whose shards cut blocks travels in BF16 and the "
                             "generation rank quantizes it, so this is the lower bound)")
    parser.add_argument("--planner", choices=["both", "default", "link-aware"], default="both",
                        help="which planner's figures to show: the refit's default planner, "
                             "the link-aware one, or both side by side")
    parser.add_argument("--changed", type=float, default=None, metavar="FRACTION",
                        help="estimate a delta refit (RefitSender(delta=...)) where this "
                             "fraction of the elements changed since the last refit (0.01: "
                             "1%%; at RL learning rates 1-2%% per step, docs/MEASUREMENTS.md); "
                             "default: a full refit")
    link = parser.add_argument_group("link model (defaults: H100 nodes, NVLink 4, one 400 Gb/s NIC per GPU)")
    link.add_argument("--gpus-per-node", type=int, default=DEFAULT_LINK["gpus_per_node"],
                      help="GPUs per node, joined by NVLink")
    link.add_argument("--nvlink-gbps", type=float, default=DEFAULT_LINK["nvlink_gbps"],
                      help="NVLink GB/s per GPU per direction")
    link.add_argument("--net-gbps", type=float, default=DEFAULT_LINK["net_gbps"],
                      help="network GB/s per GPU per direction between nodes")
    link.add_argument("--latency-us", type=float, default=DEFAULT_LINK["latency_us"],
                      help="fixed cost of one message, in microseconds")
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="write a PNG of the bytes per rank (needs matplotlib: the 'plot' extra; "
                             "default: no plot)")
    parser.add_argument("--matrix", action="store_true",
                        help="print the MiB each rank pair moves per stage (bulk params; shown "
                             "anyway for groups of at most 16 ranks)")
    parser.add_argument("--verbose", action="store_true", help="one line per bulk param")


def _fail(problems: list) -> int:
    print("megatron-reshard plan: error: " + "; ".join(problems), file=sys.stderr)
    return 2


def _parse_layers(text: Optional[str]) -> tuple[Optional[tuple], list]:
    if text is None:
        return None, []
    try:
        return tuple(int(x) for x in text.split(",")), []
    except ValueError:
        return None, [f"--train-pp-layers {text!r}: expected comma-separated integers, one per stage"]


def problems_of(args: argparse.Namespace):
    """(model config, parallel sizes, problems) for the parsed options; nothing is planned
    yet, and nothing here imports torch (plan_layout), so a bad option ends the command at
    once. A value the user did not type is named as the default or derived one it is."""
    from megatron_reshard.tools.plan_layout import (MAX_LAYERS, RefitParallelism,
                                                    megatron_pp_split, parallelism_problems)

    pp_layers, out = _parse_layers(args.train_pp_layers)
    if args.layers is not None and args.layers < 1:
        out.append(f"--layers {args.layers}: expected an integer >= 1")
    if args.gpus_per_node < 1:
        out.append(f"--gpus-per-node {args.gpus_per_node}: expected an integer >= 1")
    for option, value in (("--nvlink-gbps", args.nvlink_gbps), ("--net-gbps", args.net_gbps)):
        if not value > 0:
            out.append(f"{option} {value}: expected a number > 0")
    if not args.latency_us >= 0:
        out.append(f"--latency-us {args.latency_us}: expected a number >= 0")
    changed = getattr(args, "changed", None)
    if changed is not None and not 0 <= changed <= 1:
        out.append(f"--changed {changed}: expected a fraction between 0 and 1 (0.01 for 1%)")
    cfg = _model_of(args, out)
    if cfg and int(cfg["num_hidden_layers"]) > MAX_LAYERS:
        where = "--layers" if args.layers is not None else "the model's num_hidden_layers"
        out.append(f"{where} {cfg['num_hidden_layers']}: expected at most {MAX_LAYERS} layers "
                   "(the most the simulator plans)")
    if out:
        return None, None, out
    sizes, origin = parallelism_options(args, cfg, pp_layers)
    if pp_layers is None and sizes["train_pp"] >= 1:
        counts, _ = megatron_pp_split(int(cfg["num_hidden_layers"]), sizes["train_pp"])
        if counts and len(set(counts)) > 1:  # uneven: the stages are part of the layout shown
            pp_layers = counts
    lay = RefitParallelism(pp_layers=pp_layers, **sizes)
    return cfg, lay, [_say_where_from(p, origin) for p in parallelism_problems(lay, cfg)]


def _model_of(args: argparse.Namespace, out: list) -> dict:
    """The model's shape config: the preset, or the HF config file (problems added to ``out``)."""
    if args.hf_config is None:
        return model_config(args.model, args.layers)
    from megatron_reshard.tools.presets import config_from_hf_json

    try:
        with open(args.hf_config, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        out.append(f"--hf-config {args.hf_config}: cannot be read ({err.strerror})")
        return {}
    cfg, problems = config_from_hf_json(text, f"--hf-config {args.hf_config}")
    out += problems
    if cfg and args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    return cfg


def model_label(args: argparse.Namespace) -> str:
    return args.hf_config if args.hf_config is not None else args.model


def parallelism_options(args: argparse.Namespace, cfg, pp_layers: Optional[tuple]
                        ) -> tuple[dict, dict]:
    """(sizes, where each size not typed came from). The sizes given on the command line,
    the model's default layout for the others; --train-pp-layers alone sets the stage
    count. A world not given keeps the default's when the sizes given fit in it, else it is
    the smallest that fits them (training: PP × lcm(TP×CP, EP); generation: lcm(TP, EP))."""
    import math

    model = "" if args.hf_config is not None else args.model
    chosen = default_plan_parallelism(cfg, model)
    origin = {k: "the model's default" for k in PARALLELISM_OPTIONS}
    if pp_layers is not None:
        chosen["train_pp"] = len(pp_layers)
        origin["train_pp"] = "the --train-pp-layers count"
    given = {k: getattr(args, k) for k in PARALLELISM_OPTIONS if getattr(args, k) is not None}
    sizes = {**chosen, **given}
    for k in given:
        origin.pop(k)
    if any(not isinstance(v, int) or v < 1 for v in sizes.values()):
        return sizes, origin  # parallelism_problems names them; nothing to derive from
    if "train_world" not in given:
        tp_cp = sizes["train_tp"] * sizes["train_cp"]
        per = sizes["train_pp"] * tp_cp
        w = sizes["train_world"]
        if w % per or (w // sizes["train_pp"]) % sizes["train_ep"]:
            sizes["train_world"] = sizes["train_pp"] * math.lcm(tp_cp, sizes["train_ep"])
            origin["train_world"] = "derived from the training sizes given"
    if "gen_world" not in given:
        w = sizes["gen_world"]
        if w % sizes["gen_tp"] or w % sizes["gen_ep"]:
            sizes["gen_world"] = math.lcm(sizes["gen_tp"], sizes["gen_ep"])
            origin["gen_world"] = "derived from the generation sizes given"
    return sizes, origin


def _say_where_from(problem: str, origin: dict) -> str:
    """A problem that quotes a size the user did not type says where that size came from."""
    import re

    head, sep, body = problem.partition(":")
    for key, whence in origin.items():
        option = "--" + key.replace("_", "-")
        if head.split()[0] == option:
            head = f"{head} ({whence})"
        body = re.sub(rf"({re.escape(option)} \d+)(?![\d(])", rf"\1 ({whence})", body)
    return head + sep + body


def run(args: argparse.Namespace) -> int:
    cfg, lay, problems = problems_of(args)
    if problems:
        return _fail(problems)
    from megatron_reshard.tools.simulate import LinkModel, simulate  # torch: after the checks

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail([f"--plot {args.plot}: needs matplotlib (pip install 'megatron-reshard[plot]')"])
    link = LinkModel(args.gpus_per_node, args.nvlink_gbps, args.net_gbps, args.latency_us)
    which = {"both": (False, True), "default": (False,), "link-aware": (True,)}[args.planner]
    sims = [simulate(model_label(args), cfg, lay, link, args.others, aware, args.wire,
                     changed=args.changed) for aware in which]
    if args.json:
        print(json.dumps({"model": model_label(args),
                          "layout_text": lay.describe(bool(num_experts(cfg))),
                          "megatron_pp_settings": _pp_settings(cfg, lay),
                          "runs": [s.to_plain() for s in sims]}))
    else:
        _print_table(args, cfg, lay, sims)
        if args.matrix or lay.stage_world + lay.gen_world <= 16 or args.verbose:
            _print_matrix(args, cfg, lay)
    if args.plot:
        from megatron_reshard.tools.plot import plot_loads

        plot_loads(sims, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _print_packed(cfg, others: str, train_tp: int) -> None:
    """The family's params the refit always sends packed (Qwen3-Next's Gated-DeltaNet and
    gated q/k/v, gpt-oss's experts), and the exact-path share of bytes that leaves."""
    import math

    from megatron_reshard.tools.presets import hf_params, travels_packed
    from megatron_reshard.tools.simulate import describe_bytes as b

    params = hf_params(cfg)
    packed = [p for p in params if travels_packed(cfg, p.name, train_tp)]
    if others == "broadcast":
        return
    if not packed:
        print("every HF weight travels shard to shard: exact-path share of bytes 100.0%")
        return
    size = lambda ps: sum(math.prod(p.shape) * (4 if p.dtype == "torch.float32" else 2)  # noqa: E731
                          for p in ps)
    print(f"of these, {len(packed)} HF weights travel packed at this layout (full tensors "
          f"from each stage's first training rank: {b(size(packed))}); exact-path share of "
          f"bytes {100 * (1 - size(packed) / size(params)):.1f}%")


def _print_table(args, cfg, lay, sims) -> None:
    from megatron_reshard.tools.simulate import describe_bytes as b

    first = sims[0].to_plain()
    c = first["params"]
    total = c["bulk_bytes"] + c["other_bytes"]
    how = ("by packed broadcast from each stage's first training rank" if args.others == "broadcast"
           else "shard to shard through the engine too")
    experts = bool(num_experts(cfg))
    print(f"model {model_label(args)}: {cfg['num_hidden_layers']} layers, "
          f"{_count(c['elements'])} parameters ({b(total)} as sent)")
    settings = _pp_settings(cfg, lay)
    print(f"layout: {lay.describe(experts)}" + (
        " (Megatron: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")"
        if settings else ""))
    grouped = (f" (an MoE layer's experts as one tensor per projection; {c['hf_tensors']} HF "
               "weights)" if experts else "")
    ffn = "FFN/expert" if experts else "FFN"
    print(f"tensors the refit moves: {c['bulk_params'] + c['other_params']}{grouped} = "
          f"{c['bulk_params']} {ffn} params through the engine ({b(c['bulk_bytes'])}) + "
          f"{c['other_params']} others {how} ({b(c['other_bytes'])})"
          + (", linear weights as block FP8" if args.wire == "fp8" else ""))
    _print_packed(cfg, args.others, lay.train_tp)
    print(f"link model: {sims[0].link.describe()}")
    if args.changed is not None:
        print(f"a delta refit: {100 * args.changed:g}% of the elements changed (the engine's "
              f"regions as deltas: headers, the cheapest encoding, two messages per rank pair "
              f"per batch; busiest generation rank: "
              f"{max(s.to_plain()['busiest_gen_messages'] for s in sims)} messages)")
    for s in sims:
        p = s.to_plain()
        pl = p["planning_s"]
        print(f"planning ({p['planner']} planner): one rank's own plan {_secs(pl['one_rank'])}, "
              f"whole job {_secs(pl['whole_job'])} ({pl['distinct_layouts']} distinct layouts, "
              f"{pl['ops']} messages)")
    print()
    print("| planner | train rank sends min / mean / max | busiest above ideal | "
          "gen rank receives min / mean / max | busiest above ideal | of which from peers "
          "(mean) | refit estimate | busiest rank |")
    print("|---|---|---|---|---|---|---|---|")
    for s in sims:
        p = s.to_plain()
        t, g, peers, e = (p["train_sent_bytes"], p["gen_received_bytes"],
                          p["gen_received_from_peers_bytes"], p["estimate_s"])
        who = f"{e['busiest_rank'][0]} rank {e['busiest_rank'][1]}" if e["busiest_rank"] else "-"
        print(f"| {p['planner']} | {b(t['min'])} / {b(t['mean'])} / {b(t['max'])} | "
              f"{100 * t['above_ideal']:.1f}% | {b(g['min'])} / {b(g['mean'])} / {b(g['max'])} | "
              f"{100 * g['above_ideal']:.1f}% | {b(peers['mean'])} | {_secs(e['refit'])} | "
              f"{who}: {e['limited_by']} |")
    print("\nof which from peers: the part of what a generation rank receives that comes from "
          "other generation ranks: a region several of them hold (the same shard in every "
          "generation DP replica; KV heads or norms vLLM replicates over TP) can be read from "
          "the training side once and completed inside the generation group, as the planner "
          "chooses; the rest comes from training ranks.")
    e = first["estimate_s"]
    print(f"\ngather + broadcast estimate: {_secs(e['gather_broadcast'])} (gather on the "
          f"training ranks {_secs(e['gather'])}, then every generation rank receives the "
          f"whole model: {_secs(e['broadcast'])})")
    for s in sims:
        print(f"plan fingerprint ({'link-aware' if s.link_aware else 'default'} planner): "
              f"{s.fingerprint}")


def _pp_settings(cfg, lay) -> dict:
    """The Megatron options that give the stages in use (empty for an even split or stages
    given by hand that Megatron's options cannot express)."""
    from megatron_reshard.tools.plan_layout import megatron_pp_split

    counts, settings = megatron_pp_split(int(cfg["num_hidden_layers"]), lay.train_pp)
    if lay.pp_layers and tuple(lay.pp_layers) != counts:
        return {}
    return settings


def _secs(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    return f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} µs"


def _count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _print_matrix(args, cfg, lay) -> None:
    """Per stage, MiB per (sender, receiver) group-rank pair of the bulk params, as the
    default planner plans them; and the per-param lines with --verbose."""
    from megatron_reshard.layout.geometry import box_numel
    from megatron_reshard.engine.plan import Planner
    from megatron_reshard.tools.plan_inputs import stage_inputs

    planner = Planner()
    moved = defaultdict(lambda: defaultdict(int))
    count = 0
    for stage, st in stage_inputs(lay, cfg, "broadcast", args.wire).items():
        for p in st.params:
            if not p.bulk:
                continue
            plan = planner.plan(p.key)
            for op in plan.ops:
                moved[stage][(op.src, op.dst, op.phase)] += round(box_numel(op.box) * p.itemsize)
            count += 1
            if args.verbose:
                print(f"{p.name}: {list(p.shape)}: {len(plan.ops)} ops, fingerprint "
                      f"{plan.fingerprint[:12]}")
    sw = lay.stage_world
    print(f"\n{count} bulk params planned; training ranks 0..{sw - 1} of each stage's refit "
          f"group send, generation ranks {sw}..{sw + lay.gen_world - 1} receive")
    ranks = range(sw + lay.gen_world)
    for stage in sorted(moved):
        print(f"\nstage {stage}: MiB moved (rows: sender group rank, columns: receiver)")
        print("| from \\ to | " + " | ".join(str(r) for r in ranks) + " |")
        print("|---" * (len(ranks) + 1) + "|")
        per_pair = defaultdict(int)
        for (a, d, _), nbytes in moved[stage].items():
            per_pair[(a, d)] += nbytes
        for s in ranks:
            cells = [per_pair.get((s, r), 0) / 2**20 for r in ranks]
            if any(cells):
                print(f"| {s} | " + " | ".join(f"{c:.2f}" if c else "." for c in cells) + " |")
        local = sum(v for (a, d), v in per_pair.items() if a == d) / 2**20
        replica = sum(v for (_, _, ph), v in moved[stage].items() if ph == 1) / 2**20
        print(f"local copies: {local:.2f} MiB; replica completion inside generation groups: "
              f"{replica:.2f} MiB")
