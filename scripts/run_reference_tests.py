"""Run NeMo-RL's own unit tests for ``nccl_reshard_utils`` against our drop-in, unchanged.

Usage: .venv/bin/python scripts/run_reference_tests.py PATH [-- extra pytest args]

PATH is a NeMo-RL snapshot: either a git directory (bare mirror; the test file is read
from ``HEAD`` with ``git show``, or from ``--rev``) or a checked-out work tree. Nothing of
the reference project is kept in this repository: the test file is copied into a fresh
temporary folder, next to an import alias created there at run time (a ``nemo_rl``
package stub whose ``weight_sync.nccl_reshard_utils`` *is* ``megatron_reshard.nccl_reshard_utils``
via ``sys.modules``), and pytest runs in that folder with an empty config so neither
project's conftest or settings apply. Prints the pass/fail/error/skip counts; exits with
pytest's status.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

TEST_PATHS = ("tests/unit/weight_sync/test_nccl_reshard_utils.py",)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# The alias module replaces itself in sys.modules, so every name (public or private) of
# the drop-in is reachable exactly as the reference tests import it.
_ALIAS = (
    "import sys\n"
    "import megatron_reshard.nccl_reshard_utils as _drop_in\n"
    "sys.modules[__name__] = _drop_in\n"
)


def read_reference_file(snapshot: pathlib.Path, rel: str, rev: str,
                        who: str = "run_reference_tests") -> str:
    """The text of ``rel`` in the snapshot (git directory or work tree); ``who`` opens the
    error (scripts/run_framework_tests.py reads its snapshots with it too)."""
    if (snapshot / rel).is_file():
        return (snapshot / rel).read_text()
    git_dir = snapshot / ".git" if (snapshot / ".git").exists() else snapshot
    proc = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{rev}:{rel}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{who}: cannot read {rel} at {rev} from {snapshot}: "
                         f"{proc.stderr.strip()}")
    return proc.stdout


def stage(tmp: pathlib.Path, snapshot: pathlib.Path, rev: str) -> list[pathlib.Path]:
    """Write the alias package and the copied test files into ``tmp``; return the tests."""
    pkg = tmp / "nemo_rl" / "weight_sync"
    pkg.mkdir(parents=True)
    (tmp / "nemo_rl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "nccl_reshard_utils.py").write_text(_ALIAS)
    (tmp / "pytest.ini").write_text("[pytest]\n")
    tests = []
    for rel in TEST_PATHS:
        dest = tmp / "reference_tests" / pathlib.Path(rel).name
        dest.parent.mkdir(exist_ok=True)
        dest.write_text(read_reference_file(snapshot, rel, rev))
        tests.append(dest)
    return tests


def counts(junit_xml: pathlib.Path) -> dict[str, int]:
    suite = ET.parse(junit_xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total = int(suite.get("tests", 0))
    failed, errors, skipped = (int(suite.get(k, 0)) for k in ("failures", "errors", "skipped"))
    return {"total": total, "passed": total - failed - errors - skipped,
            "failed": failed, "errors": errors, "skipped": skipped}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", type=pathlib.Path, help="NeMo-RL git directory or work tree")
    parser.add_argument("--rev", default="HEAD", help="revision to read from a git directory")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reference_tests_") as name:
        tmp = pathlib.Path(name)
        tests = stage(tmp, args.snapshot.resolve(), args.rev)
        junit = tmp / "junit.xml"
        env = dict(os.environ)
        # The temp folder first (the alias), then this repository (the drop-in).
        env["PYTHONPATH"] = os.pathsep.join(
            [str(tmp), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp / "pytest.ini"),
               "--rootdir", str(tmp), f"--junitxml={junit}", *map(str, tests), *args.pytest_args]
        status = subprocess.run(cmd, cwd=tmp, env=env).returncode
        if not junit.exists():
            print(f"reference tests: pytest produced no report (exit status {status})")
            return status or 1
        c = counts(junit)
        print(f"reference tests: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
              f"{c['skipped']} skipped, of {c['total']} ({', '.join(TEST_PATHS)} at {args.rev})")
        return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
