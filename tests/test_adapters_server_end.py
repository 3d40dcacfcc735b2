"""``adapters.server_end.ServerRolloutEnd``'s call order against a server that runs calls
concurrently, as Ray does for verl's ``vLLMHttpServer`` (``max_concurrency`` > 1): the join
is fired, not awaited; an update awaits it first; a re-join with new groups finishes the
old groups' shutdown before it fires the new join; rollout ranks other than 0 call nothing.
(The whole path with real processes, verl's and vLLM's code: tests/real_vllm/
test_adapters_verl_vllm_server.py.)"""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_reshard.adapters.options import AdapterOptions
from megatron_reshard.adapters.server_end import ServerRolloutEnd
from megatron_reshard.adapters.topology import Topology
from megatron_reshard.errors import BadInputError, CallOrderError

KEY = "cfg"


class _Ref:
    def __init__(self, future):
        self.future = future

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


class _Server:
    """A Ray actor handle's face: each ``collective_rpc.remote`` runs at once on a pool of
    4 threads (calls may overlap); the log records each call's start and end."""

    def __init__(self, slow: dict):
        self.pool, self.slow, self.log, self.lock = ThreadPoolExecutor(4), slow, [], threading.Lock()
        self.collective_rpc = self
        self.clear_kv_cache = type("Clear", (), {"remote": lambda _: _Ref(self.pool.submit(
            lambda: None))})()

    def _run(self, method, kwargs):
        with self.lock:
            self.log.append(("start", method, kwargs.get("init_info", {}).get("ports_by_stage")))
        time.sleep(self.slow.get(method, 0.0))
        with self.lock:
            self.log.append(("end", method))

    def remote(self, method, timeout=None, kwargs=None):
        return _Ref(self.pool.submit(self._run, method, kwargs or {}))


def _topology(port):
    return Topology(host="127.0.0.1", ports=(port,), stage_world=1, gen_world=2, payload=b"p")


def _end(server):
    from megatron_reshard.adapters import clear_hand_off, hand_off

    clear_hand_off()
    hand_off(vllm_server=server)
    end = ServerRolloutEnd(AdapterOptions.parse({"gen_tp": 2}, KEY), KEY)
    end.prepare()
    clear_hand_off()
    return end


def test_a_rejoin_finishes_the_old_groups_shutdown_before_the_new_join_starts():
    server = _Server({"shutdown_weight_transfer_engine": 0.3})
    end = _end(server)
    end.join(_topology(1000), 0)
    asyncio.run(end.receive(1))
    end.join(_topology(1000), 0)  # the same groups: nothing is called
    end.join(_topology(2000), 0)  # a restarted trainer: new groups
    asyncio.run(end.receive(2))
    methods = [(e[0], e[1]) for e in server.log]
    assert methods.count(("start", "init_weight_transfer_engine")) == 2
    assert ("end", "shutdown_weight_transfer_engine") in methods, server.log  # finished
    shutdown_end = methods.index(("end", "shutdown_weight_transfer_engine"))
    second_init = [i for i, e in enumerate(server.log)
                   if e[:2] == ("start", "init_weight_transfer_engine")][1]
    assert shutdown_end < second_init, server.log
    assert server.log[second_init][2] == [2000]
    # each update after its join, in vLLM's order
    starts = [e[1] for e in server.log if e[0] == "start"]
    assert starts == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                      "finish_weight_update", "shutdown_weight_transfer_engine",
                      "init_weight_transfer_engine", "start_weight_update", "update_weights",
                      "finish_weight_update"]


def test_an_update_awaits_the_fired_join_first_and_other_ranks_call_nothing():
    server = _Server({"init_weight_transfer_engine": 0.3})
    end = _end(server)
    end.join(_topology(1000), 0)
    assert server.log in ([], [("start", "init_weight_transfer_engine", [1000])])  # fired
    result = asyncio.run(end.receive(7))
    assert result == {"version": 7, "drove_vllm_server": True, "updates": 1}
    assert server.log.index(("end", "init_weight_transfer_engine")) < [
        i for i, e in enumerate(server.log) if e[:2] == ("start", "start_weight_update")][0]
    other = _end(server)
    other.join(_topology(1000), 1)
    before = len(server.log)
    assert asyncio.run(other.receive(7)) == {"version": 7, "drove_vllm_server": False}
    other.close()
    assert len(server.log) == before


def test_out_of_order_and_bad_calls_are_refused():
    end = _end(_Server({}))
    with pytest.raises(CallOrderError, match="receive_weights before the refit groups"):
        asyncio.run(end.receive(1))
    with pytest.raises(BadInputError, match="rollout rank 2 outside the 2 rollout workers"):
        end.join(_topology(1000), 2)
    from megatron_reshard.adapters import clear_hand_off

    clear_hand_off()
    with pytest.raises(BadInputError, match=rf"{KEY}\.vllm_server: not set, and no vLLM server "
                                            r"was handed"):
        ServerRolloutEnd(AdapterOptions.parse({"gen_tp": 2}, KEY), KEY).prepare()
