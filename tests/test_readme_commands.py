"""The README's commands as a new user types them (issue 50, item 7): the demo's model list
(README table and ``demo --help``) comes from the presets registry, the scripts' ``--help``
states what they do in full and documents every option, and a ``python scripts/...``
command names the venv it needs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from megatron_reshard.tools.run_config import MODEL_ABOUT, MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _help(*argv: str) -> str:
    proc = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True,
                          timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_demo_preset_has_a_description_and_no_description_lacks_a_preset():
    assert list(MODEL_ABOUT) == list(MODEL_PRESETS)


def test_demo_help_describes_every_preset():
    text = " ".join(_help("-m", "megatron_reshard.tools.cli", "demo").split())
    for name, about in MODEL_ABOUT.items():
        assert f"{name} ({' '.join(about.split())})" in text, name


def test_the_readme_command_table_lists_every_demo_preset():
    row = next(line for line in README.splitlines() if line.startswith("| `megatron-reshard demo"))
    listed = re.search(r"--model ([^\]]+)\]", row).group(1).split("\\|")
    assert sorted(listed) == sorted(MODEL_PRESETS), listed
    for name in MODEL_PRESETS:
        if name not in ("moe", "dense"):  # the two the table's first words describe
            assert f"`{name}`:" in row, name


def test_vllm_backend_refit_help_has_the_whole_description_and_documents_every_option():
    text = _help("scripts/vllm_backend_refit.py")
    assert "exit status 0 when every refit committed and matched" in text
    options = re.findall(r"^  (--[a-z-]+)(.*)$", text, flags=re.MULTILINE)
    assert {o for o, _ in options} >= {"--refits", "--train-tp", "--gen-tp", "--fail-extra",
                                        "--timeout-s", "--progress-s"}
    blocks = re.split(r"\n  (?=--)", text.split("options:", 1)[1])[1:]
    for block in blocks:
        name, _, rest = block.partition(" ")
        words = re.sub(r"\{[^}]*\}|[A-Z_]{3,}", "", rest).split()
        assert words, f"{name} has no help text"


def test_the_readme_says_which_venv_its_commands_need():
    # the system's python has no torch: the README names the venv once, and the command a
    # new user copies first (the vLLM-style launcher) spells it out
    assert "run in the venv `make demo`\nbuilds: `source .venv/bin/activate` first" in README
    commands = re.findall(r"`(\S*python) scripts/vllm_style_refit\.py`", README)
    assert commands and all(c == ".venv/bin/python" for c in commands), commands
