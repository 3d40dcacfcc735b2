"""verl 0.9.1's checkpoint-engine plug point, with verl's own code: the engine built from a
config dict as verl's workers build it (``CheckpointEngineConfig`` through
``omega_conf_to_dataclass``, ``custom_backend_module`` imported, ``CheckpointEngineRegistry.new``),
errors naming the configuration key, and two refits bit-exact against the reference: a real
megatron-core model (PP2, 2 spawned processes) into 2 generation processes (TP2), each
update run as verl's ``CheckpointEngineManager`` orders it (``prepare`` → ``build_topology``
→ ``init_process_group`` → update → ``finalize``), the rollout side through verl's own
``CheckpointEngineWorker.update_weights`` and ``execute_checkpoint_engine``.

verl comes from ``make install-verl`` (``.verl-site``: verl and only what its
checkpoint-engine modules import, beside the main venv). ``verl.workers.engine_workers``
(the actor worker) is not importable there (it needs ``datasets`` and a newer
``huggingface_hub``), so the actor side restates its three lines for a non-"naive" backend.
"""

import asyncio
import os
import pathlib
import sys
from types import SimpleNamespace

import pytest

SITE = os.environ.get("MEGATRON_RESHARD_VERL_SITE",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".verl-site"))
if not os.path.isdir(os.path.join(SITE, "verl")):
    pytest.skip(f"verl 0.9.1 is not installed at {SITE}: run `make install-verl`",
                allow_module_level=True)
# on sys.path only while this module imports and runs (after the main venv's packages, so
# never shadowing one of them): the rest of the suite sees the main venv as it is
sys.path.append(SITE)
from omegaconf import OmegaConf  # noqa: E402
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineWorker  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.config import CheckpointEngineConfig  # noqa: E402

sys.path.remove(SITE)


@pytest.fixture(scope="module", autouse=True)
def _verl_on_path():
    sys.path.append(SITE)
    yield
    sys.path.remove(SITE)


from adapter_worlds import (GEN, TRAIN, RaisingWeights, engine_options,  # noqa: E402
                            exchange_metadata, mismatches, publish_reference, start)
from megatron_reshard.adapters import clear_hand_off, hand_off  # noqa: E402
from megatron_reshard.adapters.core import TrainEnd  # noqa: E402
from megatron_reshard.errors import BadInputError  # noqa: E402

KEY = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.megatron_reshard"
REFITS = 2


def verl_engine(options: dict, actor_rank=None):
    """The engine as verl 0.9.1 builds it: the rollout config's ``checkpoint_engine``
    section through ``omega_conf_to_dataclass``, ``import_external_libs(custom_backend_module)``,
    then ``CheckpointEngineRegistry.new(backend, [is_master=...,] bucket_size=...,
    **engine_kwargs[backend])`` (engine_workers.py step 4; CheckpointEngineWorker.__init__)."""
    section = OmegaConf.create({"backend": "megatron_reshard",
                                "custom_backend_module": "megatron_reshard.adapters.verl",
                                "update_weights_bucket_megabytes": 64,
                                "engine_kwargs": {"megatron_reshard": options}})
    cfg = omega_conf_to_dataclass(section, CheckpointEngineConfig)
    engine_kwargs = cfg.engine_kwargs.get(cfg.backend, {})
    import_external_libs(cfg.custom_backend_module or None)
    master = {} if actor_rank is None else {"is_master": actor_rank == 0}
    return CheckpointEngineRegistry.new(cfg.backend, bucket_size=cfg.update_weights_bucket_megabytes
                                        << 20, **master, **engine_kwargs)


def test_the_registry_builds_our_engine_from_the_config():
    engine = verl_engine({"gen_tp": 2, "group_backend": "gloo"}, actor_rank=0)
    assert isinstance(engine, CheckpointEngine)
    assert type(engine).__module__ == "megatron_reshard.adapters.verl"
    assert CheckpointEngineRegistry.get("megatron_reshard") is type(engine)
    assert engine.bucket_size == 64 << 20 and engine.ends.options.gen_tp == 2


