"""Meshes from reported rank coordinates (synthetic coordinates; the live ones are in test_megatron_source)."""

import pytest

from megatron_reshard.layout.placements import build_mesh_info
from megatron_reshard.megatron.parallel import (
    RankCoords,
    TrainParallelism,
    build_stage_meshes,
    describe_rank_order,
    is_default_rank_order,
)


def default_order_coords(tp, cp, dp, pp, ep):
    """Megatron's default tp-cp-ep-dp-pp numbering (dense) and etp-ep-edp-pp (experts, ETP = 1)."""
    world = tp * cp * dp * pp
    edp = world // (ep * pp)
    coords = []
    for rank in range(world):
        t, rest = rank % tp, rank // tp
        c, rest = rest % cp, rest // cp
        d, p = rest % dp, rest // dp
        e, rest = rank % ep, rank // ep
        ed = rest % edp
        coords.append(RankCoords(rank=rank, tp=t, cp=c, dp=d, pp=p, ep=e, etp=0, edp=ed))
    layout = TrainParallelism(tp=tp, pp=pp, ep=ep, etp=1, dp=dp, cp=cp, edp=edp, world_size=world)
    return coords, layout


@pytest.mark.parametrize("tp,cp,dp,pp,ep", [(2, 2, 2, 1, 2), (2, 1, 2, 2, 4), (1, 1, 4, 1, 1), (4, 1, 1, 2, 2),
                                            (1, 2, 1, 3, 2)])
def test_default_order_reproduces_build_mesh_info(tp, cp, dp, pp, ep):
    coords, layout = default_order_coords(tp, cp, dp, pp, ep)
    stages = build_stage_meshes(coords, layout)
    per_stage = layout.world_size // pp
    for s in stages:
        assert (s.dense, s.dense_dims) == build_mesh_info(per_stage, 0, tp_size=tp)
        assert (s.expert, s.expert_dims) == build_mesh_info(per_stage, 0, ep_size=ep)
        assert s.ranks == tuple(range(s.stage * per_stage, (s.stage + 1) * per_stage))
    assert is_default_rank_order(stages, layout)


def test_rank_order_is_named():
    coords, layout = default_order_coords(2, 1, 2, 2, 1)
    assert describe_rank_order(coords, layout) == "tp-dp-pp"
    swapped = [RankCoords(rank=c.rank, tp=c.dp, cp=0, dp=c.tp, pp=c.pp, ep=0, etp=0, edp=c.edp) for c in coords]
    assert describe_rank_order(swapped, layout) == "dp-tp-pp"
    stages = build_stage_meshes(swapped, layout)
    assert stages[1].dense.mesh.tolist() == [[0, 2], [1, 3]]
    assert not is_default_rank_order(stages, layout)


def test_incomplete_grid_is_refused_naming_the_clash():
    coords, layout = default_order_coords(2, 1, 2, 1, 1)
    broken = list(coords)
    broken[3] = RankCoords(rank=3, tp=0, cp=0, dp=1, pp=0, ep=0, etp=0, edp=3)  # two ranks claim (dp1, tp0)
    with pytest.raises(ValueError, match=r"non-expert mesh of PP stage 0: stage-local ranks 2 and 3 both claim"):
        build_stage_meshes(broken, layout)


def test_unsupported_layouts_are_listed():
    layout = TrainParallelism(tp=2, pp=1, ep=2, etp=2, dp=2, cp=1, edp=1, world_size=8, vpp=2)
    problems = layout.problems()
    assert any("expert tensor parallel size 2" in p for p in problems)
    assert any("virtual pipeline" in p for p in problems)
    assert any("default torch.distributed world has 8" in p for p in problems)
