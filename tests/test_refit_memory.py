"""Extra memory of a refit on CPU: no stacking buffer for separate expert tensors, and
the peak extra memory of either side within the staging budget (bench/memory.py's
profiler-based measure), while the refit stays bit-exact (checksums on)."""

import torch

from megatron_reshard.groups.comm import create_refit_group
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info
from megatron_reshard.layout.geometry import box_index, rank_box
from megatron_reshard.refit.loop import RefitLoop
from megatron_reshard.refit.order import stage_params
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec

E, I, H = 8, 64, 96       # experts: [8, 64, 96] fp32 = 192 KiB, 96 KiB per train rank
STAGING = 24 << 10        # a quarter of one rank's experts
SMALL = 24                # small params of one layout (fused)


def _info():
    meta = {f"model.layers.0.mlp.experts.{e}.up_proj.weight": {"shape": [I, H],
                                                             "dtype": "torch.float32"}
            for e in range(E)}
    for i in range(SMALL):
        meta[f"model.layers.0.mlp.bias{i}.weight"] = {"shape": [2 * I],
                                                      "dtype": "torch.float32"}
    return build_nccl_reshard_refit_info(meta, {"tp_size": 2, "ep_size": 2}, {"tp_size": 2},
                                         2, 2)


def _full(name, shape):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _memory_job(job, stack_experts: bool):
    from megatron_reshard.tools.bench.memory import measure_cpu_peak_extra
    from megatron_reshard.megatron.source import stacked_spec

    info = _info()
    group = create_refit_group(job.host, job.port, job.rank, 4, "gloo", 30.0)
    side = "src" if job.rank < 2 else "dst"
    specs, expect = HFToLocalParamMap(), {}
    for p in stage_params(info)[0]:
        shape = p.global_shape
        region = rank_box(shape, p.mesh(side), p.placements(side), job.rank)
        full = _full(p.name, shape)
        if side == "src" and p.grouped_expert_proj:
            experts = [full[e].clone() for e in range(*region[0])]  # apart, as Megatron's
            spec = stacked_spec(experts)
            if stack_experts:  # what the source did before: a stacking pre hook
                from megatron_reshard.wire.spec import RefitCtx
                spec = LocalParamSpec(base=experts, pre=lambda b: RefitCtx(buf=torch.stack(b)))
            specs.specs[p.name] = spec
        elif side == "src":
            specs.specs[p.name] = LocalParamSpec(base=full[box_index(region)].clone())
        else:
            dst = torch.full([b - a for a, b in region], float("nan"))
            expect[p.name] = (dst, full[box_index(region)])
            specs.specs[p.name] = LocalParamSpec(base=dst)
    # checksums on: the receiver compares what it got with the sources' (lists included)
    checked = RefitLoop(info, specs, side, {0: group}, staging_bytes=STAGING,
                        verify_checksums=True).run()
    exact = all(torch.equal(d, want) for d, want in expect.values())
    for d, _ in expect.values():
        d.fill_(float("nan"))
    # memory with checksums off: their int64 temporaries (integrity.py) come on top
    loop = RefitLoop(info, specs, side, {0: group}, staging_bytes=STAGING)
    loop.run()  # first refit: plans, agreement and caches
    _, peak = measure_cpu_peak_extra(loop.run)
    exact = exact and all(torch.equal(d, want) for d, want in expect.values())
    return side, peak, exact, checked.checksum_mismatches


def test_peak_extra_memory_of_either_side_stays_within_the_staging_budget(pool):
    results = pool.run(_memory_job, 4, False, timeout_s=120)
    print("peak extra bytes per rank:", [(side, peak) for side, peak, _, _ in results])
    for side, peak, exact, mismatches in results:
        assert exact and mismatches == [], (side, mismatches)
        assert 0 < peak <= STAGING, f"{side}: peak extra {peak} bytes > budget {STAGING}"


def test_the_measure_sees_a_stacking_buffer_above_the_budget(pool):
    # the same refit with the experts stacked by a pre hook (96 KiB per train rank)
    results = pool.run(_memory_job, 4, True, timeout_s=120)
    peaks = {side: peak for side, peak, _, _ in results}
    print("with a stacking pre hook:", [(side, peak) for side, peak, _, _ in results])
    assert peaks["src"] > STAGING, peaks
