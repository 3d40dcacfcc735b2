"""The refit loop both sides run: walk the payload's params in order and move them.

Torch + stdlib only (the receiver imports it). The training side (``side="src"``) and the
generation side (``side="dst"``) build a ``RefitLoop`` from the same restored refit info,
their own ``HFToLocalParamMap`` and their refit groups (one per training PP stage), and
then call ``run()`` once per refit. Because the transfer order is derived from the payload
alone, every rank of a group issues the same sequence of batches; ``verify_plan()`` proves
it at setup by comparing a fingerprint of the ordered transfer list over each group.

Per stage the loop, on that stage's stream: runs the ``pre`` hooks of a batch
(``LocalParamSpec.begin``), hands the batch to the engine's ``xfer_batch``, then runs the
``post`` hooks. Batches are cut by global bytes so ``pre`` buffers stay bounded, and the cut
points depend on the payload only (identical on every rank). Stages use at most
``num_streams`` CUDA streams round-robin; on CPU there are no streams. A hook-free spec's
``base`` may be a list of tensors, one per index of the param's local dim 0 (the training
side's experts): the engine reads and writes them where they are, so the training side
makes no stacking copy and its extra memory is the engine's staging budget.

Decisions:

- Everything that can be checked locally (a spec for every param this rank holds, shapes
  and dtypes of hook-free specs) is checked in the constructor: no communication has
  happened yet when those errors are raised.
- ``groups`` maps stage -> process group for the stages this rank takes part in; a value
  of ``None`` means the default world. A train rank passes only its own stage.
- The engine's per-batch agreement step runs on the first ``run()`` only; from then on the
  batches are the ones every rank already agreed on, and skipping it removes a host sync
  per batch. A ``pre`` hook that later returns a differently shaped buffer then raises on
  its own rank only (its peers wait for the group's timeout).
- The params outside the bulk path ("other_params") can be made part of the fingerprint
  (``misc_items``) so a disagreement on the packed-broadcast layout is also caught at
  setup; both sides must then pass ``misc_items_by_stage(info)``.

Protocol of one refit on a refit group (both sides, same order): the bulk params of the
stage (``RefitLoop.run``), then that stage's other params as one packed broadcast from the
group's rank 0 (the stage's first train rank): every rank of the group calls
``megatron_reshard.packed.broadcast_packed(packed_layout(misc_items_by_stage(info)[stage]),
group, 0, device, tensors)`` with ``tensors`` (full HF tensors) on rank 0 only. A
generation rank does the bulk of all stages first, then the broadcasts in stage order.
"""

from __future__ import annotations

import hashlib
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_reshard.engine.geometry import Box, box_index, box_shape, rank_region
from megatron_reshard.engine.members import members_problem
from megatron_reshard.engine.transport import (
    all_gather_ints,
    all_reduce,
    control_device,
    group_rank,
    group_size,
)
from megatron_reshard.faults import wait_device
from megatron_reshard.integrity import (MODULUS as CHECKSUM_MODULUS, ChecksumTable, box_checksum,
                                        mismatches, source_overlaps)
from megatron_reshard.layout import MeshInfo, placements_to_plain
from megatron_reshard.metadata import dtype_from_str
from megatron_reshard.spec import HFToLocalParamMap, LocalParamSpec

SIDES = ("src", "dst")
DEFAULT_BATCH_BYTES = 512 << 20
DEFAULT_STAGING_BYTES = 256 << 20

Region = Box  # per tensor dim: [start, stop); the engine's box
MiscItem = tuple[str, tuple[int, ...], torch.dtype]


class PlanMismatchError(RuntimeError):
    """Ranks of one refit group derived different transfer lists from their payloads."""


# --------------------------------------------------------------------------- geometry


def local_region(global_shape: Sequence[int], mesh: MeshInfo, placements: Sequence,
                 rank: int) -> Optional[Region]:
    """The ``[start, stop)`` box of the global tensor that ``rank`` holds, None if not in the mesh.

    DTensor semantics (the engine's geometry): mesh axes that shard one tensor dim apply in
    axis order, each with ``torch.chunk`` rules; a ``PaddedShard`` splits its padded size
    evenly and clips at the real size.
    """
    got = rank_region(global_shape, mesh, placements, rank)
    return None if got is None else got[0]


