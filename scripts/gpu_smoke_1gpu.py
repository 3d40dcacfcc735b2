"""One-GPU smoke check of the CUDA paths that need no second GPU (run on a lent 1-GPU kind).

    python scripts/gpu_smoke_1gpu.py

A one-rank NCCL refit group (made by ``groups.create_refit_group``, so it has a fault board):
the engine's local-copy path on CUDA (contiguous and strided destinations) against slicing,
the checksum of the same box on CUDA and on CPU (they must be equal: the receiver and the
sources may sit on different devices), the fault-aware device wait and the commit vote
over NCCL. Prints one line per check and "GPU SMOKE OK" at the end; exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.refit.commit import commit_refit
from megatron_reshard.engine import Planner, Transfer, xfer_batch
from megatron_reshard.groups.faults import wait_device
from megatron_reshard.refit.integrity import box_checksum
from megatron_reshard.layout.placements import MeshInfo
from megatron_reshard.tools.worlds import free_ports


def main() -> int:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    group = create_refit_group("127.0.0.1", free_ports(1)[0], 0, 1, "nccl", 60.0, device=dev,
                               who="smoke rank 0", label="one-rank smoke group")
    mesh = MeshInfo(torch.tensor([0]))
    ok = True
    full = torch.randn(4096, 2048, device=dev).to(torch.bfloat16)
    wide = torch.zeros(4096, 4096, device=dev, dtype=torch.bfloat16)
    cases = {"contiguous": torch.zeros_like(full), "strided (right half of a wider tensor)":
             wide[:, 2048:]}
    planner = Planner()
    for name, dst in cases.items():
        t = Transfer(name="w", global_shape=tuple(full.shape), dtype=full.dtype, src_mesh=mesh,
                     src_placements=[Shard(0)], dst_mesh=mesh, dst_placements=[Replicate()],
                     src=full, dst=dst)
        for agree in (True, False):
            dst.zero_()
            xfer_batch([t], group, planner=planner, agree=agree)
            wait_device(dev, [group], "the smoke transfer")
            good = torch.equal(dst, full)
            ok &= good
            print(f"local copy, {name}, agree={agree}: {'bit-exact' if good else 'MISMATCH'}")
    box = ((100, 3000), (7, 2000))
    on_gpu = int(box_checksum(full, box, (0, 0)))
    on_cpu = int(box_checksum(full.cpu(), box, (0, 0)))
    ok &= on_gpu == on_cpu
    print(f"checksum CUDA {on_gpu} vs CPU {on_cpu}: {'equal' if on_gpu == on_cpu else 'DIFFER'}")
    outcome = commit_refit({0: group}, side="src", version=7, checksum_failed=False, pp_size=1)
    ok &= outcome.ok and outcome.version == 7
    print(f"commit vote over NCCL: {outcome}")
    destroy_refit_group(group)
    print("GPU SMOKE OK" if ok else "GPU SMOKE FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
