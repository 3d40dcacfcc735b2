"""scripts/run_framework_tests.py: verl's and NeMo-RL's own checkpoint-engine unit tests that
apply to a third-party backend, run unchanged from a temporary folder.

The real run needs both snapshots and the deps folder (``--install-deps``): it skips unless
``MEGATRON_RESHARD_VERL_SRC`` (a verl snapshot: git directory or work tree),
``MEGATRON_RESHARD_NEMO_RL_SRC`` (as tests/test_adapters_nemo_rl.py: the folder holding
``nemo_rl/`` and ``tests/``, or a git directory) and ``MEGATRON_RESHARD_FRAMEWORK_TEST_DEPS``
name them. The staging and counting are checked on a small stand-in snapshot."""

import ast
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "run_framework_tests.py"
SITE = pathlib.Path(os.environ.get("MEGATRON_RESHARD_VERL_SITE", ROOT / ".verl-site"))
VERL_REL = "tests/checkpoint_engine/test_global_steps_on_cpu.py"

needs_verl = pytest.mark.skipif(not (SITE / "verl").is_dir(),
                                reason=f"verl 0.9.1 is not installed at {SITE}: make install-verl")

STAND_IN = textwrap.dedent(
    """
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    def test_verl_is_the_installed_one():
        import verl
        assert verl.__version__ == "0.9.1"

    def test_this_one_fails():
        assert CheckpointEngineWorker is None
    """
)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--verl-site", str(SITE), *args],
                          capture_output=True, text=True, timeout=600)


def _result(stdout: str, framework: str) -> dict:
    match = re.search(rf"run_framework_tests {framework}: (\{{.*\}})", stdout)
    assert match, stdout
    return ast.literal_eval(match.group(1))


@needs_verl
def test_a_git_directory_snapshot_is_staged_run_and_counted(tmp_path):
    work = tmp_path / "work"
    (work / VERL_REL).parent.mkdir(parents=True)
    (work / VERL_REL).write_text(STAND_IN)
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(git + ["add", VERL_REL], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "stand-in"], check=True)
    (work / VERL_REL).unlink()  # only the git directory holds the file now
    proc = run("--verl", str(work / ".git"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _result(proc.stdout, "verl") == {"total": 2, "passed": 1, "failed": 1, "errors": 0,
                                            "skipped": 0}


def test_no_framework_and_unfilled_deps_are_refused(tmp_path):
    assert "give --verl and/or --nemo-rl" in run().stderr
    proc = run("--verl", str(tmp_path), "--deps", str(tmp_path))
    assert proc.returncode != 0


SNAPSHOTS = {k: os.environ.get(k) for k in ("MEGATRON_RESHARD_VERL_SRC",
                                            "MEGATRON_RESHARD_NEMO_RL_SRC",
                                            "MEGATRON_RESHARD_FRAMEWORK_TEST_DEPS")}


@needs_verl
@pytest.mark.skipif(not all(SNAPSHOTS.values()),
                    reason=f"set {', '.join(k for k, v in SNAPSHOTS.items() if not v)} "
                           f"(framework snapshots, the deps folder: scripts/run_framework_tests.py)")
def test_the_frameworks_applicable_tests_all_pass():
    proc = run("--verl", SNAPSHOTS["MEGATRON_RESHARD_VERL_SRC"],
               "--nemo-rl", SNAPSHOTS["MEGATRON_RESHARD_NEMO_RL_SRC"],
               "--deps", SNAPSHOTS["MEGATRON_RESHARD_FRAMEWORK_TEST_DEPS"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert _result(proc.stdout, "verl") == {"total": 2, "passed": 2, "failed": 0, "errors": 0,
                                            "skipped": 0}
    assert _result(proc.stdout, "nemo_rl") == {"total": 19, "passed": 19, "failed": 0,
                                               "errors": 0, "skipped": 0}
