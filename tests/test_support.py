"""check_nccl_reshard_refit_support: NeMo-RL's config rules, every violation in one ValueError."""

import copy
from types import SimpleNamespace

import pytest

from megatron_reshard.support import check_nccl_reshard_refit_support, nccl_reshard_refit_violations


def good_policy():
    return {
        "precision": "bfloat16",
        "megatron_cfg": {
            "enabled": True,
            "tensor_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
            "expert_model_parallel_size": 4,
            "pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": None,
            "pipeline_model_parallel_layout": None,
            "num_layers_in_first_pipeline_stage": 3,
            "num_layers_in_last_pipeline_stage": 5,
            "fp8_cfg": {"enabled": False, "fp8_param": False},
        },
        "dtensor_cfg": {"enabled": False},
        "generation": {
            "backend": "vllm",
            "colocated": {"enabled": False},
            "vllm_cfg": {"tensor_parallel_size": 4, "expert_parallel_size": 4, "precision": "bfloat16"},
            "vllm_kwargs": {},
        },
    }


def cfg(**policy_updates):
    """``master_config`` as NeMo-RL passes it (an object with ``.policy``), dotted-key updates."""
    policy = copy.deepcopy(good_policy())
    for dotted, value in policy_updates.items():
        node = policy
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return SimpleNamespace(policy=policy)


def problems_of(**policy_updates):
    return nccl_reshard_refit_violations(cfg(**policy_updates))


# ---- reading the config -------------------------------------------------------------------


def test_supported_config_passes_silently():
    assert check_nccl_reshard_refit_support(cfg()) is None


def test_mapping_with_policy_key_is_read_like_an_object():
    assert check_nccl_reshard_refit_support({"policy": good_policy()}) is None
    bad = {"policy": cfg(generation__backend="sglang").policy}
    with pytest.raises(ValueError, match="policy.generation.backend"):
        check_nccl_reshard_refit_support(bad)


def test_attribute_style_nested_sections_are_read():
    policy = SimpleNamespace(**good_policy())
    policy.generation = SimpleNamespace(**{**policy.generation, "backend": "sglang"})
    with pytest.raises(ValueError, match="policy.generation.backend must be 'vllm' \\(got 'sglang'\\)"):
        check_nccl_reshard_refit_support(SimpleNamespace(policy=policy))


def test_neither_mapping_nor_policy_object_is_a_type_error():
    with pytest.raises(TypeError, match="policy"):
        check_nccl_reshard_refit_support(42)


def test_minimal_config_uses_schema_defaults():
    # Absent colocated / ETP / vLLM sizes / FP8 keys read as their defaults, which pass.
    minimal = {"precision": "bfloat16", "generation": {"backend": "vllm"}, "megatron_cfg": {"enabled": True}}
    assert nccl_reshard_refit_violations(SimpleNamespace(policy=minimal)) == []


def test_empty_policy_needs_vllm_and_megatron():
    problems = nccl_reshard_refit_violations({"policy": {}})
    assert [p.split(" ")[0] for p in problems] == ["policy.generation.backend", "policy.megatron_cfg.enabled"]


# ---- one rule each ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "update, key",
    [
        ({"generation__colocated__enabled": True}, "policy.generation.colocated.enabled"),
        ({"generation__backend": "sglang"}, "policy.generation.backend"),
        ({"generation__vllm_kwargs__enable_eplb": True}, "policy.generation.vllm_kwargs.enable_eplb"),
        ({"generation__real_quant": True}, "policy.generation.real_quant"),
        ({"dtensor_cfg__enabled": True}, "policy.dtensor_cfg.enabled"),
        ({"megatron_cfg__expert_tensor_parallel_size": 2}, "policy.megatron_cfg.expert_tensor_parallel_size"),
        ({"megatron_cfg__pipeline_model_parallel_layout": [["embedding"], ["loss"]]},
         "policy.megatron_cfg.pipeline_model_parallel_layout"),
        ({"megatron_cfg__virtual_pipeline_model_parallel_size": 2},
         "policy.megatron_cfg.virtual_pipeline_model_parallel_size"),
        ({"megatron_cfg__account_for_embedding_in_pipeline_split": True},
         "policy.megatron_cfg.account_for_embedding_in_pipeline_split"),
        ({"megatron_cfg__account_for_loss_in_pipeline_split": True},
         "policy.megatron_cfg.account_for_loss_in_pipeline_split"),
        ({"generation__vllm_cfg__expert_parallel_size": 2}, "policy.generation.vllm_cfg.expert_parallel_size"),
        ({"generation__vllm_cfg__pipeline_parallel_size": 2}, "policy.generation.vllm_cfg.pipeline_parallel_size"),
        ({"generation__vllm_cfg__precision": "float16"}, "policy.generation.vllm_cfg.precision"),
    ],
)
def test_each_rule_rejects_alone_naming_its_key_and_the_value_found(update, key):
    problems = problems_of(**update)
    assert len(problems) == 1, problems
    assert problems[0].startswith(key)
    with pytest.raises(ValueError, match="1 problem\\)"):
        check_nccl_reshard_refit_support(cfg(**update))


def test_megatron_disabled_is_a_violation_and_skips_megatron_only_rules():
    # With Megatron off, its parallel and precision settings are not judged.
    problems = problems_of(megatron_cfg__enabled=False, megatron_cfg__expert_tensor_parallel_size=2,
                           generation__vllm_cfg__precision="float16")
    assert len(problems) == 1 and problems[0].startswith("policy.megatron_cfg.enabled must be True")


