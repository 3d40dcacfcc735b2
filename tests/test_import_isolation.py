"""Torch-only modules import in a fresh interpreter where megatron, transformer_engine and
msgspec cannot be imported; and the drop-in module exposes exactly the seed's names."""

import json
import subprocess
import sys
import textwrap

import pytest

BLOCKED = ("megatron", "transformer_engine", "msgspec")

# Modules that must import without the blocked packages. Those marked optional are skipped
# while they do not exist yet; the receiver is required as soon as its module exists.
REQUIRED = [
    "megatron_reshard",
    "megatron_reshard.errors",
    "megatron_reshard.layout.placements",
    "megatron_reshard.wire.placement_rules",
    "megatron_reshard.wire.spec",
    "megatron_reshard.wire.metadata",
    "megatron_reshard.support",
    "megatron_reshard.nccl_reshard_utils",
    "megatron_reshard.vllm_layout.mla",
    "megatron_reshard.wire.records",
    "megatron_reshard.wire.check",
    "megatron_reshard.wire.extras",
    "megatron_reshard.wire.expert_names",
    "megatron_reshard.wire.codec",  # msgspec only inside encode / decode
    "megatron_reshard.wire",
    "megatron_reshard.receiver.incoming",
    "megatron_reshard.receiver.param_map",
    "megatron_reshard.receiver.misc_transport",
    "megatron_reshard.vllm_api.init_checks",  # both init infos' checks (vLLM-free too)
]
OPTIONAL = [
    "megatron_reshard.engine",
    "megatron_reshard.engine.fuse",
    "megatron_reshard.engine.members",
    "megatron_reshard.refit.loop",
    "megatron_reshard.receiver",
    "megatron_reshard.groups.comm",
    "megatron_reshard.refit.packed",
    "megatron_reshard.vllm_layout",
    "megatron_reshard.vllm_layout.dense",
    "megatron_reshard.vllm_layout.moe",
    "megatron_reshard.fp8.quant",
    "megatron_reshard.fp8.plan",
    "megatron_reshard.receiver.fp8_targets",
    "megatron_reshard.vllm_api.plugin",  # register() imports vLLM; the module does not
]

_PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, importlib.util, json, sys, traceback
    BLOCKED = {blocked!r}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError("blocked by test: " + name)
    preloaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    sys.meta_path.insert(0, Block())
    report = {{"preloaded": preloaded, "blocker_works": False, "modules": {{}}}}
    try:
        import msgspec  # noqa: F401
    except ImportError:
        report["blocker_works"] = True
    for name in {modules!r}:
        try:
            if importlib.util.find_spec(name) is None:
                report["modules"][name] = "absent"
                continue
            importlib.import_module(name)
            report["modules"][name] = "ok"
        except BaseException:
            report["modules"][name] = traceback.format_exc()
    report["leaked"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def probe():
    code = _PROBE.format(blocked=BLOCKED, modules=REQUIRED + OPTIONAL)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fresh_interpreter_starts_without_blocked_packages_and_the_blocker_works(probe):
    assert probe["preloaded"] == []
    assert probe["blocker_works"]


@pytest.mark.parametrize("module", REQUIRED)
def test_torch_only_module_imports_with_megatron_te_and_msgspec_blocked(probe, module):
    assert probe["modules"][module] == "ok", probe["modules"][module]


@pytest.mark.parametrize("module", OPTIONAL)
def test_optional_torch_only_module_imports_with_megatron_te_and_msgspec_blocked(probe, module):
    result = probe["modules"][module]
    if result == "absent":
        pytest.skip(f"{module} does not exist yet")
    assert result == "ok", result


def test_no_blocked_package_reaches_sys_modules(probe):
    assert probe["leaked"] == []


# ---- the seed's names -------------------------------------------------------------------

# Every name listed in ../shared/seed/nccl_reshard_utils_api.txt (classes, functions, data).
SEED_NAMES = {
    "MeshInfo", "RefitCtx", "LocalParamSpec", "HFToLocalParamMap", "RefitBuilderInterface",
    "get_tp_shard_dim", "is_expert_param", "is_nccl_reshard_param", "_get_expert_tp_shard_dim",
    "_restore_placement", "make_nccl_reshard_refit_info_wire_safe", "restore_refit_info_placements",
    "build_mesh_info", "get_placements", "group_expert_params_in_metadata", "_extract_layer_prefix",
    "_extract_layer_name", "check_nccl_reshard_refit_support", "build_nccl_reshard_refit_info",
    "COLUMN_PARALLEL_SUFFIXES", "ROW_PARALLEL_SUFFIXES", "FFN_PROJ_WEIGHT_SUFFIXES",
    "FFN_GROUPED_EXPERT_SUFFIXES", "_STR_TO_DTYPE", "_INDIVIDUAL_EXPERT_RE", "_LAYER_RE", "_MODEL_PREFIX_RE",
}


def test_drop_in_module_exposes_every_seed_name():
    import megatron_reshard.nccl_reshard_utils as utils

    missing = sorted(n for n in SEED_NAMES if not hasattr(utils, n))
    assert missing == []


def test_drop_in_module_all_is_exactly_the_seed_names():
    import megatron_reshard.nccl_reshard_utils as utils

    assert set(utils.__all__) == SEED_NAMES and len(utils.__all__) == len(SEED_NAMES)


def test_seed_signatures_keep_their_parameter_names():
    import inspect

    import megatron_reshard.nccl_reshard_utils as utils

    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(utils.build_mesh_info) == ["num_gpus", "rank_offset", "tp_size", "ep_size", "pp_size"]
    assert params(utils.get_placements) == ["param_name", "dim_map", "ndim"]
    assert params(utils.build_nccl_reshard_refit_info) == [
        "state_dict_metadata", "train_parallelism", "gen_parallelism",
        "train_world_size", "gen_world_size", "layer_to_pp_stage",
    ]
    assert params(utils.group_expert_params_in_metadata) == ["state_dict_metadata"]
    assert params(utils.check_nccl_reshard_refit_support) == ["master_config"]
    assert params(utils.make_nccl_reshard_refit_info_wire_safe) == ["refit_info"]
    assert params(utils.restore_refit_info_placements) == ["refit_info"]
    assert params(utils._extract_layer_name) == ["param_name"]
    assert params(utils._extract_layer_prefix) == ["param_name"]
    assert params(utils.MeshInfo) == ["rank_tensor"]


def test_hard_coded_seed_names_match_the_seed_document_when_it_is_available():
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[2] / "shared" / "seed" / "nccl_reshard_utils_api.txt"
    if not doc.exists():
        pytest.skip(f"seed document not found at {doc}")
    listed = set(re.findall(r"^`([A-Za-z_][A-Za-z0-9_]*)`", doc.read_text(), flags=re.MULTILINE))
    assert listed == SEED_NAMES
