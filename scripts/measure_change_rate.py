"""How many BF16 weights change per optimizer step: the input of delta refits (issue 35).

Measured, not assumed: a real megatron-core GPT model (dense, and MoE) trains on CPU with
FP32 master weights and Adam, and after every step the BF16 copy the generation side would
receive is compared bit for bit with the previous step's.

    python scripts/measure_change_rate.py                     # dense + MoE, lr 1e-6 / 3e-6 / 1e-5, 25 steps
    python scripts/measure_change_rate.py --small --steps 3   # smoke run (a test runs it)

Set-up, as an RL step sees it: one process (gloo, TP1), the local layer spec, Megatron's
own initialisation (normal, std 0.02; output projections scaled by 1/sqrt(2 layers);
norms at 1), ``torch.optim.AdamW`` (betas 0.9 / 0.95, eps 1e-8, weight decay 0.01) over
FP32 parameters, next-token loss on a fixed synthetic corpus (a random first-order Markov
chain, so the loss can fall). Per step: the fraction of BF16 elements whose bits differ
from the last step's BF16 copy, over the whole model and per kind of parameter (experts,
other MLP, attention, embeddings and head, norms and router). Adam's first step moves
every element by about ``lr`` (m / sqrt(v) is the gradient's sign), so step 1 is printed
apart from the steady median over steps 2..N.

The CPU forward needs the stand-ins of tests/megatron_cpu_forward.py (the one home of
those workarounds); this script puts tests/ on the path to use them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KINDS = ("experts", "mlp", "attention", "embedding", "norm_router")


def kind_of(name: str) -> str:
    if ".experts." in name:
        return "experts"
    if "layernorm" in name or "norm" in name.rsplit(".", 2)[-2] or ".router." in name:
        return "norm_router"
    if ".mlp." in name:
        return "mlp"
    if "self_attention" in name:
        return "attention"
    return "embedding"


def init_like_megatron_(model, num_layers: int, std: float = 0.02) -> None:
    """Megatron's default initialisation (init_method_normal / scaled_init_method_normal)."""
    scaled = std / (2.0 * num_layers) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.fill_(1.0 if "norm" in name else 0.0)
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                p.normal_(0.0, scaled)
            else:
                p.normal_(0.0, std)


def markov_corpus(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g)  # each token has 4 likely successors
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(seq):
        pick = torch.randint(0, 4, (batch,), generator=g)
        tokens[:, t + 1] = nxt[tokens[:, t], pick]
    return tokens


def bf16_bits(model) -> dict:
    return {n: p.detach().to(torch.bfloat16).view(torch.int16).clone()
            for n, p in model.named_parameters()}


def changed(before: dict, after: dict) -> tuple[dict, dict, dict]:
    """Changed and total elements per kind, and how far the changed ones moved: their bits
    as integers by exactly 1 (one unit in the last place) and by at most 127 (what a delta's
    DIFF8 values carry in one byte)."""
    diff = {k: 0 for k in KINDS}
    total = {k: 0 for k in KINDS}
    moved = {"ulp1": 0, "int8": 0}
    for name, old in before.items():
        k = kind_of(name)
        new = after[name]
        hit = old != new
        diff[k] += int(hit.sum())
        total[k] += old.numel()
        step = (new[hit].to(torch.int32) - old[hit].to(torch.int32)).abs()
        moved["ulp1"] += int((step == 1).sum())
        moved["int8"] += int((step <= 127).sum())
    return diff, total, moved


def run_case(spec, lr: float, steps: int, batch: int, seq: int) -> dict:
    from megatron_cpu_forward import causal_mask, cpu_forward_shims

    from megatron_reshard.testing.megatron_models import build_gpt_model

    model = build_gpt_model(spec)
    init_like_megatron_(model, spec.num_layers)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    corpus = markov_corpus(spec.vocab_size, batch * steps, seq, seed=7)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = causal_mask(seq)
    prev = bf16_bits(model)
    rows, losses = [], []
    with cpu_forward_shims():
        for step in range(steps):
            chunk = corpus[step * batch:(step + 1) * batch]
            loss = model(chunk[:, :-1], positions, mask, labels=chunk[:, 1:]).float().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            now = bf16_bits(model)
            diff, total, moved = changed(prev, now)
            prev = now
            n_changed = max(1, sum(diff.values()))
            rows.append({"step": step + 1,
                         "all": sum(diff.values()) / sum(total.values()),
                         "moved_1ulp": moved["ulp1"] / n_changed,
                         "moved_int8": moved["int8"] / n_changed,
                         **{k: diff[k] / total[k] for k in KINDS if total[k]}})
    steady = rows[1:] or rows
    return {"lr": lr, "steps": steps, "params": sum(p.numel() for p in model.parameters()),
            "loss_first": losses[0], "loss_last": losses[-1], "first_step": rows[0],
            "steady_median": {k: statistics.median(r[k] for r in steady) for k in rows[0] if k != "step"},
            "steady_max_all": max(r["all"] for r in steady), "per_step": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a smoke run")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    # megatron-core's notes about missing Apex / Transformer Engine say nothing about the figures
    warnings.filterwarnings("ignore", category=UserWarning)

    from megatron.core import parallel_state as ps

    from megatron_reshard.testing.megatron_models import TinyGPTSpec
    from megatron_reshard.tools.worlds import free_ports

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_ports(1)[0]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    if args.small:
        size = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=200)
        batch, seq = 4, 16
    else:
        size = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                    ffn_hidden_size=704, vocab_size=2000)
        batch, seq = 8, 64
    specs = {"dense": TinyGPTSpec(dtype="float32", **size),
             "moe": TinyGPTSpec(dtype="float32", num_moe_experts=8, moe_router_topk=2,
                                moe_ffn_hidden_size=size["ffn_hidden_size"] // 2, **size)}
    results = []
    print("| model | lr | params | step 1 changed | steady median changed (steps 2..N) "
          "| steady max | experts | mlp | attention | embedding | norms+router | moved 1 ulp "
          "| moved <= 127 | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            r = run_case(specs[model_name], lr, args.steps, batch, seq)
            r["model"] = model_name
            results.append(r)
            med = r["steady_median"]
            cols = " | ".join(f"{100 * med[k]:.2f}%" if k in med else "-" for k in KINDS)
            print(f"| {model_name} | {lr:g} | {r['params']:,} | {100 * r['first_step']['all']:.1f}% "
                  f"| {100 * med['all']:.2f}% | {100 * r['steady_max_all']:.2f}% | {cols} "
                  f"| {100 * med['moved_1ulp']:.1f}% | {100 * med['moved_int8']:.2f}% "
                  f"| {r['loss_first']:.3f} -> {r['loss_last']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
