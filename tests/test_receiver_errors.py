"""Bad input fails on the receiver before any communication, naming the param and the rank.

The groups given to ``ReceiverSession`` here only answer ``rank()``/``size()``/``name()``:
any attempt to communicate would fail with AttributeError instead of the checked error.
"""

import pytest
import torch

from megatron_reshard.receiver import MegatronReshardWorkerExtension, ReceiverSession, TargetError
from megatron_reshard.receiver.coverage import UncoveredParamsError
from megatron_reshard.receiver.full_weights import load_full_weights
from megatron_reshard.receiver.targets import VllmTargets
from megatron_reshard.testing.groups import NoCommGroup
from megatron_reshard.testing.vllm_like import build_plain_payload, build_vllm_like_model, random_hf_state_dict
from megatron_reshard.wire.check import RefitPayloadError

DENSE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             intermediate_size=64, num_hidden_layers=1, vocab_size=100, tie_word_embeddings=False,
             gated=True, qk_norm=True, family="qwen3")
MOE = dict(DENSE, num_experts=8, moe_intermediate_size=32, family="qwen3_moe")


def _targets(cfg, tp, rank=0, ep=1, dtype=torch.bfloat16, claimed_tp=None):
    model = build_vllm_like_model(cfg, rank, tp, ep, dtype)
    return model, VllmTargets.from_named_parameters(model.named_parameters(), cfg, rank,
                                                    claimed_tp or tp, ep, label="gen rank 0")


def _session(cfg, gen, model_dtype=torch.bfloat16, mutate=None, gen_rank=0, **kwargs):
    full = random_hf_state_dict(cfg, seed=0)
    tp, ep = gen["tp_size"], gen.get("ep_size", 1)
    payload = build_plain_payload(cfg, full, {"tp_size": 2}, gen, 2, tp)
    if mutate:
        mutate(payload)
    model = build_vllm_like_model(cfg, gen_rank % tp, tp, ep, model_dtype)
    return ReceiverSession(payload, model.named_parameters(), {0: NoCommGroup(2 + gen_rank, 2 + tp)},
                           **kwargs)


def test_a_valid_payload_prepares_without_communicating():
    session = _session(MOE, {"tp_size": 2, "ep_size": 2}, gen_rank=1)
    rep = session.report()
    assert (rep["gen_rank"], rep["tp_rank"], rep["ep_rank"], rep["ep_size"]) == (1, 1, 1, 2)
    assert rep["params"] == 3 and rep["uncovered_targets"] == {}


def test_unknown_hf_name_is_named():
    _, targets = _targets(DENSE, 2)
    with pytest.raises(TargetError, match=r"model\.layers\.0\.self_attn\.rotary_emb\.inv_freq: unknown HF "
                                          r"name on gen rank 0 \(tp_rank 0 of 2"):
        load_full_weights(targets, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})


def test_nothing_is_written_when_one_name_is_bad():
    model, targets = _targets(DENSE, 2)
    full = random_hf_state_dict(DENSE)
    with pytest.raises(TargetError, match="bogus.weight"):
        load_full_weights(targets, {**full, "bogus.weight": torch.zeros(2)})
    assert all(torch.isnan(p).all() for p in model.parameters())


def test_missing_fused_target_is_named():
    _, targets = _targets(DENSE, 2)
    del targets.params["model.layers.0.self_attn.qkv_proj.weight"]
    with pytest.raises(TargetError, match=r"k_proj\.weight: missing target on gen rank 0.*"
                                          r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'"):
        load_full_weights(targets, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16)})


def test_missing_expert_target_names_both_nestings():
    _, targets = _targets(MOE, 2)
    del targets.params["model.layers.0.mlp.experts.w2_weight"]
    with pytest.raises(TargetError, match=r"experts\.w2_weight' or .*experts\.routed_experts\.w2_weight'"):
        targets.resolve("model.layers.0.mlp.experts.down_proj.weight", (8, 64, 32))


def test_shape_mismatch_is_named_with_both_shapes():
    _, targets = _targets(DENSE, 2, claimed_tp=4)  # storage for TP 2, coordinates say TP 4
    with pytest.raises(TargetError, match=r"o_proj\.weight: shape mismatch on gen rank 0.*\[64, 64\]"):
        targets.resolve("model.layers.0.self_attn.o_proj.weight", (64, 128))


