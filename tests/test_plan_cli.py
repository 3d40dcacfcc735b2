"""``megatron-reshard plan`` as a user meets it: checks up front, the layout it used, every
parameter counted, the fingerprint it promises, JSON; run through the real CLI."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_reshard.testing.vllm_like import build_plain_payload, random_hf_state_dict
from megatron_reshard.tools.plan_layout import (RefitParallelism, megatron_pp_split,
                                                parallelism_problems)
from megatron_reshard.tools.presets import (default_plan_parallelism, demo_config,
                                            describe_plan_parallelism, model_config, model_names)

from ahead import Ahead

ahead = pytest.mark.ahead  # the _plan calls a test makes, started ahead of it (tests/ahead.py)
ROOT = Path(__file__).resolve().parents[1]
DSV3_NEMO_RL = ["--model", "deepseek-v3", "--train-world", "256", "--train-tp", "1",
                "--train-pp", "16", "--train-pp-layers", ",".join(["4"] * 15 + ["1"]),
                "--train-ep", "16", "--gen-world", "256", "--gen-tp", "32", "--gen-ep", "32"]
# the same layout per stage and per generation replica at a quarter of the ranks and 9 of the
# 61 layers (uneven stages, EP16 with expert DP 1, gen TP32 EP32): planned in a second,
# where the whole model over 256 ranks takes the default planner half a minute
DSV3_NEMO_RL_SLICE = ["--model", "deepseek-v3", "--layers", "9", "--train-world", "64",
                      "--train-tp", "1", "--train-pp", "4", "--train-pp-layers", "4,2,2,1",
                      "--train-ep", "16", "--gen-world", "64", "--gen-tp", "32", "--gen-ep", "32"]


def _run_plan(*args, timeout=300):
    # the timeout only keeps a hang from blocking the suite; nothing here measures time
    return subprocess.run([sys.executable, "-m", "megatron_reshard.tools.cli", "plan", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


AHEAD = _plan = Ahead(_run_plan)


@functools.cache
def _help():
    """``megatron-reshard plan --help``, run once for the tests that read it."""
    return _plan("--help")


REFUSED = [
    (["--train-world", "100000"], "--train-world 100000: expected at most 2048 ranks"),
    (["--gen-world", "4096"], "--gen-world 4096: expected at most 2048 ranks"),
    (["--model", "kimi-k2", "--layers", "100000"], "--layers 100000: expected at most 1024 layers"),
    (["--model", "deepseek-v3", "--train-world", "192"],
     "--train-ep 16 (the model's default): expected a divisor of the 12 training ranks"),
    (["--model", "dense", "--train-pp", "5"], "--train-pp 5: expected at most the 4 layers"),
    (["--model", "deepseek-v3", "--train-world", "16", "--train-pp", "2", "--train-tp", "1",
      "--train-pp-layers", "30,30"], "--train-pp-layers 30,30: expected 2 counts >= 1"),
    (["--train-pp-layers", "two,two"], "--train-pp-layers 'two,two': expected comma-separated"),
    (["--gen-tp", "3", "--gen-world", "3"], "--gen-tp 3: expected a divisor of the 8 attention heads"),
    (["--model", "kimi-k2", "--train-ep", "5", "--train-world", "5", "--gen-tp", "1",
      "--train-tp", "1", "--train-pp", "1"],
     "--train-ep 5: expected a divisor of the model's 384 experts"),
    (["--model", "dense", "--train-ep", "2"], "--train-ep 2: expected 1, the model has no experts"),
    (["--gen-world", "0"], "--gen-world 0: expected an integer >= 1"),
    (["--net-gbps", "0"], "--net-gbps 0.0: expected a number > 0"),
]


@ahead(*[args for args, _ in REFUSED])
@pytest.mark.parametrize("args, fragment", REFUSED)
def test_a_layout_the_model_cannot_take_ends_at_once_with_one_line(args, fragment):
    out = _plan(*args)
    assert out.returncode == 2, out.stdout
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("megatron-reshard plan: error: ") and fragment in out.stderr
    assert "Traceback" not in out.stderr


@ahead(["--model", "deepseek-v3", "--planner", "link-aware"])
def test_deepseek_v3_defaults_to_the_nemo_rl_layout_split_as_megatron_splits_61_layers():
    # no layout option: the layout NeMo-RL runs (DSV3_NEMO_RL spells it out), PP16 over 61
    # layers as Megatron builds it with num_layers_in_last_pipeline_stage=1
    out = _plan("--model", "deepseek-v3", "--planner", "link-aware")
    assert out.returncode == 0, out.stderr
    assert ("layout: train 256 ranks: TP1 CP1 PP16 (layers 4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,1) "
            "EP16 DP16 (expert DP 1) -> gen 256 ranks: TP32 EP32 DP8 "
            "(Megatron: num_layers_in_last_pipeline_stage=1)") in out.stdout


@ahead(["--json", "--train-pp", "1"])
def test_every_parameter_is_counted_as_the_refit_payload_carries_it():
    # the demo's MoE model: the payload a refit sends lists bulk params (experts grouped)
    # and the other params; plan must count both, not only the FFN weights
    cfg = demo_config("moe")
    full = random_hf_state_dict(cfg)
    payload = build_plain_payload(cfg, full, {"tp_size": 2, "ep_size": 2, "pp_size": 1},
                                  {"tp_size": 2}, 4, 2)
    bulk = sum(len(v) for v in payload["per_layer_params"].values())
    other = len(payload["other_params"])
    got = json.loads(_plan("--json", "--train-pp", "1").stdout)["runs"][0]["params"]
    assert (got["bulk_params"], got["other_params"], got["hf_tensors"]) == (bulk, other, len(full))
    assert got["bulk_bytes"] + got["other_bytes"] == sum(t.numel() * 2 for t in full.values())


@ahead([], [], ["--json"])  # two processes of the same command, then the JSON
def test_the_fingerprint_is_printed_and_identical_between_runs_and_in_json():
    first, second = _plan(), _plan()
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("plan fingerprint (default")]
    assert len(lines) == 1 and lines == [ln for ln in second.stdout.splitlines()
                                         if ln.startswith("plan fingerprint (default")]
    runs = json.loads(_plan("--json").stdout)["runs"]
    assert lines[0].endswith(runs[0]["fingerprint"]) and runs[0]["planner"] == "default"


@ahead(["--json", "--planner", "default"], ["--json", "--planner", "default", "--gen-tp", "1"])
def test_the_fingerprint_changes_with_the_layout():
    a = json.loads(_plan("--json", "--planner", "default").stdout)["runs"][0]["fingerprint"]
    b = json.loads(_plan("--json", "--planner", "default", "--gen-tp", "1").stdout)["runs"][0]
    assert a != b["fingerprint"]


@ahead([*DSV3_NEMO_RL_SLICE, "--json", "--others", "sharded"])
def test_json_reports_bytes_per_rank_planning_time_and_both_estimates():
    runs = json.loads(_plan(*DSV3_NEMO_RL_SLICE, "--json", "--others", "sharded").stdout)["runs"]
    assert [r["planner"] for r in runs] == ["default", "link-aware"]
    for r in runs:
        for side in ("train_sent_bytes", "gen_received_bytes"):
            stats = r[side]
            assert stats["min"] <= stats["mean"] <= stats["max"]
            assert stats["above_ideal"] == pytest.approx(stats["max"] / stats["mean"] - 1)
        assert r["planning_s"]["one_rank"] > 0 and r["planning_s"]["whole_job"] > 0
        assert r["estimate_s"]["refit"] < r["estimate_s"]["gather_broadcast"]
        # every generation rank of TP32 receives 1/32 of the model whatever the planner, plus
        # what vLLM replicates on every rank (MLA down-projections, norms, router)
        share = (r["params"]["bulk_bytes"] + r["params"]["other_bytes"]) / 32
        assert share <= r["gen_received_bytes"]["min"] <= r["gen_received_bytes"]["max"] < 1.1 * share
    default, aware = runs
    assert aware["estimate_s"]["refit"] < default["estimate_s"]["refit"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_has_matplotlib(), reason="matplotlib is installed here")
@ahead(["--plot", "/tmp/never_written.png"])  # not started where skipped (it would plot)
def test_plot_without_matplotlib_is_refused_up_front():
    out = _plan("--plot", "/tmp/never_written.png")
    assert out.returncode == 2 and "pip install 'megatron-reshard[plot]'" in out.stderr


@ahead(["--help"])  # _help() for this test and test_help_lists_each_presets_default_layout
def test_plan_help_names_the_link_model_defaults():
    text = " ".join(_help().stdout.split())
    for fragment in ("--gpus-per-node GPUS_PER_NODE GPUs per node, joined by NVLink (default: 8)",
                     "(default: 450.0)", "(default: 50.0)", "(default: 5.0)",
                     "(default: sharded)", "(default: both)"):
        assert fragment in text, fragment


def test_plot_writes_a_png_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loads.png"
    out = _plan("--plot", str(path))
    assert out.returncode == 0, out.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("model", model_names())
def test_every_presets_default_layout_is_one_the_model_can_take(model):
    cfg = model_config(model)
    sizes = default_plan_parallelism(cfg, model)
    assert parallelism_problems(RefitParallelism(**sizes), cfg) == []


# in process (one torch import for all); the whole DeepSeek-V3 / Kimi-K2 jobs (256 + 256
# ranks) take minutes: their layout is planned by the test above this one's neighbours
SMALL_DEFAULTS = [m for m in model_names()
                  if default_plan_parallelism(model_config(m), m)["train_world"] <= 128]


@pytest.mark.parametrize("model", SMALL_DEFAULTS)
def test_presets_plan_with_the_commands_defaults(model, capsys):
    # the layout comes from the model's defaults, which --help lists and the output states
    from megatron_reshard.tools.cli import main

    args = ["plan", "--model", model, "--json", "--planner", "default"]
    assert main(args) == 0, capsys.readouterr().err
    got = json.loads(capsys.readouterr().out)
    expected = default_plan_parallelism(model_config(model), model)
    train = got["runs"][0]["layout"]["train"]
    assert (train["world"], train["tp"], train["pp"]) == (
        expected["train_world"], expected["train_tp"], expected["train_pp"])
    assert f"PP{expected['train_pp']}" in got["layout_text"]


def test_help_lists_each_presets_default_layout():
    text = _help().stdout
    for model in model_names():
        line = describe_plan_parallelism(default_plan_parallelism(model_config(model), model))
        assert any(ln.split() == [model, *line.split()] for ln in text.splitlines()), model


# DeepSeek-V3 shapes on 3 layers and few ranks: the stage count comes from the counts alone
PP_LAYERS_ONLY = ["--model", "deepseek-v3", "--layers", "3", "--train-pp-layers", "1,2",
                  "--train-world", "2", "--train-tp", "1", "--train-ep", "1", "--gen-world", "2",
                  "--gen-tp", "2", "--gen-ep", "1", "--planner", "default"]


@ahead(PP_LAYERS_ONLY)
def test_pp_layers_alone_sets_the_stage_count():
    out = _plan(*PP_LAYERS_ONLY)
    assert out.returncode == 0, out.stderr
    assert "PP2 (layers 1,2)" in out.stdout
    assert "Megatron:" not in out.stdout  # hand-given stages: no setting claimed for them


# ---- Megatron's PP split, checked against megatron-core itself ---------------------------


def _megatron_core_stage_layers(layers, pp, settings):
    """Layers each PP rank builds, as megatron-core 0.16.1 computes them."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               use_cpu_initialization=True, **settings)
    return tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(pp))


