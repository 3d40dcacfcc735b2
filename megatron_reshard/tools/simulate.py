"""The whole refit of a job on paper: plan every param with the engine's planner, add up
the bytes each rank sends and receives, and estimate the refit time under a link model.

No GPU and no communication. Ranks are global: training rank ``stage * S + i`` (S ranks
per PP stage, stage-local ``i``), generation rank ``g``. Training and generation run on
separate nodes of ``gpus_per_node`` GPUs each, filled in rank order.

The link model (stated defaults: H100 nodes, 8 GPUs, NVLink 4 at 450 GB/s per direction
per GPU, one 400 Gb/s NIC per GPU = 50 GB/s per direction): every byte between two GPUs of
one node uses NVLink, every other byte the sender's and the receiver's NIC; a rank's time
is the largest of its four loads (NVLink out/in, network out/in) over their bandwidth,
plus a fixed cost per message it takes part in; the refit takes as long as its busiest
rank. Everything overlaps (batches pipeline, both directions of a link are independent);
congestion inside the network, NCCL's per-channel limits and the receiver's copies are
left out. The estimate is a lower bound of what an implementation of the plan can reach.

The gather + broadcast baseline under the same model: each param is gathered whole on its
training ranks (all-gather over the ranks that shard it) and broadcast from one training
rank to every generation rank (a pipelined broadcast: every generation rank receives the
whole model through its NIC); gather and broadcast do not overlap.

Delta refits (``changed``: the fraction of elements whose bits changed since the last
refit, spread at random): every engine region carries a 16-byte header and the expected
size of its cheapest encoding (``refit.delta_transport``: gaps, a bitmask, positions or
dense; values as one byte, ``DIFF8``, with ``escape`` of the changed elements sent whole),
and messages are two per pair of ranks per batch in which the pair has regions (headers,
payloads), batches cut as the refit loop cuts them (``batch_bytes`` of global bytes). The
packed broadcast of the others (``others="broadcast"``) stays full, as in the library.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from megatron_reshard.layout.geometry import box_numel
from megatron_reshard.engine.link_costs import LinkCosts
from megatron_reshard.engine.param_plan import ParamPlan
from megatron_reshard.engine.plan import Planner, gc_paused
from megatron_reshard.refit.delta_transport import GAP_SKIP, HEADER_BYTES
from megatron_reshard.refit.loop import DEFAULT_BATCH_BYTES
from megatron_reshard.refit.order import byte_bounds

from .plan_inputs import RefitParallelism, StagePlanInput, count_params, stage_inputs


@dataclass(frozen=True)
class LinkModel:
    gpus_per_node: int = 8
    nvlink_gbps: float = 450.0  # GB/s per GPU per direction
    net_gbps: float = 50.0  # GB/s per GPU per direction (one 400 Gb/s NIC per GPU)
    latency_us: float = 5.0  # per message a rank sends or receives

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node on NVLink at {self.nvlink_gbps:g} GB/s, "
                f"{self.net_gbps:g} GB/s per GPU between nodes, {self.latency_us:g} µs per message")


@dataclass
class Loads:
    """Per global rank: bytes out/in on NVLink and network, messages."""

    nvl_out: dict = field(default_factory=lambda: defaultdict(int))
    nvl_in: dict = field(default_factory=lambda: defaultdict(int))
    net_out: dict = field(default_factory=lambda: defaultdict(int))
    net_in: dict = field(default_factory=lambda: defaultdict(int))
    msgs: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, src, dst, nbytes: int, same_node: bool, count: int = 1) -> None:
        if same_node:
            self.nvl_out[src] += nbytes
            self.nvl_in[dst] += nbytes
        else:
            self.net_out[src] += nbytes
            self.net_in[dst] += nbytes
        self.msgs[src] += count
        self.msgs[dst] += count

    def time_s(self, link: LinkModel) -> tuple[float, Any, str]:
        """(seconds, busiest rank, what limits it) under the link model."""
        best = (0.0, None, "nothing moves")
        for r in sorted(self.msgs):
            parts = {"NVLink out": self.nvl_out.get(r, 0) / (link.nvlink_gbps * 1e9),
                     "NVLink in": self.nvl_in.get(r, 0) / (link.nvlink_gbps * 1e9),
                     "network out": self.net_out.get(r, 0) / (link.net_gbps * 1e9),
                     "network in": self.net_in.get(r, 0) / (link.net_gbps * 1e9)}
            what = max(parts, key=parts.get)
            fixed = self.msgs[r] * link.latency_us * 1e-6
            t = parts[what] + fixed
            if t > best[0]:
                why = (f"{what} {parts[what]:.3f} s + {self.msgs[r]} messages {fixed:.3f} s")
                best = (t, r, why)
        return best


def _node(rank: tuple, link: LinkModel) -> tuple:
    side, r = rank
    return side, r // link.gpus_per_node


def _global(group_rank: int, stage: int, stage_world: int) -> tuple:
    if group_rank < stage_world:
        return ("train", stage * stage_world + group_rank)
    return ("gen", group_rank - stage_world)


DIFF8_ESCAPES = 0.002  # changed elements a one-byte difference cannot carry (measured: 0.13-0.24%)


def delta_bytes_per_element(changed: float, itemsize: float,
                            escape: float = DIFF8_ESCAPES) -> float:
    """Expected wire bytes per element of a region (header aside) when ``changed`` of its
    elements changed at random: the cheapest of the delta encodings."""
    if changed <= 0:
        return 0.0
    if changed >= 1:
        return float(itemsize)
    q = (1.0 - changed) ** GAP_SKIP  # a gap longer than one skip byte covers
    skips = q / (1.0 - q) if q < 1 else float("inf")  # expected skip bytes per changed element
    value = min(float(itemsize), 1.0 + escape * itemsize)
    return min(float(itemsize), 1 / 8 + changed * value, changed * (4 + value),
               changed * (1 + skips + value))


def plan_pairs(plan: ParamPlan) -> dict:
    """(src, dst) group ranks -> (elements, ops) of one plan; local copies left out."""
    out: dict = {}
    for op in plan.ops:
        if op.src == op.dst:
            continue
        n, c = out.get((op.src, op.dst), (0, 0))
        out[(op.src, op.dst)] = (n + box_numel(op.box), c + 1)
    return out


@dataclass
class Simulation:
    parallelism: RefitParallelism
    model: str
    others: str
    wire: str
    link_aware: bool
    link: LinkModel
    counts: dict
    train_sent: dict  # global train rank -> bytes
    gen_received: dict  # gen rank -> bytes (from sources and from peers)
    gen_from_peers: dict
    loads: Loads
    fingerprint: str
    plan_s_one_rank: float
    plan_s_job: float
    distinct_layouts: int
    ops: int
    gather_broadcast_s: float
    gather_s: float
    broadcast_s: float
    changed: Optional[float] = None  # a delta refit of this changed fraction (None: full)

    def to_plain(self) -> dict:
        t, rank, what = self.loads.time_s(self.link)
        return {
            "model": self.model, "layout": self.parallelism.to_plain(), "others": self.others,
            "mode": "full" if self.changed is None else "delta", "changed": self.changed,
            "busiest_gen_messages": max((n for r, n in self.loads.msgs.items() if r[0] == "gen"),
                                        default=0),
            "planner": "link-aware" if self.link_aware else "default", "wire": self.wire,
            "link_model": vars(self.link) | {"text": self.link.describe()},
            "params": self.counts, "fingerprint": self.fingerprint,
            "planning_s": {"one_rank": self.plan_s_one_rank, "whole_job": self.plan_s_job,
                           "distinct_layouts": self.distinct_layouts, "ops": self.ops},
            "train_sent_bytes": _stats(self.train_sent, self.parallelism.train_world),
            "gen_received_bytes": _stats(self.gen_received, self.parallelism.gen_world),
            "gen_received_from_peers_bytes": _stats(self.gen_from_peers, self.parallelism.gen_world),
            "estimate_s": {"refit": t, "busiest_rank": list(rank) if rank else None,
                           "limited_by": what, "gather_broadcast": self.gather_broadcast_s,
                           "gather": self.gather_s, "broadcast": self.broadcast_s},
        }


def _stats(per_rank: Mapping, n: int) -> dict:
    values = [per_rank.get(r, 0) for r in range(n)]
    total = sum(values)
    mean = total / n
    top = max(values)
    return {"min": min(values), "mean": mean, "max": top, "total": total,
            "busiest_rank": values.index(top),
            "above_ideal": (top / mean - 1.0) if mean else 0.0}


def link_costs(lay: RefitParallelism, link: LinkModel,
               stages: Optional[Mapping[int, StagePlanInput]] = None) -> LinkCosts:
    """The planner's view of the link model, in refit-group ranks (stage 0's training ranks
    stand for every stage's: sources never share a node with a destination).

    A generation rank carries every stage's traffic, a training rank its own stage's only:
    generation loads weigh the job's bytes over the heaviest stage's (the PP size when the
    stages are even, or without ``stages``)."""
    sw, g = lay.stage_world, link.gpus_per_node
    nodes = tuple((i, ("train", i // g)) for i in range(sw)) + tuple(
        (sw + r, ("gen", r // g)) for r in range(lay.gen_world))
    weight = float(lay.train_pp)
    if stages:
        per_stage = [sum(p.nbytes for p in st.params) for st in stages.values()]
        if max(per_stage):
            weight = sum(per_stage) / max(per_stage)
    return LinkCosts(nodes, link.nvlink_gbps, link.net_gbps, link.latency_us, 2,
                     round(weight, 3))


def simulate(model: str, cfg: Mapping[str, Any], lay: RefitParallelism, link: LinkModel,
             others: str = "sharded", link_aware: bool = False, wire: str = "bf16",
             changed: Optional[float] = None, batch_bytes: int = DEFAULT_BATCH_BYTES
             ) -> Simulation:
    """Plan and account the whole job (see the module docstring for the model).

    ``link_aware``: plan with the link model (``Planner(costs=link_costs(...))``) instead of
    the default planner the refit uses today. ``changed``: account a delta refit of that
    changed fraction instead of a full one."""
    stages = stage_inputs(lay, cfg, others, wire)
    costs = link_costs(lay, link, stages) if link_aware else None

    counts = count_params(stages)
    sw = lay.stage_world

    # One rank's own plan: a generation rank takes part in every stage's group. The whole
    # job's plan is that work and the rest, timed from the same start on the same planner:
    # two separate timings let noise put one rank above the whole job.
    t0 = time.perf_counter()
    with gc_paused():
        planner = Planner(costs)
        mine = lay.stage_world  # group rank of generation rank 0
        for st in stages.values():
            for p in st.params:
                if p.key is not None:
                    planner.plan(p.key).ops_of(mine)
    plan_s_one_rank = time.perf_counter() - t0

    loads = Loads()
    sent: dict = defaultdict(int)
    received: dict = defaultdict(int)
    from_peers: dict = defaultdict(int)
    fp = hashlib.blake2b(digest_size=12)
    ops = 0
    with gc_paused():
        pairs_of: dict = {}
        for stage, st in sorted(stages.items()):
            for p in st.params:
                if p.key is not None:
                    plan = planner.plan(p.key)
                    fp.update(f"{stage}\x00{p.name}\x00{plan.fingerprint}\x01".encode())
            if changed is not None:
                ops += _add_delta(st, stage, planner, pairs_of, changed, batch_bytes, lay, link,
                                  loads, sent, received, from_peers)
                _add_packed_broadcast(st, stage, lay, link, loads, sent, received)
                continue
            for (key, itemsize), count in sorted(st.key_counts().items(), key=lambda kv: repr(kv[0])):
                plan = planner.plan(key)
                pairs = pairs_of.get(key)
                if pairs is None:
                    pairs = pairs_of[key] = plan_pairs(plan)
                for (s, d), (numel, n_ops) in pairs.items():
                    src, dst = _global(s, stage, sw), _global(d, stage, sw)
                    nbytes = round(numel * itemsize * count)
                    loads.add(src, dst, nbytes, _node(src, link) == _node(dst, link), n_ops * count)
                    if src[0] == "train":
                        sent[src[1]] += nbytes
                    else:
                        from_peers[dst[1]] += nbytes
                    received[dst[1]] += nbytes
                    ops += n_ops * count
            _add_packed_broadcast(st, stage, lay, link, loads, sent, received)
    plan_s_job = time.perf_counter() - t0
    gather_s, broadcast_s = gather_broadcast_s(stages, lay, link)
    return Simulation(lay, model, others, wire, link_aware, link, counts, dict(sent), dict(received),
                      dict(from_peers), loads, fp.hexdigest(), plan_s_one_rank, plan_s_job,
                      len(planner), ops, gather_s + broadcast_s, gather_s, broadcast_s, changed)


def _add_delta(st: StagePlanInput, stage: int, planner: Planner, pairs_of: dict, changed: float,
               batch_bytes: int, lay: RefitParallelism, link: LinkModel, loads: Loads,
               sent: dict, received: dict, from_peers: dict) -> int:
    """One stage's engine params as a delta refit (module docstring); returns its regions."""
    sw = lay.stage_world
    keyed = [p for p in st.params if p.key is not None]
    regions = 0
    for start, stop in byte_bounds([p.nbytes for p in keyed], batch_bytes):
        pairs_in_batch = set()
        for p in keyed[start:stop]:
            pairs = pairs_of.get(p.key)
            if pairs is None:
                pairs = pairs_of[p.key] = plan_pairs(planner.plan(p.key))
            per_element = delta_bytes_per_element(changed, p.itemsize)
            for (s, d), (numel, n_ops) in pairs.items():
                src, dst = _global(s, stage, sw), _global(d, stage, sw)
                nbytes = round(numel * per_element + HEADER_BYTES * n_ops)
                loads.add(src, dst, nbytes, _node(src, link) == _node(dst, link), 0)
                if src[0] == "train":
                    sent[src[1]] += nbytes
                else:
                    from_peers[dst[1]] += nbytes
                received[dst[1]] += nbytes
                regions += n_ops
                pairs_in_batch.add((src, dst))
        for src, dst in pairs_in_batch:  # a header message and a payload message
            loads.add(src, dst, 0, True, 2)
    return regions