def test_gate_proj_into_non_gated_experts_is_refused():
    _, targets = _targets(dict(MOE, gated=False), 2)
    with pytest.raises(TargetError, match="non-gated experts"):
        targets.resolve("model.layers.0.mlp.experts.gate_proj.weight", (8, 32, 64))


def test_wire_and_target_dtype_mismatch_names_both_dtypes():
    with pytest.raises(TargetError, match=r"gate_proj\.weight: dtype mismatch on gen rank 0.*wire dtype "
                                          r"torch\.bfloat16.*dtype torch\.float32"):
        _session(DENSE, {"tp_size": 2}, model_dtype=torch.float32)


def test_unsupported_schema_version_is_refused():
    def bump(payload):
        payload["schema_version"] = 2

    with pytest.raises(ValueError, match=r"refit group rank 2: unsupported schema_version 2"):
        _session(DENSE, {"tp_size": 2}, mutate=bump)


def test_uneven_experts_over_gen_ep_map_onto_vllms_blocks():
    # 6 experts over EP4: vLLM gives ranks 0..3 blocks of 2, 2, 1, 1 experts
    for gen_rank, local in ((0, 2), (2, 1), (3, 1)):
        rep = _session(dict(MOE, num_experts=6), {"tp_size": 4, "ep_size": 4},
                       gen_rank=gen_rank).report()
        assert rep["uncovered_targets"] == {}, (gen_rank, rep["uncovered_targets"])


def test_a_payload_with_torch_chunk_expert_blocks_is_refused_where_vllm_differs():
    def chunk_blocks(payload):  # torch.chunk rules: 2, 2, 2, 0 experts
        for params in payload["per_layer_params"].values():
            for p in params:
                for pl in p["dst_placements"]:
                    if pl.get("blocks"):
                        del pl["blocks"]

    with pytest.raises(TargetError, match=r"experts\.gate_proj\.weight: the payload delivers region "
                                          r"\[\(4, 6\).*gen rank 2.*expects \[\[\(4, 5\)"):
        _session(dict(MOE, num_experts=6), {"tp_size": 4, "ep_size": 4}, gen_rank=2,
                 mutate=chunk_blocks)


def test_payload_region_that_vllm_does_not_hold_here_is_refused():
    def swap_gen_ranks(payload):  # the payload's gen mesh lists the two gen ranks reversed
        for params in payload["per_layer_params"].values():
            for p in params:
                p["dst_mesh_info"]["mesh"] = p["dst_mesh_info"]["mesh"][::-1]

    with pytest.raises(TargetError, match=r"gate_proj\.weight: the payload delivers region "
                                          r"\[\(32, 64\), \(0, 64\)\] to gen rank 0.*expects \[\[\(0, 32\)"):
        _session(DENSE, {"tp_size": 2}, mutate=swap_gen_ranks)


def test_misc_params_need_a_stage_when_training_uses_pp():
    full = random_hf_state_dict(DENSE)
    payload = build_plain_payload(DENSE, full, {"tp_size": 1, "pp_size": 2}, {"tp_size": 1}, 2, 1,
                                  {"model.layers.0": 0, "model.embed_tokens": 0, "model.norm": 1,
                                   "lm_head": 1})
    norm = next(e for e in payload["other_params"] if e["name"] == "model.norm.weight")
    del norm["pp_stage"]
    model = build_vllm_like_model(DENSE, 0, 1)
    groups = {0: NoCommGroup(1, 2), 1: NoCommGroup(1, 2)}
    with pytest.raises(ValueError, match=r"refit payload .*other_params entry 'model\.norm\.weight': "
                                         r"pp_stage must be in 0\.\.1, found None"):
        ReceiverSession(payload, model.named_parameters(), groups)


def test_worker_extension_phases_must_come_in_order():
    class Worker(MegatronReshardWorkerExtension):
        def get_refit_model(self):
            return build_vllm_like_model(DENSE, 0, 1)

    w = Worker()
    report = w.report()
    assert report["prepared"] is False
    assert report["weights"]["state"] == "consistent" and report["weights"]["version"] is None
    with pytest.raises(RuntimeError, match="before init_refit_groups"):
        w.prepare_refit({"schema_version": 1})
    with pytest.raises(RuntimeError, match="before prepare_refit"):
        w.refit()


def test_gen_rank_that_vllm_numbers_differently_is_refused():
    with pytest.raises(ValueError, match=r"places gen rank 1 at TP rank 1 of 2, but vLLM reports TP rank 0 of 2"):
        _session(DENSE, {"tp_size": 2}, gen_rank=1, vllm_tp=(0, 2))
    _session(DENSE, {"tp_size": 2}, gen_rank=1, vllm_tp=(1, 2))


