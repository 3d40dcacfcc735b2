"""A generation TP size vLLM cannot split the attention over is refused when the
``MegatronRefitSource`` is built (before any collective), naming the heads and the KV
groups, with the words the demo's option check uses: one rule,
``megatron.gen_split.gen_tp_problem`` (issue 50, item 5: tp 3 and 16 over 8 heads in 2 KV
groups were accepted by the library, refused only by the demo).

Live megatron-core (CPU, gloo, one spawned process per call of the shared pool)."""

from __future__ import annotations

import pytest

from megatron_reshard.megatron.gen_split import gen_tp_problem
from megatron_reshard.tools.run_config import RefitRunConfig

# 8 heads in 2 KV groups, the moe demo preset's attention
SPEC = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
            ffn_hidden_size=64, vocab_size=256)


def _source_errors(job, tps):
    from megatron.core import parallel_state as ps

    from megatron_reshard.megatron.source import MegatronRefitSource
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.tools.worlds import init_gloo_world

    init_gloo_world(job)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, distributed_timeout_minutes=1)
    model = build_gpt_model(TinyGPTSpec(**SPEC))
    out = {}
    for tp in tps:
        try:
            source = MegatronRefitSource(model, gen_parallelism={"tp_size": tp, "ep_size": 1,
                                                                 "pp_size": 1},
                                         gen_world_size=tp, family="qwen3")
        except ValueError as err:
            out[tp] = str(err)
        else:
            out[tp] = None if source.gen_parallelism["tp_size"] == tp else "wrong tp"
    ps.destroy_model_parallel()
    return out


def test_the_source_refuses_a_gen_tp_vllm_cannot_split_naming_heads_and_groups(pool):
    errors = pool.run(_source_errors, 1, (3, 16, 4, 8))[0]
    for tp in (3, 16):
        text = errors[tp]
        assert text is not None, f"gen tp {tp} was accepted over 8 heads in 2 KV groups"
        assert text.startswith(f"gen_parallelism['tp_size']={tp}: "), text
        assert "8 attention heads in 2 KV groups" in text, text
        assert f"8 query heads do not split over tp_size={tp}" in text, text
        assert text.endswith(gen_tp_problem(tp, 8, 2)), text  # the demo's words too
    assert errors[4] is None and errors[8] is None, errors  # KV heads replicated over TP


@pytest.mark.parametrize("tp,words", [
    (3, "8 query heads do not split over tp_size=3"),
    (16, "8 query heads do not split over tp_size=16"),
    (6, "8 query heads do not split over tp_size=6"),
])
def test_the_demo_refuses_with_the_library_rule(tp, words):
    cfg = RefitRunConfig(model="moe", gen_world=tp, gen_tp=tp)
    problems = [p for p in cfg.problems() if p.startswith("--gen-tp")]
    assert len(problems) == 1 and words in problems[0], problems
    assert problems[0].endswith(gen_tp_problem(tp, 8, 2)), problems


def test_the_rule_covers_kv_groups_and_gated_delta_net_key_heads():
    assert gen_tp_problem(4, 8, 2) is None and gen_tp_problem(1, 8, 2) is None
    assert "tp_size=4 is not a multiple of 3 KV heads" in gen_tp_problem(4, 12, 3)
    assert "8 KV heads do not split over tp_size=6" in gen_tp_problem(6, 12, 8)
    why = gen_tp_problem(8, 16, 2, linear_key_heads=4)
    assert why is not None and "4 Gated-DeltaNet key heads do not split over tp_size=8" in why
    assert "and 4 Gated-DeltaNet key heads" in why
