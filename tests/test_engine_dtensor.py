"""``xferdtensor`` takes what NeMo-RL's callers pass: torch DTensors, DTensorRefs and any
object with ``._local_tensor`` (the local shard) and ``.shape`` (the global shape)."""

import torch

from megatron_reshard.engine import DTensorRef

FULL = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)


def test_dtensor_ref_exposes_the_names_a_dtensor_has():
    local = torch.zeros(3, 4)
    ref = DTensorRef(local, (6, 4))
    assert ref._local_tensor is local
    assert ref.shape == torch.Size([6, 4]) and ref.global_shape == (6, 4)


class _LookAlike:
    """Neither a DTensor nor a DTensorRef: only the two names the engine reads."""

    def __init__(self, local, global_shape):
        self._local_tensor = local
        self.shape = torch.Size(global_shape)


def _torch_dtensor(job):
    """Shard(0) -> Shard(1) on a 2-rank DeviceMesh, both sides real torch DTensors; the
    DeviceMesh itself is passed as the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from megatron_reshard.engine import xferdtensor
    from megatron_reshard.tools.worlds import init_gloo_world

    init_gloo_world(job, timeout_s=30)
    mesh = init_device_mesh("cpu", (2,))
    src = distribute_tensor(FULL.clone(), mesh, [Shard(0)])
    dst = DTensor.from_local(torch.zeros(6, 2), mesh, [Shard(1)], run_check=False)
    assert isinstance(src, DTensor) and tuple(src.shape) == (6, 4)
    xferdtensor(src, mesh, [Shard(0)], dst, mesh, [Shard(1)], None, name="w")
    return dst._local_tensor.clone()


def test_torch_dtensors_on_a_device_mesh(pool):
    got = pool.run(_torch_dtensor, 2, timeout_s=60)
    for rank in range(2):
        assert torch.equal(got[rank], torch.chunk(FULL, 2, dim=1)[rank])


def _look_alikes(job, kind):
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import xferdtensor
    from megatron_reshard.layout.placements import MeshInfo
    from megatron_reshard.tools.worlds import init_gloo_world

    init_gloo_world(job, timeout_s=30)
    wrap = {"look_alike": _LookAlike, "dtensor_ref": DTensorRef}[kind]
    sm, dm = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    src = wrap(FULL.clone(), (6, 4)) if job.rank == 0 else None
    dst = wrap(torch.zeros(6, 4), (6, 4)) if job.rank == 1 else None
    xferdtensor(src, sm, [Shard(0)], dst, dm, [Shard(0)], None, name="w")
    return None if dst is None else dst._local_tensor


def test_objects_with_a_local_tensor_and_a_global_shape(pool):
    assert torch.equal(pool.run(_look_alikes, 2, "look_alike", timeout_s=60)[1], FULL)


def test_dtensor_refs_as_before(pool):
    assert torch.equal(pool.run(_look_alikes, 2, "dtensor_ref", timeout_s=60)[1], FULL)


def _plain_tensor(job):
    from torch.distributed.tensor import Shard

    from megatron_reshard.engine import xferdtensor
    from megatron_reshard.layout.placements import MeshInfo
    from megatron_reshard.tools.worlds import init_gloo_world

    init_gloo_world(job, timeout_s=30)
    sm, dm = MeshInfo(torch.tensor([0])), MeshInfo(torch.tensor([1]))
    src = FULL.clone() if job.rank == 0 else None  # a bare tensor: no global shape
    dst = DTensorRef(torch.zeros(6, 4), (6, 4)) if job.rank == 1 else None
    try:
        xferdtensor(src, sm, [Shard(0)], dst, dm, [Shard(0)], None, name="w")
    except ValueError as exc:
        return str(exc)
    return None


def test_a_bare_tensor_is_refused_on_every_rank(pool):
    for msg in pool.run(_plain_tensor, 2, timeout_s=60):
        assert msg is not None and "'w' on rank 0" in msg
        assert "must be a DTensor, a DTensorRef or an object with ._local_tensor" in msg
        assert "found Tensor" in msg
