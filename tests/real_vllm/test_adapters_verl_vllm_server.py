"""verl's stock vLLM server path: the rollout engine runs beside vLLM (verl's
``CheckpointEngineWorker``) and drives megatron_reshard's weight-transfer backend in vLLM's
workers through the server's ``collective_rpc`` (``adapters.server_end``).

One launch, 5 processes: 2 training ranks (a real megatron-core Qwen3-shaped model, PP2)
each with verl's engine built by verl's registry from a config dict and the model handed
off (``hand_off``); 2 vLLM workers (vLLM's own Qwen3 class under vLLM's parallel state,
vLLM's own GPU ``Worker`` methods over our weight-transfer engine from vLLM's factory:
``tools.vllm_backend_refit``); 1 process holding verl's two ``CheckpointEngineWorker`` s,
each with our engine and verl's real vLLM ``ServerAdapter``. What stands in for Ray and
for verl's ``vLLMHttpServer`` actor: an in-process handle whose ``collective_rpc.remote``
runs verl's own ``vLLMHttpServer.collective_rpc`` body on one thread (Ray runs an actor's
calls off the caller's thread), its ``engine`` (vLLM's ``AsyncLLM``) fanning each call out
to the vLLM workers over the launch's store, as vLLM's engine core does.

Each update runs in ``CheckpointEngineManager.update_weights``'s order (prepare everywhere,
``build_topology``, every ``init_process_group`` at once, the updates, ``finalize``); after
each, every vLLM worker's model is compared bit for bit with vLLM's own ``load_weights`` of
the full HF tensors. Runs in the vLLM test venv with verl from ``make install-verl``.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import pickle
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

ROOT = pathlib.Path(__file__).resolve().parents[2]
SITE = os.environ.get("MEGATRON_RESHARD_VERL_SITE", str(ROOT / ".verl-site"))
if not os.path.isdir(os.path.join(SITE, "verl")):
    pytest.skip(f"verl 0.9.1 is not installed at {SITE}: run `make install-verl`",
                allow_module_level=True)

from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment  # noqa: E402

set_vllm_cpu_environment()

from test_real_vllm import FAMILIES, _build, layout, vllm_config_json  # noqa: E402

pytestmark = pytest.mark.slow
REFITS = 2
TRAIN_LAYOUT, GEN_LAYOUT = "tp1 pp2", "tp2"


def _verl_engine(options: dict, actor_rank=None):
    """As verl's workers build it (tests/test_adapters_verl.py ``verl_engine``)."""
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    section = OmegaConf.create({"backend": "megatron_reshard",
                                "custom_backend_module": "megatron_reshard.adapters.verl",
                                "engine_kwargs": {"megatron_reshard": options}})
    cfg = omega_conf_to_dataclass(section, CheckpointEngineConfig)
    import_external_libs(cfg.custom_backend_module)
    master = {} if actor_rank is None else {"is_master": actor_rank == 0}
    return CheckpointEngineRegistry.new(cfg.backend, bucket_size=1 << 20, **master,
                                        **cfg.engine_kwargs[cfg.backend])


def _options(cfg, job, family: str, vocab_size: int) -> dict:
    return {"gen_tp": cfg.gen_tp, "family": family, "vocab_size": vocab_size,
            "group_backend": "gloo", "host": cfg.host,
            "ports": list(job.ports[1:1 + cfg.train_pp]), "timeout_s": cfg.timeout_s}


def _exchange(control, mine: dict, step: int, world: int) -> list:
    """Every worker's ``prepare()`` result, training ranks first (what verl's driver gathers);
    ``mine``: {worker index: metadata}."""
    for index, meta in mine.items():
        control.set(f"meta/{step}/{index}", pickle.dumps(meta))
    keys = [f"meta/{step}/{i}" for i in range(world)]
    control.wait(keys)
    return [pickle.loads(control.get(k)) for k in keys]