def _add_packed_broadcast(st: StagePlanInput, stage: int, lay: RefitParallelism, link: LinkModel,
                          loads: Loads, sent: dict, received: dict) -> None:
    """Today's path for the non-bulk params: one packed broadcast per stage from the stage's
    first training rank to every rank of the group, as a pipelined chain (ring) in rank
    order: each rank receives the whole buffer once and passes it on."""
    nbytes = sum(p.nbytes for p in st.params if p.key is None)
    if not nbytes:
        return
    sw = lay.stage_world
    chain = [("train", stage * sw + i) for i in range(sw)] + [("gen", g) for g in range(lay.gen_world)]
    for a, b in zip(chain, chain[1:]):
        loads.add(a, b, nbytes, _node(a, link) == _node(b, link))
        if a[0] == "train":
            sent[a[1]] += nbytes
        if b[0] == "gen":
            received[b[1]] += nbytes


def gather_broadcast_s(stages: Mapping[int, StagePlanInput], lay: RefitParallelism,
                       link: LinkModel) -> tuple[float, float]:
    """(gather seconds, broadcast seconds) of the naive refit under the link model.

    Gather: a param sharded over ``m`` training ranks is all-gathered among them (each
    receives (m-1)/m of it), over NVLink when those ranks share a node; stages gather in
    parallel, the busiest rank sets the time. Broadcast: every generation rank receives every
    byte of the model over its NIC, the stages' broadcasts sharing it.
    """
    per_rank_gather: dict = defaultdict(float)  # stage -> seconds of its busiest rank
    total = 0
    for stage, st in stages.items():
        for p in st.params:
            total += p.nbytes
            m = _shard_ranks(p, lay)
            if m > 1:
                bw = link.nvlink_gbps if m <= link.gpus_per_node else link.net_gbps
                per_rank_gather[stage] += p.nbytes * (m - 1) / m / (bw * 1e9)
    gather = max(per_rank_gather.values(), default=0.0)
    return gather, total / (link.net_gbps * 1e9)


def _shard_ranks(p, lay: RefitParallelism) -> int:
    """How many training ranks one copy of ``p`` is split over."""
    if p.key is None:  # the simulator was asked for today's path: use the train rules
        name = p.name
        if name.endswith(("layernorm.weight", "norm.weight", "gate.weight", "correction_bias",
                          "q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            return 1
        return lay.train_tp
    s_shape, s_dims = p.key.src_mesh_shape, p.key.src_dims
    m = 1
    for n, d in zip(s_shape, s_dims):
        if d != -1:
            m *= n
    return m


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def grouped_ranks(values: Sequence[int]) -> str:
    return ",".join(map(str, values))
