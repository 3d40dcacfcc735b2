"""Run one snippet of Python in two fresh interpreters with different hash seeds, at once
(each interpreter's start is most of such a test's time): what a fingerprint must not
depend on."""

import subprocess
import sys


def outputs_under_two_hash_seeds(code: str) -> set:
    """The set of stripped stdouts of ``python -c code`` under PYTHONHASHSEED 1 and 2."""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={"PYTHONHASHSEED": seed})
             for seed in ("1", "2")]
    done = [(p.communicate(timeout=300), p.returncode) for p in procs]
    assert all(rc == 0 for _, rc in done), [err for (_, err), _ in done]
    return {stdout.strip() for (stdout, _), _ in done}
