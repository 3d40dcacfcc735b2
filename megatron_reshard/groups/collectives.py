"""Small collectives and facts about a refit group, for the protocol above the engine.

Rank, size, which device carries control tensors, and the blocking all-reduce /
all-gather the refit protocol votes with. They work on a registered ``ProcessGroup``, on a
backend built directly (``groups/comm.py``) and on ``None`` (the default world); on refit
groups they wait through the fault board, so a dead peer is an error, not a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputError
from megatron_reshard.groups.faults import wait_collective, wait_device


def resolve_group(group):
    """The group to talk over: ``None`` means the default world."""
    if group is None:
        if not dist.is_initialized():
            raise BadInputError("group is None and no default process group is initialised")
        return dist.group.WORLD
    return group


def backend_name(group) -> str:
    """'gloo', 'nccl', ... for a ProcessGroup or a raw backend object."""
    for attr in ("_get_backend_name", "name"):
        fn = getattr(group, attr, None)
        if fn is not None:
            try:
                name = str(fn()).lower()
            except Exception:
                continue
            for known in ("nccl", "gloo", "ucc", "mpi"):
                if known in name:
                    return known
    return str(dist.get_backend(group)).lower()



def group_rank(group) -> int:
    """This process's rank in ``group`` (a raw/registered ProcessGroup, or None = default world)."""
    return dist.get_rank() if group is None else group.rank()


def group_size(group) -> int:
    return dist.get_world_size() if group is None else group.size()


def control_device(group) -> torch.device:
    """Device for small control tensors on ``group``: the current CUDA device for NCCL, else CPU."""
    try:
        name = backend_name(resolve_group(group))
    except Exception:  # noqa: BLE001 - an unknown group kind talks over the CPU
        name = ""
    if name == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, group, op, what: str) -> None:
    """In-place all-reduce over ``group`` (blocking for the host; fault-aware on refit groups)."""
    if group is None:
        dist.all_reduce(tensor, op=op)
        return
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    wait_collective(group.allreduce([tensor], opts), group, what)
    if tensor.is_cuda:
        wait_device(tensor.device, [group], what)


def all_gather_ints(values, group, what: str = "an all-gather") -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), by group rank."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=control_device(group))
    out = [torch.empty_like(mine) for _ in range(group_size(group))]
    if group is None:
        dist.all_gather(out, mine)
    else:
        wait_collective(group.allgather([out], [mine]), group, what)
        if mine.is_cuda:
            wait_device(mine.device, [group], what)
    return [t.cpu().tolist() for t in out]
