"""Small params of one layout moved as one: a batch's transfers fused along a new dim 0.

A refit batch holds hundreds of small params that share a layout (norms, biases, the
projections of many layers). Each costs the host a few views and copies per call (~25 µs
per strided param on CPU/gloo, a kernel launch each on CUDA). Fused, ``n`` transfers of one
layout key and dtype become one transfer of global shape ``[n, *shape]`` whose placements
shard dim ``d + 1`` where the members shard dim ``d``: dim 0 is never sharded, so every
rank owns exactly the members' boxes, stacked. Per call a rank then stacks its source
shards into one tensor (one ``torch.stack``), the engine moves the fused transfer as any
other, and the received image is copied into the members' destinations (one
``_foreach_copy_``): O(1) Python work per group instead of per param.

Which transfers fuse is decided from the batch description alone (layout keys, dtypes,
global sizes, the staging budget), so every rank of the group fuses alike and derives the
same schedule. A layout whose destination pieces do not cover a rank's whole local tensor
(padded shards) is never fused: writing the whole image back would overwrite the padding;
nor is one that sends nothing between ranks (local copies only, already one batch of
copies: fused, the stack and the scatter would triple the bytes copied).

Memory: a rank holds its fused sources' stack and destinations' image during the call, at
most ``2 * fused_bytes`` (global bytes of the fused transfers, capped at an eighth of the
staging budget); the schedule gets the staging budget minus that, so the call's extra
memory stays within the budget.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .checks import picker
from .copies import as_bits
from megatron_reshard.layout.geometry import REPLICATE, box_numel
from .members import any_members, is_members
from .param_plan import LayoutKey, ParamPlan
from .plan import Planner

FUSE_MAX_BYTES = 1 << 20  # a param of more global bytes moves on its own
FUSE_SHARE = 8            # fused bytes per batch: at most staging_bytes / FUSE_SHARE


class Exec(NamedTuple):
    """One transfer as the schedule and program see it: an original transfer or a fused
    group (``members``: indices of the original transfers, stacked along dim 0)."""

    name: str
    dtype: torch.dtype
    members: Optional[tuple]  # None: the original transfer ``index`` as it is
    index: int
    # members only: pick their sources / destinations from the call's ``tensors`` list
    # (src of transfer i at 2 * i, dst at 2 * i + 1; see execute.py)
    srcs: Optional[Callable[[Sequence], tuple]] = None
    dsts: Optional[Callable[[Sequence], tuple]] = None


class Fusion(NamedTuple):
    """How a batch runs fused (plain data, cached on the batch)."""

    execs: tuple          # tuple[Exec, ...], in order of their first member
    plans: tuple          # the plan of each exec
    fused_bytes: int      # global bytes of the fused transfers


def shift_dims(dims: tuple) -> tuple:
    """Placement dims of a layout key, for the tensor with one more leading dim."""
    return tuple(d if d == REPLICATE else (d[0] + 1, d[1]) if isinstance(d, tuple) else d + 1
                 for d in dims)


def _covers(plan: ParamPlan) -> bool:
    """Every destination rank's pieces tile its whole local tensor (no padding)."""
    for own in plan.dst.values():
        total = 1
        for n in own.local_shape:
            total *= n
        if sum(box_numel(p.box) for p in own.pieces) != total:
            return False
    return True


def plan_fusion(transfers: Sequence, plans: Sequence[ParamPlan], staging_bytes: int,
                planner: Planner) -> Optional[Fusion]:
    """The batch's fusion, or None when no two transfers fuse (see the module docstring)."""
    cap = staging_bytes // FUSE_SHARE
    groups: dict = {}   # (layout key, dtype) -> member indices
    first: dict = {}    # transfer index -> its group key (only the group's first member)
    used = 0
    for i, (t, plan) in enumerate(zip(transfers, plans)):
        shape = plan.key.global_shape
        nbytes = t.dtype.itemsize
        for n in shape:
            nbytes *= n
        if (not shape or nbytes > FUSE_MAX_BYTES or used + nbytes > cap or not _covers(plan)
                or all(op.src == op.dst for op in plan.ops)):
            continue  # local copies only: fused, each byte would be copied three times
        gkey = (plan.key, t.dtype)
        members = groups.get(gkey)
        if members is None:
            members = groups[gkey] = []
            first[i] = gkey
        members.append(i)
        used += nbytes
    fused = {i for members in groups.values() if len(members) > 1 for i in members}
    if not fused:
        return None
    execs, exec_plans, fused_bytes = [], [], 0
    for i, (t, plan) in enumerate(zip(transfers, plans)):
        if i not in fused:
            execs.append(Exec(t.name, t.dtype, None, i))
            exec_plans.append(plan)
            continue
        gkey = first.get(i)
        if gkey is None:
            continue  # a later member of a group placed at its first member
        members = tuple(groups[gkey])
        shape, s_shape, s_ranks, s_dims, d_shape, d_ranks, d_dims = plan.key
        key = LayoutKey((len(members), *shape), s_shape, s_ranks, shift_dims(s_dims),
                        d_shape, d_ranks, shift_dims(d_dims))
        execs.append(Exec(f"{len(members)} fused params from {t.name!r}", t.dtype, members, i,
                          picker([2 * m for m in members]), picker([2 * m + 1 for m in members])))
        exec_plans.append(planner.plan(key))
        fused_bytes += len(members) * t.dtype.itemsize * box_numel(tuple((0, n) for n in shape))
    return Fusion(tuple(execs), tuple(exec_plans), fused_bytes)


