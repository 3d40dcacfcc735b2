"""NeMo-RL's refit-transport plug point, with NeMo-RL's own factory: ``create_checkpoint_engine``
builds our engine from the ``refit_transport`` value (``"module:ClassName"``) and the options
of its ``refit_cfg`` scope; bad options name the key; two refits bit-exact against the
reference (a real megatron-core model on PP2, 2 spawned processes, into 2 generation
processes, TP2), each side driven in the order NeMo-RL's workers drive a checkpoint engine.

NeMo-RL is not on the package index (``nemo-rl`` there is a 0.0.0 placeholder without these
modules), so these tests run against a source snapshot whose root (holding ``nemo_rl/``) is
named by ``MEGATRON_RESHARD_NEMO_RL_SRC``, and skip without it. Its worker mixins
(``models/policy/workers/checkpoint_engine.py``, ``models/generation/vllm/checkpoint_engine.py``)
need transformers 5.x, so the two stand-in workers below restate the few lines of theirs
that call the engine; the factory and base class are NeMo-RL's own.
"""

import asyncio
import os
import re
import sys

import pytest

SRC = os.environ.get("MEGATRON_RESHARD_NEMO_RL_SRC")
if not SRC or not os.path.isdir(os.path.join(SRC, "nemo_rl")):
    pytest.skip("NeMo-RL is not on the package index: set MEGATRON_RESHARD_NEMO_RL_SRC to a "
                "snapshot of github.com/NVIDIA-NeMo/RL (the folder holding nemo_rl/)",
                allow_module_level=True)
sys.path.append(SRC)  # only while this module imports and runs (below)
from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine, create_checkpoint_engine  # noqa: E402

sys.path.remove(SRC)

from adapter_worlds import (GEN, TRAIN, RaisingWeights, engine_options,  # noqa: E402
                            exchange_metadata, mismatches, publish_reference, start)
from megatron_reshard.adapters import clear_hand_off, hand_off  # noqa: E402
from megatron_reshard.errors import BadInputError  # noqa: E402

TRANSPORT = "megatron_reshard.adapters.nemo_rl:MegatronReshardCheckpointEngine"


@pytest.fixture(scope="module", autouse=True)
def _nemo_rl_on_path():
    sys.path.append(SRC)
    yield
    sys.path.remove(SRC)


KEY = re.escape(f"policy.generation.refit_cfg['{TRANSPORT}']")  # as a regex
REFITS = 2


def nemo_engine(options: dict):
    """As NeMo-RL's workers build it: ``create_checkpoint_engine(refit_transport,
    bucket_size_bytes=..., engine_kwargs=<the refit_cfg scope, bucket ratio excluded>)``; the
    scope's schema adds ``release_after_refit``."""
    return create_checkpoint_engine(TRANSPORT, bucket_size_bytes=1 << 20,
                                    engine_kwargs={"release_after_refit": False, **options})


def test_the_factory_builds_our_engine_from_refit_transport():
    engine = nemo_engine({"gen_tp": 2})
    assert isinstance(engine, CheckpointEngine)
    assert engine.bucket_size == 1 << 20 and engine.ends.options.gen_tp == 2
    assert engine.get_target_weight_layout() is None  # full-tensor selection is never used


@pytest.mark.parametrize("options,match", [
    ({"gen_tp": 2, "bucket": 1}, rf"{KEY}: unknown option\(s\) \['bucket'\]"),
    ({"gen_tp": 2, "timeout_s": -1}, rf"{KEY}\.timeout_s: expected a number of seconds > 0"),
    ({"gen_tp": 2, "keep_as_loaded": "x"}, rf"{KEY}\.keep_as_loaded: expected a list"),
])
def test_bad_options_name_the_key(options, match):
    with pytest.raises(BadInputError, match=match):
        nemo_engine(options)


def test_a_rollout_worker_without_a_model_refuses_at_prepare_naming_the_option():
    # no Megatron parallel state here: the rollout side; nothing handed to this process
    clear_hand_off()
    engine = nemo_engine({"gen_tp": 2})
    with pytest.raises(BadInputError, match=rf"{KEY}\.target / {KEY}\.vllm_server: neither "
                                            r"set, and nothing was handed"):
        engine.prepare()
    with pytest.raises(BadInputError, match=rf"{KEY}\.vllm_server: verl only"):
        nemo_engine({"gen_tp": 2, "vllm_server": "vllm_server_0_0"})
    engine = nemo_engine({"gen_tp": 2, "target": "adapter_worlds:current_target"})
    with pytest.raises(BadInputError, match=rf"{KEY}\.target: adapter_worlds:current_target "
                                            r"returned None"):
        engine.prepare()


