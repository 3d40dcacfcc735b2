"""Qwen3-Next / Qwen3.5 text are refused, precisely, before any collective.

What blocks them is pinned here too: megatron-core 0.16.1 builds its Gated-DeltaNet block
spec only with Transformer Engine (absent on this CPU machine), so the day a CPU build works
the first test fails and says so. The refusals run on real megatron-core models (CPU, gloo,
two ranks): Qwen3-Next's gated full attention (``attention_output_gate``) builds with the
local spec; a Gated-DeltaNet config is a real ``TransformerConfig`` megatron-core validates.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_reshard.megatron.families import FAMILIES
from megatron_reshard.megatron.unsupported_families import NOT_YET_SUPPORTED, family_problem
from megatron_reshard.tools.worlds import init_gloo_world

pytestmark = pytest.mark.filterwarnings("ignore")

SPEC = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, head_dim=16,
            ffn_hidden_size=48, vocab_size=200, qk_layernorm=True)
GDN = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
           linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4)


def test_qwen3_next_families_are_named_as_not_supported_yet_and_not_as_unknown():
    for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        assert family in NOT_YET_SUPPORTED and family not in FAMILIES
        msg = family_problem(family)
        assert f"model family {family!r} is not supported yet" in msg
        assert "Transformer Engine" in msg and "in_proj_qkvz" in msg and "A_log" in msg
    assert family_problem("glm4_moe") is None and family_problem("qwen3") is None


def _refusals(job):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_reshard.megatron.source import MegatronRefitSource
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, transformer_config

    init_gloo_world(job)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=1)
    base = transformer_config(TinyGPTSpec(**SPEC))
    out = {}

    def model_of(config):
        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        return GPTModel(config=config, transformer_layer_spec=layers, vocab_size=256,
                        max_sequence_length=64, position_embedding_type="rope")

    def attempt(key, model, **kwargs):
        try:
            MegatronRefitSource(model, gen_parallelism={"tp_size": 2, "ep_size": 1, "pp_size": 1},
                                gen_world_size=2, vocab_size=200, **kwargs)
            out[key] = None
        except ValueError as err:
            out[key] = str(err)

    gated = model_of(dataclasses.replace(base, attention_output_gate=True))
    out["gated_qkv_rows"] = int(gated.decoder.layers[0].self_attention.linear_qkv.weight.shape[0])
    attempt("gated_attention", gated, family="qwen3")
    attempt("named_family", model_of(base), family="qwen3_next")
    gdn_config = dataclasses.replace(base, **GDN)  # megatron-core validates the fields
    try:
        get_transformer_block_with_experimental_attention_variant_spec(gdn_config)
        out["gdn_spec"] = None
    except (AssertionError, NameError, ImportError) as err:
        out["gdn_spec"] = f"{type(err).__name__}: {err}"
    attempt("gated_delta_net", model_of(gdn_config))
    dist.barrier()  # no rank was left inside a collective
    return out


def test_gated_and_linear_attention_models_are_refused_on_every_rank(pool):
    for rank, r in enumerate(pool.run(_refusals, 2)):
        # megatron-core 0.16.1 cannot build a Gated-DeltaNet block on CPU (no Transformer
        # Engine): its TE spec provider is not defined
        assert r["gdn_spec"] is not None and "TESpecProvider" in r["gdn_spec"], r["gdn_spec"]
        # the gate doubles the q rows of this rank's linear_qkv: 2 q heads x 16 x 2 + k + v
        assert r["gated_qkv_rows"] == 2 * 16 * 2 + 2 * 16
        assert "attention_output_gate=True" in r["gated_attention"], (rank, r["gated_attention"])
        assert "model family 'qwen3_next' is not supported yet" in r["named_family"], rank
        assert "experimental_attention_variant='gated_delta_net'" in r["gated_delta_net"], rank