class ExecTransfer(NamedTuple):
    """What the program reads of a transfer: name, dtype and this rank's two tensors."""

    name: str
    dtype: torch.dtype
    src: Optional[torch.Tensor]
    dst: Optional[torch.Tensor]


def fused_tensors(fusion: Fusion, transfers: Sequence, plans: Sequence[ParamPlan],
                  me: int, tensors: list) -> tuple[list, list, list]:
    """This call's exec transfers, their tensors (two per exec, as ``tensors`` in
    execute.py) and the scatter work: ``[(image, [member destinations])]``. ``tensors``:
    the call's own (src, dst per transfer).

    Sources are stacked (a copy of this rank's member shards); destinations get a fresh
    image, copied into the members by ``scatter`` once the transfer is done."""
    execs, out, scatter = [], [], []
    for ex in fusion.execs:
        lead_src, lead_dst = tensors[2 * ex.index], tensors[2 * ex.index + 1]
        if ex.members is None:
            execs.append(ExecTransfer(ex.name, ex.dtype, lead_src, lead_dst))
            out += (lead_src, lead_dst)
            continue
        src = None
        if lead_src is not None:
            srcs = ex.srcs(tensors)
            src = torch.stack([_dense(x) for x in srcs] if any_members(srcs) else srcs)
        dst = None
        if lead_dst is not None:
            outs = ex.dsts(tensors)
            first = outs[0][0] if is_members(outs[0]) else outs[0]
            dst = torch.empty((len(outs), *plans[ex.index].dst[me].local_shape),
                              dtype=ex.dtype, device=first.device)
            scatter.append((dst, outs))
        execs.append(ExecTransfer(ex.name, ex.dtype, src, dst))
        out += (src, dst)
    return execs, out, scatter


def _dense(x) -> torch.Tensor:
    """A source as one tensor (a list of members, see members.py, stacked: small here)."""
    return torch.stack(list(x)) if is_members(x) else x


def scatter(work: list) -> None:
    """Copy each received image into its members' destinations, as integers on CUDA
    (a float copy there rewrites NaN payloads)."""
    for image, outs in work:
        if not all(isinstance(o, torch.Tensor) or is_members(o) for o in outs):
            # destinations in a kernel's permuted-row order among them (small params)
            for o, part in zip(outs, image.unbind(0)):
                _write_one(o, part)
        elif any_members(outs):  # a destination given as a list of members
            pairs = [(m, p) for o, part in zip(outs, as_bits(image).unbind(0))
                     for m, p in (zip(o, part.unbind(0)) if is_members(o) else [(o, part)])]
            torch._foreach_copy_([as_bits(m) for m, _ in pairs], [p for _, p in pairs])
        elif image.device.type == "cpu":
            # one C++ loop of copies, no Python view per member (~0.3 µs each); a CPU copy
            # of one dtype moves bits (tests/test_engine_host_path.py checks NaN payloads)
            torch.unbind_copy(image, 0, out=list(outs))
        else:  # CUDA: multi-tensor copy kernels
            torch._foreach_copy_([as_bits(o) for o in outs], as_bits(image).unbind(0))


def _write_one(out, part: torch.Tensor) -> None:
    """One member's image into its destination: a tensor, a list of members, or a box in a
    kernel's permuted-row order (``layout.permuted_rows.PermutedRows``)."""
    if is_members(out):
        for m, p in zip(out, part.unbind(0)):
            as_bits(m).copy_(as_bits(p))
    elif isinstance(out, torch.Tensor):
        as_bits(out).copy_(as_bits(part))
    else:
        out.write(part)
