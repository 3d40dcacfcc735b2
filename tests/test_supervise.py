"""tools.supervise (the both-launcher mode of scripts/vllm_style_refit.py): a run that keeps
making progress outlives the stall bound, a stalled one is killed, a survivor gets its
settle time after its peer ended and prints its error, and nothing a launcher spawned is
left behind. Real processes (small Python programs standing in for the launchers)."""

import os
import sys
import tempfile
import time

from megatron_reshard.tools.supervise import read_progress, start, supervise

# a launcher that makes ``steps`` steps of 0.1 s, writing its counter after each
STEPPING = ("import sys, time\nfrom megatron_reshard.tools.supervise import write_progress\n"
            "for k in range(int(sys.argv[2])):\n    time.sleep(0.1)\n"
            "    write_progress(sys.argv[1], k)\n")
# a launcher that spawns a child (its "rank"), prints the child's pid, then sleeps
SPAWNING = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print(child.pid, flush=True)\ntime.sleep(float(sys.argv[1]))\n"
            "print('survivor: failed, and says why', file=sys.stderr, flush=True)\n"
            "time.sleep(600)\n")


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                                      os.environ.get("PYTHONPATH")]))}


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs, after a SIGKILL has had up to 10 s to land."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return False
        except OSError:
            return False
        time.sleep(0.05)
    return True


def test_progress_keeps_a_run_alive_past_the_stall_bound():
    path = tempfile.mktemp()
    try:
        # 30 steps: ~3 s, longer than the stall bound, but never a stall of 2 s
        procs = {"train": start([sys.executable, "-c", "import time; time.sleep(0.2)"]),
                 "gen": start([sys.executable, "-c", STEPPING, path, "30"], env=_env())}
        codes, why = supervise(procs, lambda: read_progress(path), stall_s=2.0, settle_s=60)
        assert codes == {"train": 0, "gen": 0} and why is None
        assert read_progress(path) == "29"
    finally:
        for p in (path, path + ".tmp"):
            if os.path.exists(p):
                os.remove(p)


def test_a_stalled_run_is_killed_with_everything_it_spawned():
    procs = {"train": start([sys.executable, "-c", SPAWNING, "600"], stdout=-1, text=True),
             "gen": start([sys.executable, "-c", "import time; time.sleep(600)"])}
    codes, why = supervise(procs, lambda: None, stall_s=1.0, settle_s=60)
    assert codes == {"train": None, "gen": None} and why == "no progress in the first 1 s"
    child = int(procs["train"].stdout.readline())
    assert not _alive(child)  # the launcher's rank went with it


def test_a_survivor_gets_its_settle_time_and_says_why():
    # "gen" fails at once; "train" fails 1 s later, prints why, then hangs (a stopped rank)
    procs = {"gen": start([sys.executable, "-c", "raise SystemExit(1)"]),
             "train": start([sys.executable, "-c", SPAWNING, "1"], stdout=-1, stderr=-1,
                            text=True)}
    codes, why = supervise(procs, lambda: None, stall_s=600, settle_s=6.0)
    assert codes == {"gen": 1, "train": None}
    assert why == "train still running 6 s after gen ended"
    assert "survivor: failed, and says why" in procs["train"].stderr.read()
    assert not _alive(int(procs["train"].stdout.readline()))