region_shape = box_shape
region_index = box_index


# ------------------------------------------------------------------------ payload order


def wire_dtype(value: Any) -> torch.dtype:
    """Torch dtype of a payload dtype string (``"torch.bfloat16"``); ValueError if unknown."""
    return dtype_from_str(value)


def stage_params(info: Mapping[str, Any]) -> dict[int, list[dict]]:
    """Bulk params of the payload grouped by PP stage, in payload order.

    Payload order is ``layer_names`` order, then each layer's ``per_layer_params`` order.
    A param without ``pp_stage`` belongs to stage 0.
    """
    per_layer = info.get("per_layer_params", {})
    out: dict[int, list[dict]] = {}
    for layer in info.get("layer_names", []):
        for param in per_layer.get(layer, []):
            out.setdefault(int(param.get("pp_stage", 0)), []).append(param)
    listed = set(info.get("layer_names", []))
    unlisted = [layer for layer, params in per_layer.items() if params and layer not in listed]
    if unlisted:
        raise ValueError(f"refit payload: per_layer_params has layers missing from layer_names: "
                         f"{unlisted}")
    return out


def misc_items_by_stage(info: Mapping[str, Any]) -> dict[int, list[MiscItem]]:
    """Params outside the bulk path (payload ``other_params``) per PP stage, in payload order.

    ``other_params`` is a list of ``{"name", "shape", "dtype", "pp_stage"}`` (the train
    side's form) or a dict ``{name: {"shape", "dtype", "pp_stage"}}``. ``pp_stage`` is
    required when the payload's ``pp_size`` is above 1 (no stage is guessed for a param).
    """
    pp_size = int(info.get("pp_size", 1))
    other = info.get("other_params") or []
    entries = ([(name, entry) for name, entry in other.items()] if isinstance(other, Mapping)
               else [(entry.get("name"), entry) for entry in other])
    out: dict[int, list[MiscItem]] = {}
    seen: set = set()
    for name, entry in entries:
        if not isinstance(name, str) or name in seen:
            raise ValueError(f"other_params: entry {entry!r} has a missing or repeated name")
        seen.add(name)
        stage = entry.get("pp_stage")
        if stage is None:
            if pp_size > 1:
                raise ValueError(f"other_params[{name!r}] has no 'pp_stage' but the payload has "
                                 f"pp_size={pp_size}")
            stage = 0
        if not 0 <= int(stage) < pp_size:
            raise ValueError(f"other_params[{name!r}]: pp_stage={stage} is not in 0..{pp_size - 1}")
        shape = tuple(int(s) for s in entry["shape"])
        out.setdefault(int(stage), []).append((name, shape, wire_dtype(entry["dtype"])))
    return out


def plan_fingerprint(params: Sequence[Mapping[str, Any]],
                     misc_items: Optional[Sequence[MiscItem]] = None,
                     options: Optional[Mapping[str, int]] = None) -> int:
    """63-bit fingerprint of an ordered transfer list (names, shapes, dtypes, meshes, placements),
    plus the misc layout and the options that must match on every rank (batching, staging)."""
    h = hashlib.sha256()
    if options:
        h.update(repr(sorted(options.items())).encode())
    for p in params:
        row = (p["name"], tuple(int(s) for s in p["global_shape"]), str(wire_dtype(p["dtype"])),
               p["src_mesh_info"].key(), tuple(map(_plain_key, placements_to_plain(p["src_placements"]))),
               p["dst_mesh_info"].key(), tuple(map(_plain_key, placements_to_plain(p["dst_placements"]))))
        h.update(repr(row).encode())
    if misc_items is not None:
        h.update(b"|misc|")
        for name, shape, dtype in misc_items:
            h.update(repr((name, tuple(shape), str(dtype))).encode())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def _plain_key(p: dict) -> tuple:
    return tuple(sorted(p.items()))