def test_non_vllm_backend_skips_the_vllm_size_rules():
    problems = problems_of(generation__backend="sglang", generation__vllm_cfg__pipeline_parallel_size=2)
    assert len(problems) == 1 and problems[0].startswith("policy.generation.backend")


@pytest.mark.parametrize("etp", [1, None])
def test_expert_tensor_parallel_one_or_unset_is_fine(etp):
    assert problems_of(megatron_cfg__expert_tensor_parallel_size=etp) == []


@pytest.mark.parametrize("vpp", [1, None])
def test_virtual_pipeline_one_or_unset_is_fine(vpp):
    assert problems_of(megatron_cfg__virtual_pipeline_model_parallel_size=vpp) == []


@pytest.mark.parametrize("ep", [1, 4])
def test_vllm_expert_parallel_one_or_equal_to_tp_is_fine(ep):
    assert problems_of(generation__vllm_cfg__expert_parallel_size=ep) == []


def test_context_parallel_and_uneven_pipeline_stages_are_not_rejected():
    assert problems_of(megatron_cfg__context_parallel_size=4) == []


def test_every_violation_is_reported_in_one_error():
    bad = cfg(generation__colocated__enabled=True, generation__backend="sglang",
              generation__vllm_kwargs__enable_eplb=True, megatron_cfg__expert_tensor_parallel_size=2,
              megatron_cfg__virtual_pipeline_model_parallel_size=4, generation__vllm_cfg__precision="fp8")
    with pytest.raises(ValueError) as err:
        check_nccl_reshard_refit_support(bad)
    message = str(err.value)
    assert "(6 problems)" in message
    for key in ("policy.generation.colocated.enabled", "policy.generation.backend",
                "policy.generation.vllm_kwargs.enable_eplb", "policy.megatron_cfg.expert_tensor_parallel_size",
                "policy.megatron_cfg.virtual_pipeline_model_parallel_size", "policy.generation.vllm_cfg.precision"):
        assert f"  - {key}" in message


# ---- precision pairs ----------------------------------------------------------------------


def precision(train="bfloat16", gen="bfloat16", is_mx=None, fp8_param=False, recipe=None):
    vllm_cfg = {**good_policy()["generation"]["vllm_cfg"], "precision": gen}
    if is_mx is not None:
        vllm_cfg["is_mx"] = is_mx
    return problems_of(precision=train, generation__vllm_cfg=vllm_cfg,
                       megatron_cfg__fp8_cfg={"fp8_param": fp8_param, "fp8_recipe": recipe})


@pytest.mark.parametrize("gen", [None, "auto", "bf16", "bfloat16"])
def test_bf16_generation_spellings_are_accepted(gen):
    assert precision(gen=gen) == []


def test_blockwise_fp8_storage_to_fp8_is_accepted():
    assert precision(gen="fp8", fp8_param=True, recipe="blockwise") == []


def test_bf16_storage_to_mxfp8_is_accepted():
    assert precision(gen="fp8", is_mx=True) == []


@pytest.mark.parametrize("gen", ["float16", "float32", "fp8_e4m3", "mxfp8"])
def test_other_generation_precisions_are_rejected(gen):
    problems = precision(gen=gen)
    assert len(problems) == 1 and f"policy.generation.vllm_cfg.precision must be one of" in problems[0]
    assert repr(gen) in problems[0]


@pytest.mark.parametrize("train", ["float16", "float32", "bf16", None])
def test_mxfp8_needs_policy_precision_spelled_bfloat16(train):
    problems = precision(train=train, gen="fp8", is_mx=True)
    assert len(problems) == 1 and "requires policy.precision='bfloat16'" in problems[0]
    assert f"(got {train!r})" in problems[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "delayed", None])
def test_fp8_storage_needs_the_blockwise_recipe(recipe):
    problems = precision(gen="fp8", fp8_param=True, recipe=recipe)
    assert len(problems) == 1 and problems[0].startswith("policy.megatron_cfg.fp8_cfg.fp8_recipe must be 'blockwise'")


def test_fp8_generation_from_bf16_storage_without_mx_is_rejected():
    problems = precision(gen="fp8")
    assert len(problems) == 1 and "is_mx=True for BF16-to-MXFP8 refit" in problems[0]


def test_mxfp8_from_fp8_storage_is_rejected():
    problems = precision(gen="fp8", is_mx=True, fp8_param=True, recipe="blockwise")
    assert len(problems) == 1 and "does not support blockwise-FP8 storage" in problems[0]


@pytest.mark.parametrize("gen", [None, "bfloat16", "auto"])
def test_fp8_storage_without_fp8_generation_is_rejected(gen):
    problems = precision(gen=gen, fp8_param=True, recipe="blockwise")
    assert len(problems) == 1 and problems[0].startswith("policy.megatron_cfg.fp8_cfg.fp8_param=True requires")


def test_unknown_generation_precision_with_fp8_storage_reports_both():
    problems = precision(gen="float16", fp8_param=True, recipe="blockwise")
    assert [p.split(" ")[0].split("=")[0] for p in problems] == [
        "policy.generation.vllm_cfg.precision", "policy.megatron_cfg.fp8_cfg.fp8_param"]


def test_messages_do_not_say_fp8_is_refit_by_this_project():
    # The rules mirror the seed's; the project itself does not refit FP8 yet.
    for problems in (precision(gen="fp8"), precision(gen="float16"), precision(gen="bf16", fp8_param=True)):
        for p in problems:
            assert "supported pair" not in p and "supported:" not in p
