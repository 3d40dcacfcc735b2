"""Run verl's and NeMo-RL's own checkpoint-engine unit tests that apply to a third-party
backend, unchanged, in the environment the adapters run in (docs/ADAPTERS.md, "The
frameworks' own tests").

Usage: .venv/bin/python scripts/run_framework_tests.py [--verl SNAP] [--nemo-rl SNAP]
       [--deps DIR [--install-deps]] [-- extra pytest args]

SNAP is a snapshot of the framework's repository: a git directory (bare mirror; files read
with ``git show REV:path``, ``--verl-rev`` / ``--nemo-rl-rev``) or a work tree. Nothing of
either project is kept in this repository: the test files are copied into a fresh temporary
folder with an empty pytest config (neither project's conftest or settings apply). verl's
code is the installed 0.9.1 (``.verl-site``, ``make install-verl``; its wheel has no tests);
NeMo-RL's is the snapshot's ``nemo_rl/`` (not on the package index).

Those modules import more than the adapters do (verl's ``engine_workers``: ``datasets``,
transformers 5.x; NeMo-RL's workers: transformers >= 5 and < 5.12, pillow, pyzmq, rich,
pynvml), which neither test venv holds (the main one has transformers 4.57, the vLLM one
5.20). ``--deps DIR`` is a ``pip install --target`` folder with the pins below, put first on
the tests' path (so only this subprocess sees its transformers); ``--install-deps`` fills
it (about 200 MB, without the packages' own dependencies).

Prints the pass/fail/error/skip counts per framework; exits with pytest's status.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_reference_tests import counts, read_reference_file  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VERL_SITE = REPO_ROOT / ".verl-site"

# The tests that exercise the plug point a third-party engine goes through (each with the
# framework's own stand-in engine: none takes the backend as a parameter). Why the others
# in these folders do not apply: docs/ADAPTERS.md.
VERL_TESTS = (
    # the actor and rollout workers hand global_steps to send_weights / receive_weights
    # (our engine's weight version)
    "tests/checkpoint_engine/test_global_steps_on_cpu.py",
)
NEMO_RL_TESTS = (
    # the refit_cfg scope named by a "module:Class" transport becomes the engine's kwargs
    "tests/unit/weight_sync/test_checkpoint_engine_config.py::"
    "test_checkpoint_engine_refit_config_resolves_custom_backend_scope",
    "tests/unit/weight_sync/test_checkpoint_engine_config.py::"
    "test_checkpoint_engine_refit_config_rejects_unknown_selector",
    # the driver's lifecycle of any engine: prepare, groups, send/receive, finalize
    "tests/unit/weight_sync/test_checkpoint_engine_weight_synchronizer.py::"
    "TestCheckpointEngineWeightSynchronizer::test_sync_weights_runs_checkpoint_engine_lifecycle",
    "tests/unit/weight_sync/test_checkpoint_engine_weight_synchronizer.py::"
    "TestCheckpointEngineWeightSynchronizer::test_release_after_refit_reprepares_each_sync",
    "tests/unit/weight_sync/test_checkpoint_engine_weight_synchronizer.py::"
    "TestCheckpointEngineWeightSynchronizer::test_sync_weights_raises_when_generation_update_fails",
    "tests/unit/weight_sync/test_checkpoint_engine_weight_synchronizer.py::"
    "TestCheckpointEngineWeightSynchronizer::test_sort_ranked_metadata_orders_by_rank",
    "tests/unit/weight_sync/test_checkpoint_engine_weight_synchronizer.py::"
    "TestCheckpointEngineWeightSynchronizer::"
    "test_ordered_generation_metadata_handles_dp_groups_with_colliding_ranks",
    "tests/unit/weight_sync/test_checkpoint_engine_weight_synchronizer.py::"
    "TestCheckpointEngineFactory",
    # an engine whose get_target_weight_layout() is None gets the whole iterator
    "tests/unit/models/policy/test_megatron_checkpoint_engine.py::"
    "test_checkpoint_engine_weight_iterator_keeps_weights_without_target_layout",
    # the vLLM worker mixin: rollout rank, lifecycle calls, batches loaded (none for ours)
    "tests/unit/models/generation/test_vllm_checkpoint_engine.py::"
    "test_resolve_rollout_rank_handles_external_and_engine_local_dp",
    "tests/unit/models/generation/test_vllm_checkpoint_engine.py::"
    "test_checkpoint_engine_worker_lifecycle",
    "tests/unit/models/generation/test_vllm_checkpoint_engine.py::"
    "test_update_weights_from_checkpoint_engine_async_loads_all_batches",
    "tests/unit/models/generation/test_vllm_checkpoint_engine.py::"
    "test_checkpoint_engine_rpc_mixins_reduce_update_results",
)
# pins of what the frameworks' test modules import beyond the adapters' environment
DEPS = ("transformers==5.11.0", "huggingface_hub==1.33.0", "tokenizers==0.22.2",
        "typer==0.29.3", "shellingham==1.5.4", "httpx==0.29.0", "httpcore==1.0.9",
        "h11==0.16.0", "hf-xet==1.8.0", "datasets==4.8.5", "dill==0.4.1",
        "multiprocess==0.70.19", "xxhash==4.1.0", "pyarrow==26.0.1", "fsspec==2026.9.0",
        "pandas==3.1.1", "python-dateutil==4.0.0", "pytz==2026.6", "tzdata==2026.6",
        "pillow==13.0.0", "pyzmq==27.3.0", "rich==15.0.0", "markdown-it-py==4.3.0",
        "mdurl==0.1.2", "pygments==2.21.0", "nvidia-ml-py==13.615.71")


def read_file(snapshot: pathlib.Path, rel: str, rev: str) -> str:
    """The text of ``rel`` in the snapshot (git directory or work tree)."""
    return read_reference_file(snapshot, rel, rev, who="run_framework_tests")


def export_package(snapshot: pathlib.Path, package: str, rev: str, dest: pathlib.Path) -> None:
    """Put the snapshot's ``package/`` under ``dest`` (a work tree's is linked, a git
    directory's is extracted with ``git archive``)."""
    if (snapshot / package).is_dir():
        (dest / package).symlink_to(snapshot / package)
        return
    git_dir = snapshot / ".git" if (snapshot / ".git").exists() else snapshot
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", rev, package],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def stage(tmp: pathlib.Path, framework: str, snapshot: pathlib.Path, rev: str,
          selection: tuple) -> list[str]:
    """Copy the selected tests' files into ``tmp/<framework>``; return pytest node ids."""
    folder = tmp / framework
    folder.mkdir()
    nodes = []
    for selected in selection:
        rel, _, inner = selected.partition("::")
        dest = folder / pathlib.Path(rel).name
        if not dest.exists():
            dest.write_text(read_file(snapshot, rel, rev))
        nodes.append(str(dest) + (f"::{inner}" if inner else ""))
    return nodes


