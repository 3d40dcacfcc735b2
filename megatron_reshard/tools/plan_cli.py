"""``megatron-reshard plan``: what a refit would move and how long it would take, computed
from layouts alone (no GPU, no communication, no Megatron model).

Takes a model preset (the demo's small models, or full-size Qwen3-8B, Qwen3-30B-A3B,
Qwen3-235B-A22B, DeepSeek-V3, Kimi-K2 shapes from their HF configs) and a training layout
(TP, CP, EP, PP with even or uneven stages, DP from the world size) -> generation layout
(TP, EP, DP replicas), the model's default layout for any size not given (listed at the
end of --help), plans every parameter with the engine's planner and prints:

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
                                            model_config, model_names)

DEFAULT_LINK = dict(gpus_per_node=8, nvlink_gbps=450.0, net_gbps=50.0, latency_us=5.0)


PARALLELISM_OPTIONS = ("train_world", "train_tp", "train_cp", "train_ep", "train_pp", "gen_world",
                  "gen_tp", "gen_ep")


def defaults_epilog() -> str:
    """The per-model default layouts, as --help lists them."""
    lines = ["default layout per model (any layout option given replaces its part):"]
    for name in model_names():
        lines.append(f"  {name:16} {describe_plan_parallelism(default_plan_parallelism(model_config(name)))}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.epilog = defaults_epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--model", choices=model_names(), default="moe",
                        help="model shapes: the demo's small models or a full-size preset")
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
                        help="dtype on the wire: 'fp8' sends linear weights as block FP8 "
                             "(128x128 blocks, fp32 scales), as FP8 generation would hold "
                             "them; the refit does not quantize yet: a what-if")
    parser.add_argument("--planner", choices=["both", "default", "link-aware"], default="both",
                        help="which planner's figures to show: the refit's default planner, "
                             "the link-aware one, or both side by side")
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
    """(model config, parallel sizes, problems) for the parsed options; nothing is planned yet."""
    from megatron_reshard.tools.plan_inputs import RefitParallelism, parallelism_problems

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
    if out:
        return None, None, out
    cfg = model_config(args.model, args.layers)
    lay = RefitParallelism(pp_layers=pp_layers, **parallelism_options(args, cfg, pp_layers))
    return cfg, lay, parallelism_problems(lay, cfg)


def parallelism_options(args: argparse.Namespace, cfg, pp_layers: Optional[tuple]) -> dict:
    """The parallel sizes given on the command line, the model's defaults for the others
    (computed from the layer count in use, so --layers moves them too); --train-pp-layers
    alone sets the stage count."""
    chosen = default_plan_parallelism(cfg)
    if pp_layers is not None:
        chosen["train_pp"] = len(pp_layers)
    given = {k: getattr(args, k) for k in PARALLELISM_OPTIONS if getattr(args, k) is not None}
    return {**chosen, **given}


def run(args: argparse.Namespace) -> int:
    from megatron_reshard.tools.simulate import LinkModel, simulate

    cfg, lay, problems = problems_of(args)
    if problems:
        return _fail(problems)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail([f"--plot {args.plot}: needs matplotlib (pip install 'megatron-reshard[plot]')"])
    link = LinkModel(args.gpus_per_node, args.nvlink_gbps, args.net_gbps, args.latency_us)
    which = {"both": (False, True), "default": (False,), "link-aware": (True,)}[args.planner]
    sims = [simulate(args.model, cfg, lay, link, args.others, aware, args.wire)
            for aware in which]
    if args.json:
        print(json.dumps({"model": args.model, "layout_text": lay.describe(),
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


def _print_table(args, cfg, lay, sims) -> None:
    from megatron_reshard.tools.simulate import describe_bytes as b

    first = sims[0].to_plain()
    c = first["params"]
    total = c["bulk_bytes"] + c["other_bytes"]
    how = ("by packed broadcast from each stage's first training rank" if args.others == "broadcast"
           else "shard to shard through the engine too")
    print(f"model {args.model}: {cfg['num_hidden_layers']} layers, {_count(c['elements'])} "
          f"parameters ({b(total)} as sent)")
    print(f"layout: {lay.describe()}")
    print(f"tensors the refit moves: {c['bulk_params'] + c['other_params']} (an MoE layer's "
          f"experts as one tensor per projection; {c['hf_tensors']} HF weights) = "
          f"{c['bulk_params']} FFN/expert params through the engine ({b(c['bulk_bytes'])}) + "
          f"{c['other_params']} others {how} ({b(c['other_bytes'])})"
          + (", linear weights as block FP8" if args.wire == "fp8" else ""))
    print(f"link model: {sims[0].link.describe()}")
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
    e = first["estimate_s"]
    print(f"\ngather + broadcast estimate: {_secs(e['gather_broadcast'])} (gather on the "
          f"training ranks {_secs(e['gather'])}, then every generation rank receives the "
          f"whole model: {_secs(e['broadcast'])})")
    for s in sims:
        print(f"plan fingerprint ({'link-aware' if s.link_aware else 'default'} planner): "
              f"{s.fingerprint}")


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
    from megatron_reshard.engine.geometry import box_numel
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