class _PolicyWorker:
    """A Megatron policy worker's face (``model``, ``rank``); ``checkpoint_engine_rpc``
    restates PolicyCheckpointEngineMixin's calls of the engine; ``hand_off``: the one line
    a worker subclass adds once its model is built (docs/ADAPTERS.md)."""

    def __init__(self, model, rank):
        self.model, self.rank, self.checkpoint_engine = model, rank, None
        self.weights = RaisingWeights()
        hand_off(model=self.model)

    async def checkpoint_engine_rpc(self, method, **kwargs):
        if method == "init_checkpoint_engine":
            self.checkpoint_engine = nemo_engine(kwargs["engine_kwargs"])
        elif method == "prepare_checkpoint_engine":
            return {**self.checkpoint_engine.prepare(), "rank": self.rank}
        elif method == "init_checkpoint_engine_process_group":
            self.checkpoint_engine.init_policy_process_group(worker_rank=self.rank, **kwargs)
        elif method == "send_weights_via_checkpoint_engine":
            await self.checkpoint_engine.send_weights(self.weights)
        elif method == "finalize_checkpoint_engine":
            self.checkpoint_engine.finalize()


class _VllmWorker:
    """A vLLM worker's face (``model_runner.model``, handed to the engine with ``hand_off``);
    ``update_weights_from_checkpoint_engine`` restates VllmCheckpointEngineMixin's loop."""

    def __init__(self, model):
        self.model_runner = type("ModelRunner", (), {"model": model})()
        self.checkpoint_engine, self.loaded = None, []
        hand_off(target=self.model_runner.model)

    def init_checkpoint_engine(self, engine_kwargs):
        self.checkpoint_engine = nemo_engine(engine_kwargs)

    def prepare_checkpoint_engine(self):
        import torch.distributed as dist

        return {**self.checkpoint_engine.prepare(), "rank": dist.get_rank()}

    def init_checkpoint_engine_process_group(self, rank, train_world_size, rollout_world_size,
                                             metadata):
        self.checkpoint_engine.init_rollout_process_group(
            rollout_rank=rank, train_world_size=train_world_size,
            rollout_world_size=rollout_world_size, metadata=metadata)

    async def update_weights_from_checkpoint_engine(self):
        async for weight_batch in self.checkpoint_engine.receive_weight_batches():
            self.loaded.append([name for name, _ in weight_batch])
        return True


def _nemo_job(job, src):
    if src not in sys.path:
        sys.path.append(src)
    import torch.distributed as dist

    from megatron_reshard.tools.e2e import perturb_

    control, side, rank, facts = start(job)
    options = engine_options(job, facts["family"], facts["vocab_size"])
    del options["target"]  # both models are handed off by the workers (the call, not the key)
    out = {"side": side, "rank": rank, "mismatches": [], "versions": [], "closed": []}
    if side == "train":
        worker = _PolicyWorker(facts["model"], dist.get_rank())
        asyncio.run(worker.checkpoint_engine_rpc("init_checkpoint_engine", engine_kwargs=options))
        mine = asyncio.run(worker.checkpoint_engine_rpc("prepare_checkpoint_engine"))
    else:
        worker = _VllmWorker(facts["model"])
        worker.init_checkpoint_engine(options)
        mine = worker.prepare_checkpoint_engine()
    metadata = exchange_metadata(control, job, mine, 0)
    topology = {"metadata": metadata, "train_world_size": TRAIN, "rollout_world_size": GEN}
    if side == "train":
        asyncio.run(worker.checkpoint_engine_rpc("init_checkpoint_engine_process_group",
                                                 **topology))
    else:
        worker.init_checkpoint_engine_process_group(dist.get_rank(), **topology)
    for step in range(REFITS):
        if side == "train":
            if step:
                perturb_(facts["model"], step)
            worker.weights = RaisingWeights()
            asyncio.run(worker.checkpoint_engine_rpc("send_weights_via_checkpoint_engine"))
            out["closed"].append(worker.weights.closed)
            publish_reference(control, rank, facts["model"], facts["family"],
                              facts["vocab_size"], step)
        else:
            assert asyncio.run(worker.update_weights_from_checkpoint_engine())
            out["versions"].append(worker.checkpoint_engine.last_refit["version"])
            out["mismatches"].append(mismatches(control, rank, step, facts["model"]))
    if side == "gen":
        out["loaded"] = worker.loaded
        worker.checkpoint_engine.finalize()
    else:
        asyncio.run(worker.checkpoint_engine_rpc("finalize_checkpoint_engine"))
    return out


def test_two_refits_through_nemo_rls_factory_are_bit_exact(pool):
    results = pool.run(_nemo_job, TRAIN + GEN, SRC, num_ports=3, timeout_s=300)
    for r in results[:TRAIN]:
        assert r["closed"] == [True] * REFITS  # NeMo-RL's full-tensor iterator, unread
    for r in results[TRAIN:]:
        assert r["mismatches"] == [[]] * REFITS, (r["rank"], r["mismatches"])
        assert r["versions"] == [1, 2]
        assert r["loaded"] == []  # no batch for NeMo-RL to load: the shards are in place