class _VerlActor:
    """``run_training_rank``'s ``trainer_engine``: a verl actor worker's engine, each update in
    verl's manager's order; the model handed off as a worker subclass does after
    ``init_model``."""

    def __init__(self, cfg, job, control, rank, model, source):
        from megatron_reshard.adapters import hand_off

        hand_off(model=model)
        self.cfg, self.job, self.control, self.rank = cfg, job, control, rank
        self.engine = _verl_engine(_options(cfg, job, source.family, source.vocab_size),
                                   actor_rank=rank)
        self.step, self.closed = 0, []
        self._setup()  # the first update's groups (run_training_rank reads them now)

    def _setup(self) -> None:
        metadata = _exchange(self.control, {self.rank: self.engine.prepare()}, self.step,
                             self.cfg.train_world + self.cfg.gen_world)
        actor, _ = type(self.engine).build_topology(self.cfg.train_world, self.cfg.gen_world,
                                                    metadata)
        self.engine.init_process_group(**{k: v[self.rank] for k, v in actor.items()})

    @property
    def group(self):
        return self.engine.ends.train.group

    @property
    def sender(self):
        return self.engine.ends.train.sender

    def send_weights(self) -> None:
        from adapter_worlds import RaisingWeights

        if self.step:
            self._setup()  # verl prepares and inits before every update (groups kept)
        weights = RaisingWeights()
        t0 = time.perf_counter()
        metrics = asyncio.run(self.engine.send_weights(weights, global_steps=self.step + 1))
        self.last_refit = {"refit_s": time.perf_counter() - t0, **metrics}
        self.closed.append(weights.closed)
        self.engine.finalize()
        self.step += 1

    def shutdown(self) -> None:
        self.engine.shutdown()


class _Awaitable:
    """What Ray's ``ObjectRef`` is to the caller: the call already runs; await its result."""

    def __init__(self, future):
        self.future = future

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


class _Method:
    def __init__(self, executor, fn):
        self.executor, self.fn = executor, fn

    def remote(self, *args, **kwargs) -> _Awaitable:
        return _Awaitable(self.executor.submit(self.fn, *args, **kwargs))


class _AsyncLLM:
    """vLLM's ``AsyncLLM.collective_rpc``: every vLLM worker runs ``method`` (over the
    launch's store: ``StoreWeightSyncClient``), errors raised with every worker's."""

    def __init__(self, client):
        self.client, self.calls = client, []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return getattr(self.client, method)(*args, **(kwargs or {}))


class _ServerHandle:
    """A Ray actor handle of verl's ``vLLMHttpServer``: ``collective_rpc`` is verl's own
    method body (``engine`` = the ``AsyncLLM`` stand-in); calls run one at a time on one
    thread, as vLLM's engine core runs them."""

    def __init__(self, client):
        from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

        self.executor = ThreadPoolExecutor(max_workers=1)
        server = vLLMHttpServer.__new__(vLLMHttpServer)
        server.engine = self.llm = _AsyncLLM(client)
        self.global_steps, self.cleared = [], 0
        self.collective_rpc = _Method(self.executor, lambda *a, **k: asyncio.run(
            vLLMHttpServer.collective_rpc(server, *a, **k)))
        self.set_global_steps = _Method(self.executor, self.global_steps.append)
        self.clear_kv_cache = _Method(self.executor, self._clear)

    def _clear(self) -> None:
        self.cleared += 1


def _server_adapter(rollout_rank: int, handle):
    """verl's vLLM ``ServerAdapter`` of one rollout rank, without its ``__init__`` (which reads
    Ray's environment): the fields its ``update_weights`` reads, as ``__init__`` sets them
    on a GPU (CUDA IPC supported: ``use_shm`` False); only rollout rank 0 holds the server."""
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    adapter = ServerAdapter.__new__(ServerAdapter)
    adapter.use_shm, adapter.replica_rank, adapter.rollout_rank = False, 0, rollout_rank
    adapter._has_server = rollout_rank == 0
    adapter.server_handle = handle if rollout_rank == 0 else None
    return adapter


