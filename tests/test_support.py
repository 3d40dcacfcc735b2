"""check_nccl_reshard_refit_support: every violation, in one ValueError, naming its key."""

import copy
from types import SimpleNamespace

import pytest

from megatron_reshard.support import check_nccl_reshard_refit_support, nccl_reshard_refit_violations


def good_config():
    return {
        "policy": {
            "precision": "bfloat16",
            "megatron_cfg": {
                "enabled": True,
                "tensor_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1,
                "expert_model_parallel_size": 4,
                "pipeline_model_parallel_size": 2,
                "context_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": None,
                "num_layers_in_first_pipeline_stage": 3,
                "num_layers_in_last_pipeline_stage": 5,
                "fp8_cfg": {"enabled": False},
            },
            "generation": {
                "backend": "vllm",
                "colocated": {"enabled": False},
                "vllm_cfg": {"tensor_parallel_size": 2, "precision": "bfloat16", "vllm_kwargs": {}},
            },
        }
    }


def with_key(dotted, value, cfg=None):
    cfg = copy.deepcopy(cfg or good_config())
    node = cfg
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


def without_key(dotted):
    cfg = good_config()
    node = cfg
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    del node[last]
    return cfg


def test_supported_config_passes_silently():
    assert check_nccl_reshard_refit_support(good_config()) is None


def test_object_with_policy_attribute_is_accepted():
    assert check_nccl_reshard_refit_support(SimpleNamespace(policy=good_config()["policy"])) is None


def test_object_with_attribute_style_nested_config_is_read():
    policy = SimpleNamespace(**good_config()["policy"])
    policy.generation = SimpleNamespace(**{**policy.generation, "backend": "sglang"})
    with pytest.raises(ValueError, match="policy.generation.backend"):
        check_nccl_reshard_refit_support(SimpleNamespace(policy=policy))


def test_neither_mapping_nor_policy_object_is_a_type_error():
    with pytest.raises(TypeError, match="policy"):
        check_nccl_reshard_refit_support(42)


def test_context_parallel_is_supported():
    assert nccl_reshard_refit_violations(with_key("policy.megatron_cfg.context_parallel_size", 4)) == []


def test_uneven_first_and_last_pipeline_stages_are_supported():
    assert nccl_reshard_refit_violations(good_config()) == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("policy.generation.colocated.enabled", True),
        ("policy.generation.backend", "megatron"),
        ("policy.generation.vllm_cfg.enable_eplb", True),
        ("policy.generation.vllm_cfg.vllm_kwargs.enable_eplb", True),
        ("policy.generation.vllm_cfg.quantization", "awq"),
        ("policy.generation.vllm_cfg.vllm_kwargs.quantization", "gptq"),
        ("policy.megatron_cfg.fp8_cfg.fp8_param", True),
        ("policy.megatron_cfg.enabled", False),
        ("policy.megatron_cfg.expert_tensor_parallel_size", 2),
        ("policy.megatron_cfg.virtual_pipeline_model_parallel_size", 2),
        ("policy.megatron_cfg.pipeline_model_parallel_layout", [["embedding", "decoder"], ["decoder", "loss"]]),
        ("policy.generation.vllm_cfg.pipeline_parallel_size", 2),
    ],
)
def test_each_rule_rejects_naming_its_key(key, value):
    with pytest.raises(ValueError) as err:
        check_nccl_reshard_refit_support(with_key(key, value))
    assert key in str(err.value)
    assert len(nccl_reshard_refit_violations(with_key(key, value))) == 1


@pytest.mark.parametrize(
    "key", ["policy.generation.colocated.enabled", "policy.generation.backend", "policy.megatron_cfg.enabled"]
)
def test_missing_required_keys_are_violations(key):
    problems = nccl_reshard_refit_violations(without_key(key))
    assert len(problems) == 1 and key in problems[0] and "missing" in problems[0]


def test_unset_expert_tp_with_tp_above_one_is_expert_tp_above_one():
    problems = nccl_reshard_refit_violations(with_key("policy.megatron_cfg.expert_tensor_parallel_size", None))
    assert len(problems) == 1
    assert "expert_tensor_parallel_size" in problems[0] and "tensor_model_parallel_size=2" in problems[0]