@pytest.mark.parametrize("options,match", [
    ({"gen_tp": 2, "gen_tpp": 4}, rf"{KEY}: unknown option\(s\) \['gen_tpp'\]"),
    ({}, rf"{KEY}\.gen_tp: required"),
    ({"gen_tp": 0}, rf"{KEY}\.gen_tp: expected an int >= 1, found 0"),
    ({"gen_tp": 2, "gen_world_size": 3}, rf"{KEY}\.gen_world_size: expected a multiple of gen_tp"),
    ({"gen_tp": 2, "group_backend": "mpi"}, rf"{KEY}\.group_backend: expected one of"),
    ({"gen_tp": 2, "ports": "29500"}, rf"{KEY}\.ports: expected a list of ports"),
    ({"gen_tp": 2, "model": "no_colon"}, rf"{KEY}\.model: expected a 'module:function' path"),
])
def test_bad_configuration_names_the_key(options, match):
    with pytest.raises(BadInputError, match=match):
        verl_engine(options)


def _meta(side, **kw):
    return {"megatron_reshard": 1, "side": side, **kw}


def _train_meta(stage, local, payload=None, host="10.0.0.1"):
    return _meta("train", stage=stage, pp=2, stage_local_rank=local, stage_world=1, host=host,
                 port=29500 + stage, gen_world=2, payload=payload)


def test_build_topology_refuses_a_rollout_world_the_config_does_not_name():
    # the class as verl's driver gets it (CheckpointEngineManager.__init__)
    import_external_libs("megatron_reshard.adapters.verl")
    cls = CheckpointEngineRegistry.get("megatron_reshard")
    metadata = [_train_meta(0, 0, b"p"), _train_meta(1, 0)] + [_meta("rollout")] * 3
    with pytest.raises(BadInputError, match=rf"{KEY}\.gen_world_size: 2, but the framework has 3"):
        cls.build_topology(2, 3, metadata)
    metadata = [_train_meta(0, 0, b"p"), _train_meta(1, 0, host="10.0.0.2")] + [_meta("rollout")] * 2
    with pytest.raises(BadInputError, match=rf"{KEY}\.host: .* need one host"):
        cls.build_topology(2, 2, metadata)
    actor, rollout = cls.build_topology(2, 2, [_train_meta(0, 0, b"p"), _train_meta(1, 0)]
                                        + [_meta("rollout")] * 2)
    assert actor["rollout_rank"] == [None, None] and rollout["rollout_rank"] == [0, 1]
    assert rollout["topology"][0]["ports"] == [29500, 29501]


class _ActorWorker:
    """What verl's ActorRolloutRefWorker holds for its engine: ``checkpoint_engine`` and the
    Megatron engine's chunks (``actor.engine.module``); ``execute_checkpoint_engine`` is
    verl's own body, ``update_weights`` restates its non-"naive" branch. ``hand_off``: the
    one line a worker subclass adds after verl's ``init_model`` (docs/ADAPTERS.md)."""

    execute_checkpoint_engine = CheckpointEngineWorker.execute_checkpoint_engine.__wrapped__

    def __init__(self, engine, model, hand_off_model=True):
        self.checkpoint_engine, self.weights = engine, RaisingWeights()
        self.actor = SimpleNamespace(engine=SimpleNamespace(
            module=[model], get_per_tensor_param=lambda: (self.weights, None)))
        if hand_off_model:
            hand_off(model=self.actor.engine.module)

    def prepare_train_end(self, end):
        """A call from inside the worker (the frame the old lookup searched)."""
        return end.prepare()

    async def update_weights(self, global_steps=None):
        per_tensor_param, _ = self.actor.engine.get_per_tensor_param()
        metrics = await self.checkpoint_engine.send_weights(per_tensor_param,
                                                            global_steps=global_steps)
        return metrics or {}


class _ServerAdapter:
    """The rollout server adapter's face: records what verl hands it to load."""

    def __init__(self):
        self.loaded, self.global_steps, self.wire_formats = [], [], []

    async def update_weights(self, weights, global_steps=None, wire_format=None, **kwargs):
        self.loaded.append([name async for name, _ in weights])
        self.global_steps.append(global_steps)
        self.wire_formats.append(wire_format)


def test_verls_rollout_worker_with_nothing_handed_refuses_at_prepare_naming_both_keys():
    # verl's stock CheckpointEngineWorker: vLLM's model lives in other processes, and the
    # engine is told neither where to write (target) nor which vLLM server to drive
    clear_hand_off()
    worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
    worker.checkpoint_engine, worker.server_adapter = verl_engine({"gen_tp": 2}), _ServerAdapter()
    with pytest.raises(BadInputError, match=rf"{KEY}\.target / {KEY}\.vllm_server: neither set, "
                                            r"and nothing was handed .*hand_off\(target=\.\.\.\)"):
        CheckpointEngineWorker.execute_checkpoint_engine.__wrapped__(worker, "prepare")