def _rollout_side(cfg, job, control) -> dict:
    """verl's two ``CheckpointEngineWorker`` s (rollout ranks 0 and 1) beside the vLLM server."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    from megatron_reshard.adapters import hand_off
    from megatron_reshard.tools.vllm_backend_refit import StoreWeightSyncClient

    client = StoreWeightSyncClient(cfg.host, job.ports[0], cfg.gen_world, cfg.timeout_s)
    handle = _ServerHandle(client)
    hand_off(vllm_server=handle)  # or the option vllm_server="vllm_server_0_0" under Ray
    family, vocab = pickle.loads(control.get("facts"))
    workers = []
    for r in range(cfg.gen_world):
        worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
        worker.checkpoint_engine = _verl_engine({**_options(cfg, job, family, vocab)})
        worker.server_adapter = _server_adapter(r, handle)
        workers.append(worker)
    execute = CheckpointEngineWorker.execute_checkpoint_engine.__wrapped__
    out = {"role": "driver", "wire_formats": [], "refits": [], "init_error": None}
    for step in range(REFITS):
        mine = {cfg.train_world + r: execute(w, "prepare") for r, w in enumerate(workers)}
        metadata = _exchange(control, mine, step, cfg.train_world + cfg.gen_world)
        _, rollout = type(workers[0].checkpoint_engine).build_topology(
            cfg.train_world, cfg.gen_world, metadata)
        for r in reversed(range(cfg.gen_world)):  # rank 0 fires the vLLM workers' join
            execute(workers[r], "init_process_group", **{k: v[r] for k, v in rollout.items()})
        out["wire_formats"].append([w.checkpoint_engine.wire_format for w in workers])
        for worker in workers:  # verl's own update_weights -> our stream -> ServerAdapter
            asyncio.run(CheckpointEngineWorker.update_weights.__wrapped__(
                worker, global_steps=step + 1))
        out["refits"].append([w.checkpoint_engine.last_refit for w in workers])
        for worker in workers:
            execute(worker, "finalize")
    for worker in workers:
        worker.checkpoint_engine.shutdown()
    handle.executor.submit(client.stop).result()  # after the fired shutdown, in call order
    handle.executor.shutdown()
    out.update(calls=handle.llm.calls, global_steps=handle.global_steps, cleared=handle.cleared)
    return out


def _job(job, cfg, hf_config, site: str) -> dict:
    if site not in sys.path:
        sys.path.append(site)
    import torch
    import torch.distributed as dist

    from megatron_reshard.adapters import clear_hand_off
    from megatron_reshard.tools.e2e import run_training_rank
    from megatron_reshard.tools.vllm_backend_refit import _served_gen_rank
    from megatron_reshard.tools.vllm_refit import publish_full_hf

    clear_hand_off()  # a pool process runs many jobs
    world = cfg.train_world + cfg.gen_world + 1
    control = dist.TCPStore(cfg.host, job.ports[0], world, job.rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if job.rank < cfg.train_world:
        built = {}
        actors = []

        def builder(spec, device, dtype):
            built["model"] = _build(spec, device, dtype)
            return built["model"]

        def trainer_engine(source, rank):
            if rank == 0:
                control.set("facts", pickle.dumps((source.family, source.vocab_size)))
            actors.append(_VerlActor(cfg, job, control, rank, built["model"], source))
            return actors[0]

        out = run_training_rank(job.rank, cfg, control, torch.device("cpu"),
                                model_builder=builder, after_each_refit=publish_full_hf,
                                trainer_engine=trainer_engine)
        out["closed"] = actors[0].closed
        out["metrics"] = [r.get("megatron_reshard/version") for r in out["refits"]]
        return out
    if job.rank < cfg.train_world + cfg.gen_world:
        return _served_gen_rank(job.rank - cfg.train_world, cfg, control, hf_config,
                                job.ports[1 + cfg.train_pp])
    return _rollout_side(cfg, job, control)


@pytest.fixture(scope="module")
def launch(pool):
    from megatron_reshard.tools.run_config import RefitRunConfig

    family = FAMILIES["qwen3"]
    cfg = RefitRunConfig(model="dense", model_overrides=dict(family.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         **layout(TRAIN_LAYOUT, GEN_LAYOUT))
    return pool.run(_job, cfg.train_world + cfg.gen_world + 1, cfg, vllm_config_json(family),
                    SITE, num_ports=cfg.train_pp + 2, timeout_s=400)


def test_refits_driven_through_verls_vllm_server_are_bit_equal_to_vllms_loading(launch):
    train = [r for r in launch if r["role"] == "train"]
    gen = [r for r in launch if r["role"] == "gen"]
    (driver,) = [r for r in launch if r["role"] == "driver"]
    for g in gen:
        assert g["engine"] == "MegatronReshardWeightTransferEngine"
        assert g["differences"] == [[]] * REFITS, (g["rank"], g["differences"])
        assert g["versions"] == [1, 2]  # verl's global_steps, committed by the backend
        assert g["asked_versions"] == [1, 2]
        assert g["payload_type"] == "bytes" and g["errors"] == []
        # one join for both updates (the groups kept), then verl's shutdown released them
        assert g["calls"] == (["init_weight_transfer_engine"]
                              + ["start_weight_update", "update_weights",
                                 "finish_weight_update"] * REFITS
                              + ["shutdown_weight_transfer_engine", "stop"]), g["calls"]
    for t in train:
        assert t["closed"] == [True] * REFITS  # verl's full-tensor iterator, unread
        assert t["metrics"] == [1, 2]
    # the engine told verl "delta_flush", so verl's ServerAdapter read the stream before
    # any RPC of its own and, the stream empty, only set the global steps
    assert driver["wire_formats"] == [["delta_flush"] * 2] * REFITS
    assert driver["global_steps"] == [1, 2] and driver["cleared"] == REFITS
    assert [[r["drove_vllm_server"] for r in step] for step in driver["refits"]] == \
        [[True, False]] * REFITS
