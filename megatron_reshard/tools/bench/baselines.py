"""Baselines measured in the same run as the engine: raw point-to-point and gather+broadcast.

An absolute time means little on a shared machine; a refit figure is reported next to
what the link did in the same run (raw P2P) and what the naive refit does (gather the
full tensor on the training ranks, broadcast it to everyone, slice).

Every rank of the group calls each function (ranks with no part only join the barriers);
every rank gets the same result back.

Raw point-to-point (ranks are ranks of ``group``; ``group`` may be None, a registered group
— P2P coalesced through ``batch_isend_irecv``, one NCCL launch — or a raw unregistered
``ProcessGroup`` — on CUDA coalesced through the backend's ``_start_coalescing()`` /
``_end_coalescing()``, which needs the group's communicator connected on every rank first;
on CPU individual ``send``/``recv`` all posted before any wait)::

    measure_raw_p2p(group, src_ranks, dst_ranks, nbytes, device, *, iters=10, warmup=3,
                    pattern="pair", timer="auto") -> float          # GB/s per destination
    raw_p2p(...same...) -> Measurement                             # with the times

    pattern   who sends what (nbytes = bytes arriving at each receiving destination)
    "pair"    src_ranks[0] -> dst_ranks[0], nbytes
    "pairs"   src_ranks[i] -> dst_ranks[i] for i < min(#src, #dst), at once, nbytes each
    "fanin"   every source -> dst_ranks[0], nbytes split evenly over the sources
    "mxn"     every source -> every destination, nbytes split evenly over the sources,
              all messages in one batch (the exchange an S(0) -> S(1) reshard makes)

Gather + broadcast (ranks are ranks of the *default world*; the two subgroups come from
``dist.new_group`` through :class:`BaselineGroups`, which every rank of the default world
must build together, once, and may reuse)::

    BaselineGroups.create(src_ranks, dst_ranks) -> BaselineGroups
    BaselineParam(global_shape, dtype, src_dim=None, dst_dim=None)   # None = Replicate
    measure_gather_broadcast(params, groups, device, *, iters=10, warmup=3,
                             timer="auto") -> float   # useful GB/s per destination
    gather_broadcast(...same...) -> Measurement
    NaiveRefit(params, groups, device): .run(), .outputs(), .bytes_per_dst   # one step, checkable

Per parameter, in order (the naive refit): sources all-gather their shards along
``src_dim`` into the full tensor (skipped for a replicated source), ``src_ranks[0]``
broadcasts the full tensor to all source and destination ranks, each destination copies
its ``torch.chunk`` part along ``dst_dim`` (or the whole tensor) into its own storage.
Meshes are 1-D; the sharded dims must divide evenly by the number of ranks. Full-size
buffers are allocated once, outside the timed loop (this favours the baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from .patterns import chunk_bounds, pattern_values
from .timing import GroupOps, Measurement, is_registered, time_collective

P2P_PATTERNS = ("pair", "pairs", "fanin", "mxn")


def _split(nbytes: int, parts: int) -> list[int]:
    base, rest = divmod(nbytes, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def p2p_messages(pattern: str, src_ranks: Sequence[int], dst_ranks: Sequence[int],
                 nbytes: int) -> list[tuple[int, int, int]]:
    """The (src, dst, nbytes) messages of a raw pattern (see module docstring)."""
    src_ranks, dst_ranks = list(src_ranks), list(dst_ranks)
    if not src_ranks or not dst_ranks:
        raise ValueError(f"raw p2p: need source and destination ranks, got {src_ranks} -> {dst_ranks}")
    if set(src_ranks) & set(dst_ranks):
        raise ValueError(f"raw p2p: source and destination ranks overlap: {src_ranks} / {dst_ranks}")
    if nbytes < 1:
        raise ValueError(f"raw p2p: nbytes must be >= 1, got {nbytes}")
    if pattern == "pair":
        return [(src_ranks[0], dst_ranks[0], nbytes)]
    if pattern == "pairs":
        return [(s, d, nbytes) for s, d in zip(src_ranks, dst_ranks)]
    if pattern == "fanin":
        return [(s, dst_ranks[0], n) for s, n in zip(src_ranks, _split(nbytes, len(src_ranks))) if n]
    if pattern == "mxn":
        sizes = _split(nbytes, len(src_ranks))
        return [(s, d, n) for d in dst_ranks for s, n in zip(src_ranks, sizes) if n]
    raise ValueError(f"raw p2p: unknown pattern {pattern!r}; expected one of {P2P_PATTERNS}")


def _post_p2p(ops: list[tuple[str, torch.Tensor, int]], group: Optional[dist.ProcessGroup],
              registered: bool) -> None:
    """Post all sends/receives of this rank, then wait for them all."""
    if not ops:
        return
    if registered:
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, group=group,
                          group_peer=peer) for kind, t, peer in ops]
        works = dist.batch_isend_irecv(p2p)
    elif ops[0][1].is_cuda:
        # A raw NCCL group: coalesce through its backend (the group-level
        # _start_coalescing has another signature), one launch like batch_isend_irecv.
        dev = ops[0][1].device
        backend = group._get_backend(dev) if hasattr(group, "_get_backend") else group
        backend._start_coalescing()
        for kind, t, peer in ops:
            (backend.send if kind == "send" else backend.recv)([t], peer, 0)
        works = [backend._end_coalescing()]
    else:
        works = [group.send([t], peer, 0) if kind == "send" else group.recv([t], peer, 0)
                 for kind, t, peer in ops]
    for w in works:
        if w is not None:
            w.wait()


def raw_p2p(group: Optional[dist.ProcessGroup], src_ranks: Sequence[int],
            dst_ranks: Sequence[int], nbytes: int, device: torch.device, *, iters: int = 10,
            warmup: int = 3, pattern: str = "pair", timer: str = "auto") -> Measurement:
    """Time one raw P2P pattern; ``Measurement.gbps`` is GB/s into each receiving destination."""
    device = torch.device(device)
    me = GroupOps(group, device).rank
    messages = p2p_messages(pattern, src_ranks, dst_ranks, nbytes)
    ops: list[tuple[str, torch.Tensor, int]] = []
    # One global order (by destination, then source) so that even uncoalesced posting
    # cannot deadlock; no rank both sends and receives here.
    for s, d, n in messages:
        if me == s:
            ops.append(("send", torch.full((n,), 7, dtype=torch.uint8, device=device), d))
        elif me == d:
            ops.append(("recv", torch.empty(n, dtype=torch.uint8, device=device), s))
    registered = is_registered(group)
    timing = time_collective(lambda: _post_p2p(ops, group, registered), group, device=device,
                             iters=iters, warmup=warmup, timer=timer)
    return Measurement(name=f"raw_{pattern}", bytes_per_dst=nbytes, timing=timing)


def measure_raw_p2p(group: Optional[dist.ProcessGroup], src_ranks: Sequence[int],
                    dst_ranks: Sequence[int], nbytes: int, device: torch.device, *,
                    iters: int = 10, warmup: int = 3, pattern: str = "pair",
                    timer: str = "auto") -> float:
    """GB/s per destination of a raw P2P pattern (see module docstring)."""
    return raw_p2p(group, src_ranks, dst_ranks, nbytes, device, iters=iters, warmup=warmup,
                   pattern=pattern, timer=timer).gbps


@dataclass(frozen=True)
class BaselineParam:
    """One parameter of the naive refit: global shape, dtype, shard dims (None = Replicate)."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    src_dim: Optional[int] = None
    dst_dim: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class BaselineGroups:
    """Default-world ranks of the two sides and the subgroups the naive refit uses.

    ``gather`` spans the source ranks (None on other ranks or with one source); ``bcast``
    spans sources and destinations (None on ranks outside both).
    """

    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    gather: Optional[dist.ProcessGroup]
    bcast: Optional[dist.ProcessGroup]

    @classmethod
    def create(cls, src_ranks: Sequence[int], dst_ranks: Sequence[int]) -> "BaselineGroups":
        """Every rank of the default world calls this with the same arguments."""
        if not dist.is_initialized():
            raise RuntimeError("BaselineGroups.create needs an initialized default world")
        src, dst = tuple(src_ranks), tuple(dst_ranks)
        world = dist.get_world_size()
        bad = [r for r in src + dst if not 0 <= r < world]
        if not src or not dst or bad or len(set(src)) != len(src) or len(set(dst)) != len(dst):
            raise ValueError(f"BaselineGroups: bad ranks src={list(src)} dst={list(dst)} "
                             f"for a world of {world}")
        me = dist.get_rank()
        union = sorted(set(src) | set(dst))
        gather = dist.new_group(sorted(src)) if len(src) > 1 else None
        bcast = dist.new_group(union)
        return cls(src, dst, gather if me in src else None, bcast if me in union else None)

    @property
    def all_ranks(self) -> list[int]:
        return sorted(set(self.src_ranks) | set(self.dst_ranks))