@pytest.mark.parametrize("layers, pp", [(61, 16), (94, 8), (126, 8), (61, 2), (9, 4), (48, 5),
                                        (7, 7), (36, 4), (5, 3)])
def test_uneven_pp_splits_are_what_megatron_core_builds_with_the_settings_stated(layers, pp):
    counts, settings = megatron_pp_split(layers, pp)
    assert sum(counts) == layers and len(counts) == pp
    assert max(counts) == -(-layers // pp)  # the busiest stage as light as it can be
    assert _megatron_core_stage_layers(layers, pp, settings) == counts
    assert bool(settings) == bool(layers % pp)


def test_the_simulators_vocab_padding_is_vllms():
    from megatron_reshard.tools.plan_layout import VLLM_VOCAB_PADDING
    from megatron_reshard.vllm_layout.dense import padded_vocab_rows

    for vocab in (500, 129280, 151936, 163840, 1):
        assert padded_vocab_rows(vocab) == -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


# ---- what a user of other models meets -----------------------------------------------

LLAMA_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0}


def test_an_hf_config_file_plans_the_same_job_as_its_preset(tmp_path, capsys):
    from megatron_reshard.tools.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B_CONFIG))
    runs = []
    for model in (["--model", "llama-3.1-8b"], ["--hf-config", str(path)]):
        assert main(["plan", *model, "--layers", "2", "--train-world", "8", "--train-tp", "2",
                     "--train-pp", "2", "--gen-world", "2", "--gen-tp", "2", "--json",
                     "--planner", "default"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["runs"][0])
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"]
    assert runs[0]["params"] == runs[1]["params"]


def test_a_dense_model_is_described_without_expert_sizes_and_the_peers_column_is_explained(capsys):
    from megatron_reshard.tools.cli import main

    assert main(["plan", "--model", "dense", "--planner", "default"]) == 0
    out = capsys.readouterr().out
    layout = next(ln for ln in out.splitlines() if ln.startswith("layout:"))
    assert "EP" not in layout and "expert" not in layout, layout
    assert "experts as one tensor" not in out and "FFN/expert" not in out
    assert "of which from peers: the part of what a generation rank receives" in out


def test_a_world_not_typed_fits_the_sizes_typed(capsys):
    # the demo's default generation world is 2: --gen-tp 4 alone plans gen 4 ranks, instead
    # of refusing a "--gen-world 2" the user never typed
    from megatron_reshard.tools.cli import main

    assert main(["plan", "--gen-tp", "4", "--json", "--planner", "default"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["layout"]["gen"]["world"] == 4


def test_a_bad_option_is_refused_before_torch_is_imported():
    code = ("import sys; from megatron_reshard.tools.cli import main; "
            "rc = main(['plan', '--gen-world', '0']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["2", "False"], out.stderr


def test_wire_fp8_help_says_what_the_refit_does():
    text = " ".join(_help().stdout.split())
    assert "does not quantize yet" not in text
    assert "as the refit sends them to a block-FP8 generation model" in text


def test_every_full_size_preset_defaults_to_its_users_layout_not_the_demos():
    """GLM-4.5 and GLM-4.5-Air fell back to the demo's 4 -> 2 ranks (657 GiB into 2 GPUs,
    issue 50 item 3); each full-size preset has its published layout (presets.py names the
    source of each)."""
    from megatron_reshard.tools.presets import (DEMO_PLAN_PARALLELISM, FULL_SIZE,
                                                LLAMA_FULL_SIZE, PUBLISHED_LAYOUTS)

    for model in [*FULL_SIZE, *LLAMA_FULL_SIZE]:
        assert model in PUBLISHED_LAYOUTS, model
        sizes = default_plan_parallelism(model_config(model), model)
        assert sizes["train_world"] > DEMO_PLAN_PARALLELISM["train_world"], (model, sizes)
    # slime's GLM-4.5 RL example: Megatron TP8 PP4 CP2 EP16 on 64 GPUs, 32-GPU rollout engines
    assert default_plan_parallelism(model_config("glm-4.5"), "glm-4.5") == dict(
        train_world=64, train_tp=8, train_cp=2, train_pp=4, train_ep=16, gen_world=64,
        gen_tp=32, gen_ep=32)
    # Megatron Bridge's TP1 PP4 EP8 for training; vLLM TP4 per replica, as zai-org serves it
    assert default_plan_parallelism(model_config("glm-4.5-air"), "glm-4.5-air") == dict(
        train_world=32, train_tp=1, train_cp=1, train_pp=4, train_ep=8, gen_world=32,
        gen_tp=4, gen_ep=1)
    assert "TP8 CP2 PP4 EP16" in describe_plan_parallelism(
        default_plan_parallelism(model_config("glm-4.5"), "glm-4.5"))
