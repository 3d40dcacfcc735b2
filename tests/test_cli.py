"""The command line: help texts and the plan command (no communication)."""

import re
import subprocess
import sys

import pytest
import torch


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "megatron_reshard.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_three_commands():
    out = _cli("--help")
    assert out.returncode == 0
    for command in ("demo", "bench", "plan"):
        assert command in out.stdout


def test_demo_help_documents_layout_and_backend_options():
    out = _cli("demo", "--help")
    assert out.returncode == 0
    for option in ("--train-tp", "--train-pp", "--train-ep", "--gen-tp", "--model", "--backend",
                   "--json", "--refits"):
        assert option in out.stdout


def test_plan_ep2_to_tp2_sends_each_generation_rank_half_of_every_expert():
    out = _cli("plan", "--model", "qwen3-30b-a3b", "--layers", "1", "--train-world", "2",
               "--train-tp", "1", "--train-pp", "1", "--train-ep", "2", "--gen-world", "2",
               "--gen-tp", "2")
    assert out.returncode == 0, out.stderr
    # 128 experts x (gate + up + down) x 768 x 2048 bf16 = 1152 MiB; each train rank holds
    # 64 experts and each gen rank wants half of every expert: 288 MiB per (src, dst) pair
    rows = re.findall(r"^\| ([01]) \| \. \| \. \| ([\d.]+) \| ([\d.]+) \|$", out.stdout, re.M)
    assert rows == [("0", "288.00", "288.00"), ("1", "288.00", "288.00")]
    assert "3 bulk params" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark starts for real")
def test_bench_without_a_gpu_says_how_to_run_a_cpu_smoke_instead():
    out = _cli("bench", "refit", "--nproc", "2")
    assert out.returncode == 2 and "--device cpu" in out.stderr


def test_unknown_options_are_refused_outside_the_benchmarks():
    out = _cli("plan", "--bogus")
    assert out.returncode == 2 and "--bogus" in out.stderr