def dst_useful_bytes(param: BaselineParam, n_dst: int, dst_index: int) -> int:
    """Bytes of ``param`` that destination ``dst_index`` (of ``n_dst``) keeps."""
    if param.dst_dim is None:
        return param.nbytes
    lo, hi = chunk_bounds(param.global_shape[param.dst_dim], n_dst, dst_index)
    return param.nbytes // param.global_shape[param.dst_dim] * (hi - lo)


def _all_gather_flat(out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather into ``out`` (contiguous, ranks' shards in order) through flat views, the
    one shape convention NCCL and gloo agree on."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), local.view(-1), group=group)


class _NaiveParam:
    """Buffers one rank needs to run the naive refit of one parameter."""

    def __init__(self, p: BaselineParam, groups: BaselineGroups, me: int, device: torch.device,
                 salt: int):
        shape = list(p.global_shape)
        for dim in (p.src_dim, p.dst_dim):
            if dim is not None and not 0 <= dim < len(shape):
                raise ValueError(f"gather+broadcast: shard dim {dim} out of range for {shape}")
        n_src = len(groups.src_ranks)
        if p.src_dim is not None and shape[p.src_dim] % n_src:
            raise ValueError(f"gather+broadcast: dim {p.src_dim} of {shape} does not split "
                             f"evenly over {n_src} sources")
        self.p = p
        self.is_src = me in groups.src_ranks
        self.is_dst = me in groups.dst_ranks
        self.in_bcast = me in groups.all_ranks
        self.full = torch.empty(shape, dtype=p.dtype, device=device) if self.in_bcast else None
        self.local = self.gathered = None
        whole = [(0, n) for n in shape]
        if self.is_src and p.src_dim is not None:
            box = list(whole)
            box[p.src_dim] = chunk_bounds(shape[p.src_dim], n_src, groups.src_ranks.index(me))
            self.local = pattern_values(shape, box, p.dtype, device, salt)
            if p.src_dim != 0 and n_src > 1:
                self.gathered = torch.empty([n_src] + list(self.local.shape), dtype=p.dtype,
                                            device=device)
        elif self.is_src:
            self.full.copy_(pattern_values(shape, whole, p.dtype, device, salt))
        self.dst = None
        if self.is_dst:
            k = groups.dst_ranks.index(me)
            if p.dst_dim is None:
                self.view = self.full
            else:
                lo, hi = chunk_bounds(shape[p.dst_dim], len(groups.dst_ranks), k)
                self.view = self.full.narrow(p.dst_dim, lo, hi - lo)
            self.dst = torch.empty(self.view.shape, dtype=p.dtype, device=device)

    def run(self, groups: BaselineGroups) -> None:
        p = self.p
        if self.is_src and p.src_dim is not None:
            if groups.gather is None:
                self.full.copy_(self.local)
            elif self.gathered is None:  # dim 0: the gathered shards are the full tensor
                _all_gather_flat(self.full, self.local, groups.gather)
            else:
                _all_gather_flat(self.gathered, self.local, groups.gather)
                torch.cat(list(self.gathered.unbind(0)), dim=p.src_dim, out=self.full)
        if self.in_bcast:
            dist.broadcast(self.full, src=groups.src_ranks[0], group=groups.bcast)
        if self.is_dst:
            self.dst.copy_(self.view)


class NaiveRefit:
    """The naive refit of ``params`` on this rank, ready to run (buffers allocated once).

    Sources hold ``pattern_values`` data (salt = the parameter's index), so the result can be
    checked: after ``run()``, ``outputs()[i]`` is this destination's part of parameter ``i``
    (None on ranks that are not destinations).
    """

    def __init__(self, params: Sequence[BaselineParam], groups: BaselineGroups,
                 device: torch.device):
        self.params = list(params)
        self.groups = groups
        me = dist.get_rank()
        self._items = [_NaiveParam(p, groups, me, torch.device(device), salt=i)
                       for i, p in enumerate(self.params)]
        n_dst = len(groups.dst_ranks)
        self.bytes_per_dst = max(sum(dst_useful_bytes(p, n_dst, k) for p in self.params)
                                 for k in range(n_dst))

    def run(self) -> None:
        for item in self._items:
            item.run(self.groups)

    def outputs(self) -> list[Optional[torch.Tensor]]:
        return [item.dst for item in self._items]


def gather_broadcast(params: Union[BaselineParam, Sequence[BaselineParam]],
                     groups: BaselineGroups, device: torch.device, *, iters: int = 10,
                     warmup: int = 3, timer: str = "auto") -> Measurement:
    """Time the naive refit of ``params`` (one after the other); see module docstring."""
    if isinstance(params, BaselineParam):
        params = [params]
    naive = NaiveRefit(params, groups, device)
    timing = time_collective(naive.run, None, device=torch.device(device), iters=iters,
                             warmup=warmup, timer=timer)
    return Measurement(name="gather_broadcast", bytes_per_dst=naive.bytes_per_dst, timing=timing)


def measure_gather_broadcast(params: Union[BaselineParam, Sequence[BaselineParam]],
                             groups: BaselineGroups, device: torch.device, *, iters: int = 10,
                             warmup: int = 3, timer: str = "auto") -> float:
    """Useful GB/s per destination of the naive refit (see module docstring)."""
    return gather_broadcast(params, groups, device, iters=iters, warmup=warmup,
                            timer=timer).gbps