def test_a_model_held_by_the_calling_worker_but_not_handed_off_is_refused_naming_the_key():
    """The engine never searches its callers for a model: verl's actor worker holds the
    chunks at ``actor.engine.module``, but without ``hand_off`` or the ``model`` option the
    training end refuses, naming both (the frame lookup this replaced took it silently)."""
    clear_hand_off()
    engine = verl_engine({"gen_tp": 2, "group_backend": "gloo"}, actor_rank=0)
    import torch

    worker = _ActorWorker(engine, torch.nn.Linear(2, 2), hand_off_model=False)
    end = TrainEnd(engine.ends.options, KEY)
    with pytest.raises(BadInputError, match=rf"{KEY}\.model: not set, and nothing was handed to "
                                            r"this process: .*hand_off\(model=\.\.\.\)"):
        worker.prepare_train_end(end)


@pytest.mark.parametrize("given,match", [
    ({"model": "chunks"}, r"hand_off\(model=\.\.\.\): expected a torch.nn.Module or a non-empty list"),
    ({"model": []}, r"hand_off\(model=\.\.\.\): expected"),
    ({"target": [1]}, r"hand_off\(target=\.\.\.\): expected the vLLM model"),
    ({"vllm_server": object()}, r"hand_off\(vllm_server=\.\.\.\): expected a Ray actor handle"),
])
def test_hand_off_refuses_what_is_not_a_model_or_server(given, match):
    with pytest.raises(BadInputError, match=match):
        hand_off(**given)


def test_the_vllm_server_option_names_its_key_when_ray_is_absent_or_it_is_bad():
    with pytest.raises(BadInputError, match=rf"{KEY}\.vllm_server: expected the Ray actor name"):
        verl_engine({"gen_tp": 2, "vllm_server": 3})
    clear_hand_off()
    # not in a Ray worker: the name cannot be looked up; refused at prepare (no group yet)
    with pytest.raises(BadInputError, match=rf"{KEY}\.vllm_server: 'vllm_server_0_0' names a "
                                            r"Ray actor, but Ray is not initialized"):
        verl_engine({"gen_tp": 2, "vllm_server": "vllm_server_0_0"}).prepare()
    with pytest.raises(BadInputError, match=rf"{KEY}\.gen_world_size: 4, but a rollout side "
                                            r"driving verl's vLLM server refits one server"):
        verl_engine({"gen_tp": 2, "gen_world_size": 4, "vllm_server": "s"}).prepare()


def test_an_engine_driving_a_handed_vllm_server_tells_verl_delta_flush():
    """verl's ServerAdapter reads a "delta_flush" stream before any RPC of its own
    (docs/ADAPTERS.md); an engine writing in place keeps "named_tensors"."""
    class Handle:  # a Ray actor handle's face
        collective_rpc = SimpleNamespace(remote=lambda *a, **k: None)

    clear_hand_off()
    hand_off(vllm_server=Handle())
    try:
        engine = verl_engine({"gen_tp": 2})
        assert engine.wire_format == "named_tensors"  # nothing prepared yet
        engine.prepare()  # the rollout side beside the server: no model needed
        assert engine.wire_format == "delta_flush"
        with pytest.raises(BadInputError, match=rf"{KEY}\.target / {KEY}\.vllm_server: both "
                                                r"given"):
            verl_engine({"gen_tp": 2, "target": "adapter_worlds:current_target"}).prepare()
    finally:
        clear_hand_off()


