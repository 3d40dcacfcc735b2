"""The multimodal Qwen3.5 types are refused, precisely, before any collective (the text
types refit); Qwen3-Next's hybrid layers are refused under any other family name.

Pinned here too: megatron-core 0.16.1's own Gated-DeltaNet block spec asserts Transformer
Engine (absent on this CPU machine), which is why the tests build GatedDeltaNet with local
modules (``testing.megatron_models.gated_delta_net_block_spec``). The refusals run on real
megatron-core models (CPU, gloo, two ranks): gated full attention (``attention_output_gate``)
with the local spec; a Gated-DeltaNet model with megatron-core's own ``GatedDeltaNet``.
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
GDN_SPEC = dict(GDN, attention_output_gate=True)


def test_multimodal_qwen3_5_is_named_as_not_supported_yet_and_its_text_model_refits():
    for family in ("qwen3_5", "qwen3_5_moe"):
        assert family in NOT_YET_SUPPORTED and family not in FAMILIES
        msg = family_problem(family)
        assert f"model family {family!r} is not supported yet" in msg
        assert "vision tower" in msg and "family='qwen3_5_text'" in msg
    for family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        assert family_problem(family) is None and family in FAMILIES
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
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model, transformer_config

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
    attempt("named_family", model_of(base), family="qwen3_5")
    attempt("ungated_qwen3_next", model_of(base), family="qwen3_next")
    gdn_config = dataclasses.replace(base, **GDN)  # megatron-core validates the fields
    try:
        get_transformer_block_with_experimental_attention_variant_spec(gdn_config)
        out["gdn_spec"] = None
    except (AssertionError, NameError, ImportError) as err:
        out["gdn_spec"] = f"{type(err).__name__}: {err}"
    gdn = build_gpt_model(TinyGPTSpec(**SPEC, **GDN_SPEC))
    out["gdn_layers"] = [type(layer.self_attention).__name__ for layer in gdn.decoder.layers]
    attempt("gated_delta_net", gdn, family="qwen3")
    try:  # no family named: Qwen3-Next or Qwen3.5? Their checkpoints name the layers apart
        out["inferred_family"] = MegatronRefitSource(
            gdn, gen_parallelism={"tp_size": 2, "ep_size": 1, "pp_size": 1}, gen_world_size=2,
            vocab_size=200).family
    except ValueError as err:
        out["inferred_family"] = str(err)
    dist.barrier()  # no rank was left inside a collective
    return out


def test_gated_and_linear_attention_models_are_refused_on_every_rank(pool):
    for rank, r in enumerate(pool.run(_refusals, 2)):
        # megatron-core 0.16.1's own Gated-DeltaNet block spec needs Transformer Engine (its
        # TE spec provider is not defined here); the local-module spec builds the real layers
        assert r["gdn_spec"] is not None and "TESpecProvider" in r["gdn_spec"], r["gdn_spec"]
        assert r["gdn_layers"] == ["GatedDeltaNet"] * 3 + ["SelfAttention"], r["gdn_layers"]
        # the gate doubles the q rows of this rank's linear_qkv: 2 q heads x 16 x 2 + k + v
        assert r["gated_qkv_rows"] == 2 * 16 * 2 + 2 * 16
        assert "attention_output_gate=True" in r["gated_attention"], (rank, r["gated_attention"])
        assert "model family 'qwen3_5' is not supported yet" in r["named_family"], rank
        assert "expects attention_output_gate=True" in r["ungated_qwen3_next"], rank
        assert "experimental_attention_variant='gated_delta_net'" in r["gated_delta_net"], rank
        assert "pass family='qwen3_next'" in r["gated_delta_net"], rank
        assert "cannot infer the model family of a Gated-DeltaNet model" in r["inferred_family"], \
            (rank, r["inferred_family"])
        assert "pass family=" in r["inferred_family"] and "qwen3_5_text" in r["inferred_family"], rank
