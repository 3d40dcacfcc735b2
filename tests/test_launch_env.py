"""tools.launch_env: the environment a launcher sets for the processes it starts. With the
quieter logs, a peer of a store host killed by SIGKILL says what happened (the library's or
torch's one-line error) without torch's C++ stack frames; a value the user set is kept.
Real processes: a TCPStore host, killed, and a client blocked on it."""

import os
import subprocess
import sys
import time

from megatron_reshard.tools.launch_env import QUIET_ENV_DEFAULTS, apply_launch_defaults
from megatron_reshard.tools.worlds import free_ports

HOST = ("import sys, time\nfrom datetime import timedelta\nimport torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), None, True, "
        "timeout=timedelta(seconds=60), wait_for_workers=False)\n"
        "print('up', flush=True)\ntime.sleep(600)\n")
CLIENT = ("import sys\nfrom datetime import timedelta\nimport torch.distributed as dist\n"
          "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), None, False, "
          "timeout=timedelta(seconds=60), wait_for_workers=False)\n"
          "print('connected', flush=True)\ns.get('never set')\n")


def test_defaults_keep_what_the_user_set():
    env = {"TORCH_CPP_LOG_LEVEL": "INFO"}
    apply_launch_defaults(env)
    assert env["TORCH_CPP_LOG_LEVEL"] == "INFO"
    assert env["KINETO_LOG_LEVEL"] == QUIET_ENV_DEFAULTS["KINETO_LOG_LEVEL"]
    assert env["NCCL_NVLS_ENABLE"] == "0"


def _client_after_host_killed(env: dict) -> str:
    port = str(free_ports(1)[0])
    host = subprocess.Popen([sys.executable, "-c", HOST, port], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert host.stdout.readline().strip() == "up"
        client = subprocess.Popen([sys.executable, "-c", CLIENT, port], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        assert client.stdout.readline().strip() == "connected"
        time.sleep(0.5)  # the client is blocked in its get
        host.kill()
        _, err = client.communicate(timeout=120)
    finally:
        host.kill()
        host.wait()
    assert client.returncode == 1
    return err


def test_a_killed_store_host_leaves_no_cpp_frames_on_its_peer():
    plain = {k: v for k, v in os.environ.items() if k not in QUIET_ENV_DEFAULTS}
    quiet = dict(plain)
    apply_launch_defaults(quiet)
    loud, said = _client_after_host_killed(plain), _client_after_host_killed(quiet)
    assert "frame #" in loud  # what torch prints by default: the test sees the noise
    assert "frame #" not in said and "Exception raised from" not in said, said
    assert "Connection was likely closed" in said  # the error itself is still there