def test_a_worker_without_a_world_cannot_derive_its_refit_rank():
    class Worker(MegatronReshardWorkerExtension):
        def get_refit_model(self):
            return build_vllm_like_model(DENSE, 0, 1)

    with pytest.raises(RuntimeError, match=r"group_rank=None\) needs vLLM's or the default"):
        Worker().init_refit_groups("127.0.0.1", [1], None, 3, "gloo", 1.0)


def test_a_derived_refit_rank_must_be_the_same_in_every_stage_group():
    class Worker(MegatronReshardWorkerExtension):
        def get_refit_gen_coords(self):
            return 1, 2  # gen rank 1 of 2

    with pytest.raises(ValueError, match=r"different ranks per stage \{0: 3, 1: 4\}"):
        Worker().init_refit_groups("127.0.0.1", [1, 2], None, [4, 5], "gloo", 1.0)


def _tp1_payload_on_a_tp2_model(**kwargs):
    """A payload built for gen TP 1 (two replicas) meeting gen rank 0 of a TP 2 model."""
    payload = build_plain_payload(DENSE, random_hf_state_dict(DENSE, seed=0), {"tp_size": 2},
                                  {"tp_size": 1}, 2, 2)
    model = build_vllm_like_model(DENSE, 0, 2, 1, torch.bfloat16)
    return ReceiverSession(payload, model.named_parameters(), {0: NoCommGroup(2, 4)}, **kwargs)


@pytest.mark.parametrize("vllm_tp,how", [(None, r"its model\.embed_tokens\.weight holds 64 of "
                                                 r"the 128 padded vocab rows"),
                                         ((0, 2), "vLLM's tensor parallel size")])
def test_a_payload_for_another_gen_tp_says_so_plainly(vllm_tp, how):
    with pytest.raises(RefitPayloadError, match=r"refit group rank 2: payload built for gen TP 1, "
                                                r"this worker runs TP 2 \(" + how):
        _tp1_payload_on_a_tp2_model(vllm_tp=vllm_tp)


def _with_extra_params(model):
    for name in ("model.layers.0.self_attn.o_proj.bias", "model.norm.extra_scale"):
        module, leaf = name.rsplit(".", 1)
        model.get_submodule(module).register_parameter(
            leaf, torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16), requires_grad=False))
    return model


def _session_with_extras(**kwargs):
    payload = build_plain_payload(DENSE, random_hf_state_dict(DENSE, seed=0), {"tp_size": 2},
                                  {"tp_size": 2}, 2, 2)
    model = _with_extra_params(build_vllm_like_model(DENSE, 0, 2, 1, torch.bfloat16))
    return ReceiverSession(payload, model.named_parameters(), {0: NoCommGroup(2, 4)}, **kwargs)


def test_params_the_payload_does_not_write_are_refused_by_name():
    with pytest.raises(UncoveredParamsError, match=r"refit group rank 2 \(gen rank 0\): the payload "
                                                   r"writes no bytes to 2 param\(s\).*o_proj\.bias "
                                                   r"\(64 elements\), model\.norm\.extra_scale"):
        _session_with_extras()
    with pytest.raises(UncoveredParamsError, match=r"writes no bytes to 1 param\(s\) of this model: "
                                                   r"model\.norm\.extra_scale"):
        _session_with_extras(keep_as_loaded=["*.o_proj.bias"])
    rep = _session_with_extras(keep_as_loaded=["*.o_proj.bias", "model.norm.extra_scale"]).report()
    assert rep["kept_as_loaded"] == ["model.layers.0.self_attn.o_proj.bias", "model.norm.extra_scale"]


@pytest.mark.parametrize("keep,words", [
    (["*.o_proj.bias", "model.norm.extra_scale", "model.norm.weight"],
     r"entries \['model\.norm\.weight'\] match no param that this payload leaves unwritten"),
    (["*.o_proj.bias", "model.norm.extra_scale", "no.such.*"], r"entries \['no\.such\.\*'\]"),
    ("model.norm.extra_scale", "expected a list of vLLM param names")])
def test_a_keep_as_loaded_entry_that_matches_nothing_unwritten_is_an_error(keep, words):
    with pytest.raises((UncoveredParamsError, TypeError), match=words):
        _session_with_extras(keep_as_loaded=keep)
