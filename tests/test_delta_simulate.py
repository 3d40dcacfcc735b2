"""Delta refits on paper (tools/simulate.py ``changed=``): the expected-size model against
the real encoder, and the accounting of bytes and messages against the full refit's."""

import pytest
import torch

from megatron_reshard.delta.encoding import encode
from megatron_reshard.delta.wire_format import HEADER_BYTES
from megatron_reshard.tools.plan_inputs import RefitParallelism
from megatron_reshard.tools.simulate import LinkModel, delta_bytes_per_element, simulate


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.018, 0.05, 0.3])
def test_the_expected_size_matches_what_the_encoder_cuts(fraction):
    # one unit in the last place up or down at random places, as an optimizer step moves
    # BF16 weights; a few elements cross zero (escaped: sent whole)
    g = torch.Generator().manual_seed(3)
    numel = 1 << 20
    old = torch.randn(numel, generator=g).to(torch.bfloat16)
    pick = torch.rand(numel, generator=g) < fraction
    step = torch.where(torch.rand(numel, generator=g) < 0.5, 1, -1).to(torch.int16)
    new = (old.view(torch.int16) + step * pick.to(torch.int16)).view(torch.bfloat16)
    hits = pick.nonzero().reshape(-1)[::500]
    new[hits] = -new[hits]
    _, _, payload = encode(new, old)
    model = delta_bytes_per_element(fraction, 2, escape=hits.numel() / max(1, int(pick.sum())))
    assert payload.numel() == pytest.approx(model * numel, rel=0.02), fraction


def test_the_cost_per_element_is_bounded_by_dense_and_grows_with_the_fraction():
    costs = [delta_bytes_per_element(f, 2) for f in (0, 0.001, 0.01, 0.1, 0.5, 1)]
    assert costs[0] == 0 and costs[-1] == 2
    assert costs == sorted(costs) and max(costs) == 2


def _cfg():
    return dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=4, qk_norm=True, intermediate_size=48,
                num_experts=4, moe_intermediate_size=16, vocab_size=100,
                tie_word_embeddings=False)


def _pairs(lay):
    """Every (sender, receiver) of the default planner's plans, global ranks."""
    from megatron_reshard.engine.plan import Planner
    from megatron_reshard.tools.plan_inputs import stage_inputs
    from megatron_reshard.tools.simulate import _global, plan_pairs

    out = set()
    for stage, st in stage_inputs(lay, _cfg(), "sharded", "bf16").items():
        for p in st.params:
            if p.key is not None:
                for s, d in plan_pairs(Planner().plan(p.key)):
                    out.add((_global(s, stage, lay.stage_world),
                             _global(d, stage, lay.stage_world)))
    return out


def test_a_delta_refit_on_paper_moves_headers_plus_the_changed_fraction():
    lay = RefitParallelism(train_world=4, gen_world=4, train_tp=1, train_ep=4, gen_tp=4)
    full = simulate("small", _cfg(), lay, LinkModel(), "sharded")
    whole = simulate("small", _cfg(), lay, LinkModel(), "sharded", changed=1.0)
    none = simulate("small", _cfg(), lay, LinkModel(), "sharded", changed=0.0)
    assert none.ops == whole.ops == full.ops  # the same regions
    # at 100% changed every region goes dense, plus its header; at 0% headers only
    for r in range(4):
        assert whole.gen_received[r] - none.gen_received[r] == full.gen_received[r]
    assert sum(none.gen_received.values()) == HEADER_BYTES * full.ops
    # messages: two per rank pair per batch (one batch here), not one per region
    pairs = _pairs(lay)
    assert sum(none.loads.msgs.values()) == 2 * 2 * len(pairs)  # counted at both ends
    assert sum(full.loads.msgs.values()) == 2 * full.ops > sum(none.loads.msgs.values())
    assert whole.to_plain()["mode"] == "delta" and full.to_plain()["mode"] == "full"


def test_batches_multiply_the_messages():
    lay = RefitParallelism(train_world=4, gen_world=4, train_tp=1, train_ep=4, gen_tp=4)
    one = simulate("small", _cfg(), lay, LinkModel(), "sharded", changed=0.01)
    many = simulate("small", _cfg(), lay, LinkModel(), "sharded", changed=0.01, batch_bytes=1)
    assert sum(many.loads.msgs.values()) > sum(one.loads.msgs.values())
    assert many.gen_received == one.gen_received
