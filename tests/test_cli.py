"""The command line: option checks before any process starts, help texts, --version, plan.

Invalid options run the real CLI in a subprocess and must end with exit status 2 and one
line on stderr naming the option; a second check runs ``cli.main`` in a fresh interpreter
to show that neither the worker pool module nor Megatron was even imported.
"""

import functools
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from megatron_reshard.tools import cli
from megatron_reshard.tools.run_config import MODEL_PRESETS, RefitRunConfig, config_from_args
from megatron_reshard.receiver.full_weights import load_full_weights
from megatron_reshard.receiver.targets import VllmTargets
from megatron_reshard.testing.vllm_like import build_vllm_like_model, random_hf_state_dict

from ahead import Ahead

ROOT = Path(__file__).resolve().parents[1]
ahead = pytest.mark.ahead  # the _cli calls a test makes, started ahead of it (tests/ahead.py)


def _run_cli(*args, timeout=120):
    # the timeout only keeps a hang from blocking the suite; nothing here measures time
    return subprocess.run([sys.executable, "-m", "megatron_reshard.tools.cli", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


AHEAD = _cli = Ahead(_run_cli)


@functools.cache
def _help(*command):
    """``megatron-reshard *command --help``, run once for all the tests that read it."""
    return _cli(*command, "--help")


# (argv, the option the message must name, a fragment of what it must say was expected)
INVALID = [
    (["demo", "--refits", "0"], "--refits 0", "expected an integer >= 1"),
    (["demo", "--refits", "-1"], "--refits -1", "expected an integer >= 1"),
    (["demo", "--gen-world", "0"], "--gen-world 0", "expected an integer >= 1"),
    (["demo", "--train-world", "0"], "--train-world 0", "expected an integer >= 1"),
    (["demo", "--streams", "0"], "--streams 0", "expected an integer >= 1"),
    (["demo", "--staging-mib", "0"], "--staging-mib 0.0", "expected a number > 0"),
    (["demo", "--timeout-s", "-5"], "--timeout-s -5.0", "expected a number > 0"),
    (["demo", "--gen-tp", "3", "--gen-world", "3"], "--gen-tp 3", "expected one of 1, 2, 4, 8"),
    (["demo", "--gen-tp", "16", "--gen-world", "16"], "--gen-tp 16", "expected one of 1, 2, 4, 8"),
    (["demo", "--gen-world", "3"], "--gen-world 3", "expected a multiple of --gen-tp 2"),
    (["demo", "--gen-ep", "4"], "--gen-ep 4", "expected 1 or --gen-tp (2)"),
    (["demo", "--model", "dense", "--train-ep", "2"], "--train-ep 2", "expected 1 for the dense model"),
    (["demo", "--model", "dense", "--gen-ep", "2"], "--gen-ep 2", "expected 1 for the dense model"),
    (["demo", "--train-world", "3"], "--train-world 3", "expected a multiple of --train-tp × --train-pp"),
    (["demo", "--train-ep", "3", "--train-world", "6", "--train-pp", "1", "--train-tp", "1"],
     "--train-ep 3", "expected one of 1, 2, 4, 8 for the moe model"),
    (["demo", "--model", "dense", "--train-tp", "3", "--train-pp", "1", "--train-world", "3"],
     "--train-tp 3", "expected one of 1, 2, 4, 8 for the dense model"),
    (["demo", "--train-pp", "3", "--train-world", "6", "--train-tp", "2"], "--train-pp 3",
     "expected one of 1, 2, 4"),
    (["demo", "--refits", "two"], "--refits", "invalid int value"),
    (["demo", "--model", "huge"], "--model", "invalid choice"),
    (["demo", "--bogus"], "--bogus", "unrecognized arguments"),
    (["bench", "refit", "--nproc", "3", "--device", "cpu"], "--nproc 3", "expected 2 or 4"),
    (["bench", "transfer", "--nproc", "3", "--device", "cpu"], "--nproc 3",
     "expected an even number >= 2"),
    (["bench", "refit", "--device", "cpu", "--iters", "0"], "--iters 0", "expected an integer >= 1"),
    (["bench", "refit", "--device", "cpu", "--backend", "nccl"], "--backend nccl",
     "expected --device cuda"),
    (["bench", "refit", "--device", "cpu", "--bogus"], "--bogus", "unrecognized arguments"),
    (["bench", "refit", "--nproc", "2", "--", "--device", "cpu", "--iters", "0"], "--iters 0",
     "expected an integer >= 1"),
    (["bench", "fastest"], "fastest", "invalid choice"),
]


_DRIVER = """
import contextlib, io, json, sys
from megatron_reshard.tools.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = exit_.code
    out.append({"rc": rc, "stderr": err.getvalue(), "stdout": std.getvalue(),
                "pool_imported": "megatron_reshard.tools.worlds" in sys.modules,
                "megatron_imported": "megatron.core" in sys.modules})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def invalid_runs():
    """Every INVALID command through ``cli.main`` in one fresh interpreter (one torch import
    instead of one per case), in order, with what had been imported after each."""
    out = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([c[0] for c in INVALID])],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(INVALID)), ids=[" ".join(c[0]) for c in INVALID])
def test_an_invalid_option_ends_the_command_with_one_line_and_status_2(invalid_runs, case):
    _, option, expected = INVALID[case]
    run = invalid_runs[case]
    assert run["rc"] == 2, run
    lines = run["stderr"].strip().splitlines()
    assert len(lines) == 1, run["stderr"]
    assert option in lines[0] and expected in lines[0], lines[0]
    assert run["stdout"] == ""
    # no process was started: the worker pool was never even imported, nor Megatron
    assert not run["pool_imported"] and not run["megatron_imported"]


INSTALLED_INVALID = [["demo", "--gen-tp", "3", "--gen-world", "3"],
                     ["demo", "--model", "dense", "--train-ep", "2"],
                     ["demo", "--refits", "0"],
                     ["bench", "refit", "--nproc", "3", "--device", "cpu"]]


@ahead(*INSTALLED_INVALID)
@pytest.mark.parametrize("argv", INSTALLED_INVALID)
def test_the_installed_command_exits_2_with_one_line_and_no_traceback(argv):
    out = _cli(*argv)
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"megatron-reshard {argv[0]}")
    assert "Traceback" not in out.stderr and out.stdout == ""


def _parse_demo(*argv):
    return cli.build_parser().parse_args(["demo", *argv])


@pytest.mark.parametrize("model, ep", [("moe", 2), ("dense", 1), ("qwen2", 1)])
def test_the_demo_defaults_are_a_valid_layout_for_each_model(model, ep):
    cfg = config_from_args(_parse_demo("--model", model), ports=(0, 0, 0))
    assert cfg.train_ep == ep
    assert cfg.problems() == []


def test_the_dense_model_may_replicate_its_kv_heads_over_train_tp():
    # Megatron's rule (TP a multiple of the query groups); the refit of it is exact
    # (tests/test_e2e.py: one KV head over train TP2)
    cfg = config_from_args(_parse_demo("--model", "dense", "--train-tp", "4", "--train-pp", "1"),
                           ports=(0, 0))
    assert cfg.problems() == []


def test_an_explicit_train_ep_overrides_the_model_default():
    assert config_from_args(_parse_demo("--train-ep", "1"), ports=(0, 0, 0)).train_ep == 1


def _hf_config(model: str) -> dict:
    p = MODEL_PRESETS[model]
    if p.get("multi_latent_attention"):  # DeepSeek-V3 names: MLA, shared experts, router bias
        return dict(family="deepseek_v3", hidden_size=p["hidden_size"],
                    num_attention_heads=p["num_attention_heads"], intermediate_size=p["ffn_hidden_size"],
                    moe_intermediate_size=p["moe_ffn_hidden_size"], num_experts=p["num_moe_experts"],
                    num_hidden_layers=2, moe_layers=[1], vocab_size=p["vocab_size"],
                    shared_expert_intermediate_size=p["moe_shared_expert_intermediate_size"],
                    router_expert_bias=True, q_lora_rank=p["q_lora_rank"], kv_lora_rank=p["kv_lora_rank"],
                    qk_nope_head_dim=p["qk_head_dim"], qk_rope_head_dim=p["qk_pos_emb_head_dim"],
                    v_head_dim=p["v_head_dim"])
    if p.get("family") == "glm4_moe":  # GQA + DeepSeek's MoE names, the router in float32
        return dict(family="glm4_moe", hidden_size=p["hidden_size"],
                    num_attention_heads=p["num_attention_heads"],
                    num_key_value_heads=p["num_query_groups"], head_dim=p["head_dim"],
                    intermediate_size=p["ffn_hidden_size"], moe_intermediate_size=p["moe_ffn_hidden_size"],
                    num_experts=p["num_moe_experts"], num_hidden_layers=2, moe_layers=[1],
                    vocab_size=p["vocab_size"], attention_bias=True, router_expert_bias=True,
                    shared_expert_intermediate_size=p["moe_shared_expert_intermediate_size"],
                    tie_word_embeddings=False)
    if p.get("family") in ("qwen3_next", "qwen3_5_moe_text"):  # Gated-DeltaNet in layer 0, gated attention in 1
        return dict(family=p["family"], hidden_size=p["hidden_size"],
                    num_attention_heads=p["num_attention_heads"],
                    num_key_value_heads=p["num_query_groups"], head_dim=p["head_dim"],
                    intermediate_size=p["ffn_hidden_size"], moe_intermediate_size=p["moe_ffn_hidden_size"],
                    num_experts=p["num_moe_experts"], num_hidden_layers=2, vocab_size=p["vocab_size"],
                    qk_norm=True, attn_output_gate=True, layer_types=["linear_attention", "full_attention"],
                    shared_expert_intermediate_size=p["moe_shared_expert_intermediate_size"],
                    linear_conv_kernel_dim=4, tie_word_embeddings=False,
                    **{k: p[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim")})
    return dict(hidden_size=p["hidden_size"], num_attention_heads=p["num_attention_heads"],
                num_key_value_heads=p["num_query_groups"],
                intermediate_size=p["ffn_hidden_size"],
                moe_intermediate_size=p.get("moe_ffn_hidden_size"),
                num_experts=p.get("num_moe_experts") or 0, num_hidden_layers=2,
                vocab_size=p["vocab_size"], qk_norm=p.get("qk_layernorm", False),
                attention_bias=p.get("add_qkv_bias", False), tie_word_embeddings=False)


def _receiver_takes(model: str, tp: int, ep: int) -> bool:
    """Whether the receiver maps full HF weights onto every vLLM-layout rank of gen TP ``tp``
    and gen EP ``ep``, leaving no element unwritten."""
    hf = _hf_config(model)
    full = random_hf_state_dict(hf, torch.float32)
    for rank in range(tp):
        params = build_vllm_like_model(hf, rank, tp, ep, torch.float32)
        try:
            load_full_weights(VllmTargets.from_named_parameters(params.named_parameters(), hf,
                                                                rank, tp, ep), full)
        except ValueError:
            return False
        if any(p.isnan().any() for p in params.parameters()):
            return False
    return True


@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_gen_tp_is_refused_exactly_where_the_receiver_cannot_map_the_model(model, expert_parallel):
    if expert_parallel and not MODEL_PRESETS[model].get("num_moe_experts"):
        pytest.skip("a dense model has no gen EP")
    for tp in range(1, 17):
        ep = tp if expert_parallel else 1
        cfg = RefitRunConfig(model=model, train_ep=1, gen_world=tp, gen_tp=tp, gen_ep=ep,
                             ports=(0, 0, 0))
        refused = [p for p in cfg.problems() if p.startswith(("--gen-tp", "--gen-ep"))]
        assert (not refused) == _receiver_takes(model, tp, ep), (tp, ep, refused)


@pytest.mark.parametrize("kind, nproc, rest", [
    ("refit", 2, ["--device", "cpu", "--backend", "gloo", "--small"]),
    ("refit", 4, ["--device", "cpu", "--small", "--case", "dense", "--iters", "1", "--warmup", "0"]),
    ("transfer", 6, ["--device", "cpu", "--small"]),
])
def test_the_documented_cpu_smoke_runs_of_the_benchmarks_pass_the_checks(kind, nproc, rest):
    assert cli.bench_problems(kind, nproc, rest) == []


@ahead(["--version"])
def test_version_prints_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"megatron-reshard {version}"


HELP_COMMANDS = [[], ["demo"], ["bench"], ["plan"]]


@ahead(*[[*command, "--help"] for command in HELP_COMMANDS])  # _help(): the help tests below too
@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_every_help_shows_the_defaults(command):
    out = _help(*command)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    expected = {(): [], ("demo",): ["--refits REFITS refits to run", "(default: 3)",
                                    "(default: moe)", "1 for dense, 2 for glm, 2 for gpt-oss, 2 for moe",
                                    "(default: 120.0)"],
                ("bench",): ["(default: 4)"],
                ("plan",): ["(default: moe)", "--gen-tp GEN_TP default: the model's, listed below",
                          "deepseek-v3 train 256 ranks TP1 PP16 EP16 -> gen 256 ranks TP32 EP32"]
                }[tuple(command)]
    for fragment in expected:
        assert fragment in text, fragment
    # every option that takes a value and has a fixed default says what it is
    for line in re.findall(r"^  (--[a-z-]+ [A-Z_]+.*(?:\n {20,}.*)*)", out.stdout, re.M):
        option = line.split()[0]
        if option in ("--train-ep", "--layers", "--port-base"):
            continue  # computed per model / optional overrides: their help says so
        assert "default" in line, line


def test_the_streams_help_says_what_it_does_on_cpu_and_on_gpus():
    help_text = _help("demo").stdout
    text = " ".join(help_text[help_text.index("options:"):].split())
    streams = text[text.index("--streams STREAMS"):text.index("--staging-mib STAGING_MIB")]
    assert "CUDA streams" not in streams and "on CPU" in streams and "on GPUs" in streams


def test_help_lists_the_three_commands():
    out = _help()
    assert out.returncode == 0
    for command in ("demo", "bench", "plan"):
        assert command in out.stdout


def test_demo_help_documents_layout_and_backend_options():
    out = _help("demo")
    assert out.returncode == 0
    for option in ("--train-tp", "--train-pp", "--train-ep", "--gen-tp", "--model", "--backend",
                   "--json", "--refits"):
        assert option in out.stdout


PLAN_EP2_TO_TP2 = ["plan", "--model", "qwen3-30b-a3b", "--layers", "1", "--train-world", "2",
                   "--train-tp", "1", "--train-pp", "1", "--train-ep", "2", "--gen-world", "2",
                   "--gen-tp", "2", "--gen-ep", "1"]  # the model's default layout has gen EP4


@ahead(PLAN_EP2_TO_TP2)
def test_plan_ep2_to_tp2_sends_each_generation_rank_half_of_every_expert():
    out = _cli(*PLAN_EP2_TO_TP2)
    assert out.returncode == 0, out.stderr
    # 128 experts x (gate + up + down) x 768 x 2048 bf16 = 1152 MiB; each train rank holds
    # 64 experts and each gen rank wants half of every expert: 288 MiB per (src, dst) pair
    rows = re.findall(r"^\| ([01]) \| \. \| \. \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert rows == [("0", "288.00", "288.00"), ("1", "288.00", "288.00")]
    assert "3 bulk params" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark starts for real")
@ahead(["bench", "refit", "--nproc", "2"])
def test_bench_without_a_gpu_says_how_to_run_a_cpu_smoke_instead():
    out = _cli("bench", "refit", "--nproc", "2")
    assert out.returncode == 2 and "--device cpu" in out.stderr


@ahead(["plan", "--bogus"])
def test_unknown_options_are_refused_outside_the_benchmarks():
    out = _cli("plan", "--bogus")
    assert out.returncode == 2 and "--bogus" in out.stderr


DENSE_DEMO = ["demo", "--model", "dense", "--refits", "3", "--delta", "--update", "adam", "--json"]


@pytest.mark.slow
@ahead(DENSE_DEMO, timeout=600)
def test_demo_of_the_dense_model_runs_with_its_own_defaults_and_reports_json():
    """The README's `demo --model dense`, as a user starts it (its own processes), with
    `--json`: one summary object of a verified refit (the pool-based e2e tests cover the
    other models and layouts; one demo subprocess is enough for the command itself), with
    `--delta --update adam`: Adam steps between refits, the second and third sent as deltas."""
    out = _cli(*DENSE_DEMO, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True and summary["refits"] == 3
    assert summary["modes"] == ["full", "delta", "delta"], summary["full_reasons"]
    assert summary["full_reasons"][1:] == [None, None]
    for got in summary["bytes_received"].values():  # bytes into each gen rank, per refit
        assert all(0 < b < got[0] / 25 for b in got[1:]), got
    assert summary["layout"]["train"] == {"world": 4, "tp": 2, "pp": 2, "ep": 1}
    assert summary["params"] > 0 and 0 < summary["exact_path_fraction"] <= 1
    assert set(summary["bytes_per_gen_rank"]) == {"0", "1"}


def test_delta_and_update_reach_the_run_config():
    cfg = config_from_args(_parse_demo("--delta", "--update", "adam"), ports=(0, 0, 0))
    assert (cfg.delta, cfg.update) == (True, "adam") and cfg.problems() == []
    plain = config_from_args(_parse_demo(), ports=(0, 0, 0))
    assert (plain.delta, plain.update) == (False, "perturb")


def test_gloo_with_cuda_tensors_is_refused_before_processes_start_but_colocated_takes_it():
    # seen on one H200: every param refused at the first batch (gloo moves CPU tensors)
    problems = RefitRunConfig(backend="gloo", device="cuda", ports=(0, 0, 0)).problems()
    assert any(p.startswith("--backend gloo: expected --device cpu") for p in problems)
    colocated = RefitRunConfig(backend="gloo", device="cuda", transport="colocated",
                               ports=(0, 0, 0))
    assert not any("--backend gloo" in p for p in colocated.problems())


def test_packed_params_reaches_the_run_config_and_a_bad_regex_is_refused():
    cfg = config_from_args(_parse_demo("--packed-params", r"self_attn\.[qkv]_proj"), ports=(0, 0, 0))
    assert cfg.packed_params == r"self_attn\.[qkv]_proj" and cfg.problems() == []
    bad = config_from_args(_parse_demo("--packed-params", "self_attn.("), ports=(0, 0, 0))
    assert any(p.startswith("--packed-params 'self_attn.(': expected a regular expression")
               for p in bad.problems())


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_demo_deepseek_in_fp8_has_one_moe_pattern_entry_per_layer_and_whole_blocks(precision):
    # the FP8 sizes take the deepseek preset to 2 layers: its per-layer MoE pattern follows
    # (Megatron refused the 4-entry pattern inside every training rank, a minute in)
    from megatron_reshard.tools.run_config import model_preset

    cfg = config_from_args(_parse_demo("--model", "deepseek", "--gen-precision", precision),
                           ports=(0, 0, 0))
    assert cfg.problems() == []
    preset = model_preset(cfg)
    assert preset["moe_layer_freq"] == [0, 1] and preset["num_layers"] == 2


def test_a_deepseek_fp8_layout_that_cuts_blocks_is_refused_before_processes_start():
    cut = RefitRunConfig(model="deepseek", gen_precision="fp8", ports=(0, 0, 0),
                         model_overrides={"q_lora_rank": 32, "v_head_dim": 16})
    problems = cut.problems()
    assert any(p.startswith("--gen-precision fp8: expected a q_lora_rank that is a multiple "
                            "of 128") for p in problems), problems
    assert any("'o_proj columns per rank': 32" in p for p in problems), problems