def batch_bounds(params: Sequence[Mapping[str, Any]], batch_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges cutting ``params`` into batches of at most ``batch_bytes``
    global bytes (at least one param each). Depends on the payload only."""
    bounds, start, acc = [], 0, 0
    for i, p in enumerate(params):
        numel = 1
        for s in p["global_shape"]:
            numel *= int(s)
        nbytes = numel * wire_dtype(p["dtype"]).itemsize
        if i > start and acc + nbytes > batch_bytes:
            bounds.append((start, i))
            start, acc = i, 0
        acc += nbytes
    if start < len(params):
        bounds.append((start, len(params)))
    return bounds


# -------------------------------------------------------------------------------- loop


@dataclass
class StageStats:
    stage: int
    params: int = 0          # params this rank holds a side of
    local_bytes: int = 0     # bytes of this rank's side of those params
    batches: int = 0
    seconds: float = 0.0     # host time to issue the stage (no device sync)


@dataclass
class RefitStats:
    stages: list[StageStats] = field(default_factory=list)
    seconds: float = 0.0     # wall time of run(), device work included when synchronize=True
    # destination side with checksums on: params whose received bytes differ from the sources'
    checksum_mismatches: list[str] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(s.params for s in self.stages)

    @property
    def local_bytes(self) -> int:
        return sum(s.local_bytes for s in self.stages)

    def as_dict(self) -> dict:
        return {"params": self.params, "local_bytes": self.local_bytes, "seconds": self.seconds,
                "stages": [vars(s).copy() for s in self.stages]}


class RefitLoop:
    """One side of the refit of all stages this rank takes part in (see module docstring)."""

    def __init__(
        self,
        refit_info: Mapping[str, Any],
        local_map: HFToLocalParamMap,
        side: str,
        groups: Union[Mapping[int, Optional[Any]], Sequence[Optional[Any]]],
        *,
        num_streams: int = 2,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        misc_items: Optional[Mapping[int, Sequence[MiscItem]]] = None,
        xfer_batch: Optional[Callable[..., None]] = None,
        verify_checksums: bool = False,
    ):
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if num_streams < 1:
            raise ValueError(f"num_streams must be >= 1, got {num_streams}")
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        self.side = side
        self.local_map = local_map
        self.num_streams = num_streams
        self.batch_bytes = batch_bytes
        self.staging_bytes = staging_bytes
        self._xfer_batch = xfer_batch
        self.groups: dict[int, Optional[Any]] = (
            dict(groups) if isinstance(groups, Mapping) else dict(enumerate(groups)))
        all_stages = stage_params(refit_info)
        pp_size = int(refit_info.get("pp_size", 1))
        for stage in self.groups:
            if not 0 <= stage < pp_size:
                raise ValueError(f"refit group given for stage {stage}, but the payload has "
                                 f"pp_size={pp_size}")
        self.stages: dict[int, list[dict]] = {s: all_stages.get(s, []) for s in sorted(self.groups)}
        self.misc_items = None if misc_items is None else {
            s: list(misc_items.get(s, [])) for s in self.stages}
        self._ranks = {s: group_rank(g) for s, g in self.groups.items()}
        self._batches = {s: batch_bounds(ps, batch_bytes) for s, ps in self.stages.items()}
        self._mine = {s: self._check_local(s) for s in self.stages}
        # per param, the engine Transfer's fields but the tensors, built once: the same
        # objects on every call let the engine find its cached batch by identity
        self._fields = {s: [(p["name"], tuple(p["global_shape"]), wire_dtype(p["dtype"]),
                             p["src_mesh_info"], tuple(p["src_placements"]),
                             p["dst_mesh_info"], tuple(p["dst_placements"])) for p in ps]
                        for s, ps in self.stages.items()}
        # batch cut points and staging size shape the engine calls: they must match too
        must_match = {"batch_bytes": batch_bytes, "staging_bytes": staging_bytes,
                      "checksums": int(verify_checksums)}
        self.verify_checksums = verify_checksums
        self._overlap_cache: dict[tuple[int, int], list] = {}
        self.fingerprints = {s: plan_fingerprint(ps, None if self.misc_items is None
                                                 else self.misc_items[s], must_match)
                             for s, ps in self.stages.items()}
        self._verified = False
        self._planner = None
        self._agreed = False  # set once a run went through: later runs skip the agreement
        self._stream_pool: Optional[list] = None

    # -- setup ----------------------------------------------------------------------

    def _check_local(self, stage: int) -> list[Optional[tuple[LocalParamSpec, Region]]]:
        """Per param of the stage: (spec, region) where this rank holds this side, else None.

        Raises before any communication when a spec is missing or a hook-free spec's
        tensor does not match the payload (shape of this rank's region, wire dtype).
        """
        rank = self._ranks[stage]
        mesh_key, pl_key = f"{self.side}_mesh_info", f"{self.side}_placements"
        mine: list[Optional[tuple[LocalParamSpec, Region]]] = []
        for p in self.stages[stage]:
            got = rank_region(p["global_shape"], p[mesh_key], p[pl_key], rank)
            if got is None:
                mine.append(None)
                continue
            region, local_shape = got
            name = p["name"]
            spec = self.local_map.get(name)
            if spec is None:
                raise ValueError(f"{name}: no local spec on {self.side} group rank {rank} of stage "
                                 f"{stage}, which holds region {list(region)} of this param")
            dtype = wire_dtype(p["dtype"])
            base = spec.base
            if spec.pre is None and isinstance(base, (list, tuple)):
                # one tensor per index of dim 0 (the engine's members, engine/members.py)
                device = base[0].device.type if len(base) and isinstance(base[0], torch.Tensor) \
                    else "cpu"
                why = members_problem(base, tuple(local_shape), dtype, device)
                if why:
                    raise ValueError(f"{name}: {self.side} group rank {rank} (stage {stage}) "
                                     f"holds region {list(region)} as a list of tensors: "
                                     f"expected {why}")
            elif spec.pre is None:
                if not isinstance(base, torch.Tensor):
                    raise ValueError(f"{name}: {self.side} group rank {rank} (stage {stage}) has a "
                                     f"spec without pre hook whose base is {type(base).__name__}, "
                                     f"not a tensor")
                if tuple(base.shape) != local_shape:
                    raise ValueError(f"{name}: {self.side} group rank {rank} (stage {stage}) holds "
                                     f"region {list(region)} in a local tensor of shape "
                                     f"{list(local_shape)}, but its local tensor has shape "
                                     f"{list(base.shape)}")
                if base.dtype != dtype:
                    raise ValueError(f"{name}: {self.side} group rank {rank} (stage {stage}): wire "
                                     f"dtype {dtype} but local tensor dtype {base.dtype}")
            mine.append((spec, region))
        return mine

    def verify_plan(self) -> None:
        """Compare plan fingerprints over every group; PlanMismatchError on all ranks if they differ.

        A small all-gather per group, issued in stage order: every rank of a group reaches
        it, so a mismatch is reported everywhere instead of hanging in a transfer.
        """
        for stage, group in self.groups.items():
            fp = self.fingerprints[stage]
            count = len(self.stages[stage])
            seen = all_gather_ints([fp, count], group)
            if any(row != [fp, count] for row in seen):
                rows = "; ".join(f"group rank {r}: fingerprint {f:#x}, {c} transfers"
                                 for r, (f, c) in enumerate(seen))
                raise PlanMismatchError(
                    f"refit plan mismatch in the group of PP stage {stage} (seen from {self.side} "
                    f"group rank {self._ranks[stage]}): {rows}. Every rank must build its plan "
                    f"from the same payload, with the same batch_bytes and staging_bytes, and "
                    f"pass the same misc_items on both sides")
        self._verified = True

    # -- run -----------------------------------------------------------------------

    def _engine(self) -> tuple[Callable[..., None], type]:
        """The batch transfer callable, bound to this loop's options, and the Transfer type.

        The engine's ``xfer_batch`` gets the stage stream, the staging bound and this loop's
        planner (plans and schedules cached for the loop's lifetime); a substitute such as
        ``xfer_batch_reference`` takes the same keywords.
        """
        from megatron_reshard.engine import Planner, Transfer, xfer_batch

        fn = self._xfer_batch or xfer_batch
        if self._planner is None:
            self._planner = Planner()
        # The engine's agreement step (a small all-reduce and a host sync per batch) guards
        # the first run; once every batch went through on every rank, later runs repeat
        # the same batches and skip it, so the host can queue batches ahead of the GPU.
        agree = not self._agreed

        def call(transfers, group, stream):
            fn(transfers, group, stream=stream, staging_bytes=self.staging_bytes,
               planner=self._planner, agree=agree)

        return call, Transfer

    def _streams(self) -> list:
        """The loop's CUDA streams (created once, reused by every run); none on CPU."""
        if self._stream_pool is None:
            if torch.cuda.is_available() and self._uses_cuda():
                count = min(self.num_streams, max(1, len(self.stages)))
                self._stream_pool = [torch.cuda.Stream() for _ in range(count)]
            else:
                self._stream_pool = []
        return self._stream_pool

    def _uses_cuda(self) -> bool:
        for mine in self._mine.values():
            for entry in mine:
                if entry is not None:
                    base = entry[0].base
                    if isinstance(base, (list, tuple)) and base:
                        base = base[0]
                    if isinstance(base, torch.Tensor):
                        return base.is_cuda
        return any(control_device(g).type == "cuda" for g in self.groups.values())

    def run(self, synchronize: bool = True,
            on_write: Optional[Callable[[list[str]], None]] = None) -> RefitStats:
        """Move every stage's params once. Verifies the plan first if not done yet.

        ``on_write(names)`` (destination side) is called before the engine may write the
        named params' storage: a failure after that leaves those params overwritten.
        """
        from megatron_reshard.engine.plan import gc_paused

        if not self._verified:
            self.verify_plan()
        with gc_paused():  # many small objects per param; GC passes would walk the caches
            return self._run(synchronize, on_write)

    def release_staging(self) -> None:
        """Give back the engine's CUDA staging slots kept between refits (at most two of
        ``staging_bytes / 2`` per stage stream); the next refit allocates them again."""
        if self._planner is not None:
            self._planner.release_staging()

    def _run(self, synchronize: bool, on_write) -> RefitStats:
        xfer, transfer_cls = self._engine()
        t0 = time.perf_counter()
        streams = self._streams()
        current = torch.cuda.current_stream() if streams else None
        stats = RefitStats()
        for index, (stage, params) in enumerate(self.stages.items()):
            stream = streams[index % len(streams)] if streams else None
            if stream is not None:
                stream.wait_stream(current)
            run = _StageRun(stage, params, stream, xfer, transfer_cls, StageStats(stage), on_write,
                            ChecksumTable(group_size(self.groups[stage]), len(params))
                            if self.verify_checksums else None)
            ts = time.perf_counter()
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for start, stop in self._batches[stage]:
                    self._send_batch(run, self._open_batch(run, start, stop))
                if run.table is not None:
                    stats.checksum_mismatches += self._check_stage(run)
            run.stats.seconds = time.perf_counter() - ts
            stats.stages.append(run.stats)
        for stream in streams:
            current.wait_stream(stream)
        if synchronize and streams:
            wait_device(current.device, self.groups.values(), "the end of the refit")
        self._agreed = True
        stats.seconds = time.perf_counter() - t0
        return stats

    def _send_batch(self, run: "_StageRun", batch: "_OpenBatch") -> None:
        """Hand an opened batch to the engine, checksum it if asked, run its post hooks."""
        if run.on_write is not None and self.side == "dst" and batch.opened:
            run.on_write([run.params[i]["name"] for i, _, _ in batch.opened])
        run.xfer(batch.transfers, self.groups[run.stage], run.stream)
        run.stats.batches += 1
        if run.table is not None:
            self._checksum_batch(run, batch)
        for _, spec, ctx in batch.opened:
            spec.finish(ctx)

    def _checksum_batch(self, run: "_StageRun", batch: "_OpenBatch") -> None:
        """Sources: the checksum of each overlap with a destination region, into the stage's
        table; destinations: the checksum of the region received (before any post hook)."""
        mine = self._mine[run.stage]
        for i, _, ctx in batch.opened:
            region = mine[i][1]
            origin = tuple(a for a, _ in region)
            if self.side == "src":
                for dst, sub in self._overlaps(run.stage, i):
                    run.table.add(dst, i, _checksum(ctx.buf, sub, origin))
            else:
                run.got[i] = _checksum(ctx.buf, region, origin)

    def _overlaps(self, stage: int, index: int) -> list:
        """(destination rank, box) this source counts for a param; from the payload alone,
        so computed once per loop."""
        key = (stage, index)
        got = self._overlap_cache.get(key)
        if got is None:
            got = self._overlap_cache[key] = source_overlaps(self.stages[stage][index],
                                                             self._ranks[stage])
        return got

    def _check_stage(self, run: "_StageRun") -> list[str]:
        """One SUM all-reduce of the stage's table; a destination compares its own row."""
        group = self.groups[run.stage]
        table = run.table.dense(control_device(group))
        all_reduce(table, group, dist.ReduceOp.SUM, f"the checksum exchange of stage {run.stage}")
        if self.side != "dst":
            return []
        names = [p["name"] for p in run.params]
        return mismatches(table[self._ranks[run.stage]], run.got, names)

    def _open_batch(self, run: "_StageRun", start: int, stop: int) -> "_OpenBatch":
        """Run the pre hooks of one batch; its open contexts and its engine transfers."""
        mine = self._mine[run.stage]
        fields = self._fields[run.stage]
        batch = _OpenBatch([], [])
        for i in range(start, stop):
            local = None
            if mine[i] is not None:
                spec = mine[i][0]
                ctx = spec.begin()
                batch.opened.append((i, spec, ctx))
                # a pre-hook buffer of the wrong shape or dtype is left to the engine, which
                # rejects it on every rank of the group at once (raising here would strand
                # the peers inside this batch's collectives)
                local = ctx.buf
                run.stats.params += 1
                # the owned region: padding rows of a padded shard do not travel
                run.stats.local_bytes += math.prod(region_shape(mine[i][1])) * fields[i][2].itemsize
            name, shape, dtype, src_mesh, src_pl, dst_mesh, dst_pl = fields[i]
            batch.transfers.append(run.transfer_cls(
                name=name, global_shape=shape, dtype=dtype, src_mesh=src_mesh,
                src_placements=src_pl, dst_mesh=dst_mesh, dst_placements=dst_pl,
                src=local if self.side == "src" else None,
                dst=local if self.side == "dst" else None))
        return batch


def _checksum(buf, box: Box, origin: tuple) -> torch.Tensor:
    """``box_checksum`` of a tensor, or of a list of tensors (one per index of dim 0): the
    checksum is a sum over the box's elements, so it is the sum of the members' parts."""
    if not isinstance(buf, (list, tuple)):
        return box_checksum(buf, box, origin)
    total = None
    for g in range(*box[0]):
        part = box_checksum(buf[g - origin[0]].unsqueeze(0), ((g, g + 1),) + tuple(box[1:]),
                            (g,) + tuple(origin[1:]))
        total = part if total is None else (total + part).remainder_(CHECKSUM_MODULUS)
    return total if total is not None else torch.zeros((), dtype=torch.int64)


@dataclass
class _StageRun:
    """What one stage's part of one run works with."""

    stage: int
    params: list
    stream: Any
    xfer: Callable
    transfer_cls: type
    stats: StageStats
    on_write: Optional[Callable[[list[str]], None]]
    table: Optional[ChecksumTable]  # with checksums on
    got: dict = field(default_factory=dict)  # destination: param index -> checksum received


@dataclass
class _OpenBatch:
    """A batch whose pre hooks ran: (param index, spec, ctx) per local param, and transfers."""

    opened: list
    transfers: list