def _verl_job(job, site):
    if site not in sys.path:
        sys.path.append(site)
    from megatron_reshard.tools.e2e import perturb_

    control, side, rank, facts = start(job)
    options = engine_options(job, facts["family"], facts["vocab_size"])
    if side == "train":
        engine = verl_engine(options, actor_rank=rank)
        worker, execute = _ActorWorker(engine, facts["model"]), None
        execute = worker.execute_checkpoint_engine
    else:
        engine = verl_engine(options)
        worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
        worker.checkpoint_engine, worker.server_adapter = engine, _ServerAdapter()
        execute = CheckpointEngineWorker.execute_checkpoint_engine.__wrapped__.__get__(worker)
    out = {"side": side, "rank": rank, "metrics": [], "closed": [], "mismatches": [],
           "versions": []}
    for step in range(REFITS):  # each update as CheckpointEngineManager.update_weights runs it
        metadata = exchange_metadata(control, job, execute("prepare"), step)
        actor_kwargs, rollout_kwargs = type(engine).build_topology(TRAIN, GEN, metadata)
        mine = actor_kwargs if side == "train" else rollout_kwargs
        execute("init_process_group", **{k: v[rank] for k, v in mine.items()})
        if side == "train":
            if step:
                perturb_(facts["model"], step)
            worker.weights = RaisingWeights()
            out["metrics"].append(asyncio.run(worker.update_weights(global_steps=step + 1)))
            out["closed"].append(worker.weights.closed)
            publish_reference(control, rank, facts["model"], facts["family"],
                              facts["vocab_size"], step)
        else:
            asyncio.run(CheckpointEngineWorker.update_weights.__wrapped__(
                worker, global_steps=step + 1))
            out["versions"].append(engine.last_refit["version"])
            out["mismatches"].append(mismatches(control, rank, step, facts["model"]))
        execute("finalize")
        out.setdefault("groups", []).append(id(engine.ends.train.group if side == "train"
                                               else engine.ends.rollout.state.groups))
    if side == "gen":
        adapter = worker.server_adapter
        out.update(loaded=adapter.loaded, global_steps=adapter.global_steps,
                   wire_formats=adapter.wire_formats)
    engine.shutdown()
    return out


def test_two_refits_through_verls_own_calls_are_bit_exact(pool):
    results = pool.run(_verl_job, TRAIN + GEN, SITE, num_ports=3, timeout_s=300)
    train, gen = results[:TRAIN], results[TRAIN:]
    for r in train:
        # verl's iterator of gathered full tensors was closed unread, every update
        assert r["closed"] == [True] * REFITS
        assert [m["megatron_reshard/version"] for m in r["metrics"]] == [1, 2]
    for r in gen:
        assert r["mismatches"] == [[]] * REFITS, (r["rank"], r["mismatches"])
        assert r["versions"] == [1, 2]  # verl's global_steps became the weights' version
        # verl's worker passed the steps through and got nothing to load: the shards were
        # already in the model's storage
        assert r["global_steps"] == [1, 2] and r["loaded"] == [[], []]
        assert r["wire_formats"] == ["named_tensors"] * REFITS
    for r in results:  # the second update reused the groups the first one joined
        assert r["groups"][0] == r["groups"][1]


def _catch(fn):
    try:
        fn()
        return None
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"


def _refusal_job(job, site):
    """The vLLM model holds a param no payload entry writes: the rollout workers refuse at
    ``init_process_group``, and the actor workers' update raises it (the fault board)."""
    if site not in sys.path:
        sys.path.append(site)
    import torch

    control, side, rank, facts = start(job)
    options = engine_options(job, facts["family"], facts["vocab_size"])
    if side == "train":
        engine = verl_engine(options, actor_rank=rank)
        worker = _ActorWorker(engine, facts["model"])
        execute = worker.execute_checkpoint_engine
    else:
        facts["model"].get_submodule("model.norm").register_parameter(
            "extra_scale", torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16),
                                              requires_grad=False))
        engine = verl_engine(options)
        worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
        worker.checkpoint_engine, worker.server_adapter = engine, _ServerAdapter()
        execute = CheckpointEngineWorker.execute_checkpoint_engine.__wrapped__.__get__(worker)
    metadata = exchange_metadata(control, job, execute("prepare"), 0)
    actor_kwargs, rollout_kwargs = type(engine).build_topology(TRAIN, GEN, metadata)
    mine = actor_kwargs if side == "train" else rollout_kwargs
    out = {"side": side, "init": _catch(lambda: execute(
        "init_process_group", **{k: v[rank] for k, v in mine.items()}))}
    if side == "train":
        out["update"] = _catch(lambda: asyncio.run(worker.update_weights(global_steps=1)))
    _catch(engine.shutdown)
    return out


def test_a_refusal_on_the_rollout_side_reaches_the_actor_workers(pool):
    results = pool.run(_refusal_job, TRAIN + GEN, SITE, num_ports=3, timeout_s=300)
    for r in results[TRAIN:]:
        assert r["init"] is not None and "model.norm.extra_scale" in r["init"], r
    for r in results[:TRAIN]:
        assert r["init"] is None, r  # the actor workers joined; their refit learns of it
        assert r["update"] is not None and "model.norm.extra_scale" in r["update"], r