def install_deps(deps: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(deps), *DEPS], check=True)
    (deps / ".installed").write_text("\n".join(DEPS) + "\n")


def run(framework: str, nodes: list[str], path: list[str], tmp: pathlib.Path,
        pytest_args: list[str]) -> tuple[int, dict]:
    xml = tmp / f"{framework}.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    # -p no:cacheprovider: nothing written next to the copied tests; rootdir: the empty config
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-c", str(tmp / "pytest.ini"), "--rootdir", str(tmp),
                           f"--junitxml={xml}", *nodes, *pytest_args], cwd=tmp, env=env)
    return proc.returncode, (counts(xml) if xml.exists() else {})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", type=pathlib.Path, help="verl snapshot (git dir or tree)")
    parser.add_argument("--verl-rev", default="HEAD")
    parser.add_argument("--verl-site", type=pathlib.Path, default=VERL_SITE)
    parser.add_argument("--nemo-rl", type=pathlib.Path, help="NeMo-RL snapshot")
    parser.add_argument("--nemo-rl-rev", default="HEAD")
    parser.add_argument("--deps", type=pathlib.Path, help="pip --target folder of DEPS")
    parser.add_argument("--install-deps", action="store_true", help="fill --deps first")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.verl is None and args.nemo_rl is None:
        parser.error("give --verl and/or --nemo-rl")
    if not (args.verl_site / "verl").is_dir():
        parser.error(f"--verl-site {args.verl_site}: no verl there (make install-verl)")
    if args.install_deps:
        if args.deps is None:
            parser.error("--install-deps needs --deps")
        install_deps(args.deps)
    if args.deps is not None and not (args.deps / ".installed").exists():
        parser.error(f"--deps {args.deps}: not filled (run with --install-deps)")
    status = 0
    with tempfile.TemporaryDirectory(prefix="framework_tests_") as name:
        tmp = pathlib.Path(name)
        (tmp / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: NeMo-RL's marker\n")
        base = ([str(args.deps)] if args.deps else []) + [str(REPO_ROOT)]
        # the frameworks' own packages after everything of the venv's except the deps
        for framework, snapshot, rev, selection in (
                ("verl", args.verl, args.verl_rev, VERL_TESTS),
                ("nemo_rl", args.nemo_rl, args.nemo_rl_rev, NEMO_RL_TESTS)):
            if snapshot is None:
                continue
            nodes = stage(tmp, framework, snapshot, rev, selection)
            if framework == "nemo_rl":
                src = tmp / "nemo_rl_src"
                src.mkdir()
                export_package(snapshot, "nemo_rl", rev, src)
                path = base + [str(src), str(args.verl_site)]  # Ray: from verl's site
            else:
                path = base + [str(args.verl_site)]
            code, result = run(framework, nodes, path, tmp, args.pytest_args)
            print(f"run_framework_tests {framework}: {result}", flush=True)
            status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