def test_unset_expert_tp_with_tp_one_is_fine():
    cfg = with_key("policy.megatron_cfg.tensor_model_parallel_size", 1)
    assert nccl_reshard_refit_violations(with_key("policy.megatron_cfg.expert_tensor_parallel_size", None, cfg)) == []


def test_virtual_pipeline_size_one_is_fine():
    assert nccl_reshard_refit_violations(with_key("policy.megatron_cfg.virtual_pipeline_model_parallel_size", 1)) == []


def test_every_violation_is_reported_in_one_error():
    cfg = good_config()
    cfg["policy"]["generation"]["colocated"]["enabled"] = True
    cfg["policy"]["generation"]["backend"] = "sglang"
    cfg["policy"]["generation"]["vllm_cfg"]["enable_eplb"] = True
    cfg["policy"]["megatron_cfg"]["expert_tensor_parallel_size"] = 2
    cfg["policy"]["megatron_cfg"]["virtual_pipeline_model_parallel_size"] = 4
    cfg["policy"]["generation"]["vllm_cfg"]["precision"] = "fp8"
    with pytest.raises(ValueError) as err:
        check_nccl_reshard_refit_support(cfg)
    message = str(err.value)
    assert "(6 problems)" in message
    for key in (
        "policy.generation.colocated.enabled",
        "policy.generation.backend",
        "policy.generation.vllm_cfg.enable_eplb",
        "policy.megatron_cfg.expert_tensor_parallel_size",
        "policy.megatron_cfg.virtual_pipeline_model_parallel_size",
        "policy.generation.vllm_cfg.precision",
    ):
        assert key in message


def test_empty_config_lists_all_required_keys():
    problems = nccl_reshard_refit_violations({})
    assert any("policy.megatron_cfg.enabled" in p for p in problems)
    assert any("policy.generation.backend" in p for p in problems)
    assert any("policy.generation.colocated.enabled" in p for p in problems)


# ---- precision pairs --------------------------------------------------------------------


def precision_config(policy_precision="bfloat16", gen=None, fp8_recipe=None):
    cfg = with_key("policy.precision", policy_precision)
    if gen is None:
        del cfg["policy"]["generation"]["vllm_cfg"]["precision"]
    else:
        cfg["policy"]["generation"]["vllm_cfg"]["precision"] = gen
    if fp8_recipe is not None:
        cfg["policy"]["megatron_cfg"]["fp8_cfg"] = {"enabled": True, "fp8": "e4m3", "fp8_recipe": fp8_recipe}
    return cfg


def test_bf16_to_bf16_is_supported():
    assert nccl_reshard_refit_violations(precision_config("bfloat16", "bfloat16")) == []


def test_generation_precision_defaults_to_policy_precision():
    assert nccl_reshard_refit_violations(precision_config("bfloat16", None)) == []


def test_blockwise_fp8_training_to_fp8_generation_is_supported():
    assert nccl_reshard_refit_violations(precision_config("bfloat16", "fp8", fp8_recipe="blockwise")) == []


def test_bf16_to_mxfp8_is_supported():
    assert nccl_reshard_refit_violations(precision_config("bfloat16", "mxfp8")) == []


@pytest.mark.parametrize(
    "policy_precision, gen, recipe, key",
    [
        ("bfloat16", "fp8", None, "policy.generation.vllm_cfg.precision"),
        ("bfloat16", "bfloat16", "blockwise", "policy.megatron_cfg.fp8_cfg.fp8_recipe"),
        ("bfloat16", "fp8", "tensorwise", "policy.megatron_cfg.fp8_cfg.fp8_recipe"),
        ("float32", "float32", None, "policy.precision"),
        ("float16", None, None, "policy.precision"),
    ],
)
def test_unsupported_precision_pairs_are_rejected_naming_the_keys(policy_precision, gen, recipe, key):
    problems = nccl_reshard_refit_violations(precision_config(policy_precision, gen, recipe))
    assert len(problems) == 1
    assert key in problems[0] and "supported" in problems[0]
