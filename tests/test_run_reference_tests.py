"""scripts/run_reference_tests.py: runs a snapshot's test file against the drop-in through
the run-time ``nemo_rl`` alias, and counts passes and failures (on a small stand-in snapshot,
not the reference project's file)."""

import pathlib
import subprocess
import sys
import textwrap

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "run_reference_tests.py"
REL = "tests/unit/weight_sync/test_nccl_reshard_utils.py"

STAND_IN = textwrap.dedent(
    """
    import megatron_reshard.nccl_reshard_utils as drop_in
    from nemo_rl.weight_sync.nccl_reshard_utils import _LAYER_RE, build_mesh_info
    import nemo_rl.weight_sync.nccl_reshard_utils as aliased

    def test_alias_is_the_drop_in_module():
        assert aliased is drop_in and _LAYER_RE is drop_in._LAYER_RE

    def test_drop_in_function_runs():
        assert build_mesh_info(4, 0, tp_size=4)[1] == {"tp": 0}

    def test_this_one_fails():
        assert False
    """
)


def run(snapshot: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(snapshot)], capture_output=True, text=True,
                          timeout=300)


def test_work_tree_snapshot_runs_through_the_alias_and_counts(tmp_path):
    (tmp_path / REL).parent.mkdir(parents=True)
    (tmp_path / REL).write_text(STAND_IN)
    proc = run(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reference tests: 2 passed, 1 failed, 0 errors, 0 skipped, of 3" in proc.stdout, proc.stdout


def test_git_directory_snapshot_is_read_at_head(tmp_path):
    work = tmp_path / "work"
    (work / REL).parent.mkdir(parents=True)
    (work / REL).write_text(STAND_IN.replace("assert False", "assert True"))
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(git + ["add", REL], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "stand-in"], check=True)
    (work / REL).unlink()  # only the git directory holds the file now
    proc = run(work / ".git")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reference tests: 3 passed, 0 failed" in proc.stdout


def test_missing_test_file_is_a_clear_error(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode != 0
    assert REL in proc.stderr + proc.stdout
