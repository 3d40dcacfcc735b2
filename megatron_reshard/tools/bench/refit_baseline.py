"""The refit benchmark's naive baseline: gather + broadcast of the params the refit's exact
path moves (``refit_main``'s docstring says how, and why it is favourable to itself).
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch
import torch.distributed as dist

from megatron_reshard.megatron.converters import TP_SHARDED_KINDS, find_rule
from megatron_reshard.vllm_layout import padded_vocab_rows

from .timing import GroupOps, time_collective

# torch 2.13 renamed it (the old name warns FutureWarning on every call); older ones lack it
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def baseline_items_train(model, family: str, train_world: int, vocab_size: int
                         ) -> tuple[list[dict], list[torch.Tensor], str]:
    """Train side: (specs, local tensors, note). Specs are plain data shared with the gen
    side: full shape, gather dim (None: replicated), gen slice dim; vocab matrices also
    carry the real vocab size and vLLM's padded size (the gen side keeps its padded chunk's
    real rows), as the refit moves them on its exact path too. Each param's kind (and so
    its TP dim) is its Megatron name's rule in ``megatron.converters``."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    experts: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
    specs, locals_, notes = [], [], []
    for name, p in model.named_parameters():
        found = find_rule(family, name)
        if found is None:
            continue
        layer, rule, hit = found
        if rule.kind in ("expert_fc1", "expert_fc2"):  # group 1: the local expert index
            experts.setdefault((layer, rule.kind), []).append((int(hit.group(1)), p))
        elif rule.kind == "replicated":
            specs.append({"full": list(p.shape), "src_dim": None, "gen_dim": None})
            locals_.append(p.detach())
        elif rule.kind in TP_SHARDED_KINDS:
            if tp not in (1, train_world):
                notes.append(f"TP {tp} != train world {train_world}: TP-sharded params skipped")
                continue
            dim = TP_SHARDED_KINDS[rule.kind]  # gen keeps the same dim's TP chunk
            full = list(p.shape)
            full[dim] *= tp
            spec = {"full": full, "src_dim": dim if tp > 1 else None, "gen_dim": dim}
            if rule.kind == "vocab":
                spec.update(vocab=vocab_size, gen_pad=padded_vocab_rows(vocab_size))
            specs.append(spec)
            locals_.append(p.detach())
    for (_, kind), items in sorted(experts.items()):
        if ep not in (1, train_world):
            notes.append(f"EP {ep} != train world {train_world}: experts skipped")
            break
        stacked = torch.stack([t.detach() for _, t in sorted(items, key=lambda x: x[0])])
        full = list(stacked.shape)
        full[0] *= ep
        specs.append({"full": full, "src_dim": 0 if ep > 1 else None,
                      "gen_dim": 1 if kind == "expert_fc1" else 2})
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
                    _GATHER(full.view(-1), local.reshape(-1))
                else:
                    g = self.gathered[(self.n_train, *local.shape)]
                    _GATHER(g.view(-1), local.reshape(-1))
                    torch.cat(list(g.unbind(0)), dim=d, out=full)
            self.group.broadcast([full], opts).wait()
            if self.role == "gen":
                view, dst = self.views[i]
                dst.copy_(view)


def run_baseline(ctx: dict, args: argparse.Namespace, case: str, ops: GroupOps) -> dict:
    role, cfg, device, group, control = (ctx["role"], ctx["cfg"], ctx["device"], ctx["group"],
                                         ctx["control"])
    key = f"bench/{case}/baseline_specs"
    locals_ = None
    if role == "train":
        facts = ctx["sender"].plan.facts
        specs, locals_, note = baseline_items_train(ctx["model"], facts.family,
                                                    cfg.train_world, facts.vocab_size)
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
