"""The ``megatron_reshard`` weight-transfer backend through vLLM 0.33's own plugin loader,
factory and base classes.

- Discovery: the entry point in ``pyproject.toml`` (group ``vllm.general_plugins``), read by
  ``importlib.metadata`` from a dist built from it, makes vLLM's ``load_general_plugins()``
  register the backend (a fresh interpreter: vLLM loads its plugins once per process).
- ``WeightTransferEngineFactory.create_engine`` builds our engine from
  ``WeightTransferConfig(backend="megatron_reshard")``; bad init/update info fails in
  ``parse_init_info`` / ``parse_update_info`` naming the field, before any collective.
- The trainer side: ``WeightTransferTrainerFactory`` builds our trainer engine from
  ``MegatronReshardTrainerInitInfo`` (the import registers it); bad init info and a source
  that is not a ``MegatronRefitSource`` are refused naming the field, before any collective.
- Lifecycle with real processes: a real megatron-core training side and generation ranks
  holding vLLM's own Qwen3 class (TP2) receive through the engine; two refits bit-equal to
  vLLM's own ``load_weights``; a refit the training side breaks part-way leaves the weight
  state saying exactly what is held. Two drivers: the generation ranks drive their engines
  as vLLM's GPU worker does (then a wrong ``version`` is refused after the commit), and
  vLLM's API on both sides (trainer engine -> client -> vLLM's ``Worker`` methods -> worker
  engine; ``tools.vllm_backend_refit`` says what stands in for a running ``LLM``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from megatron_reshard.testing.vllm_models import (  # noqa: E402
    cpu_platform_without_triton, set_vllm_cpu_environment)

set_vllm_cpu_environment()

from test_real_vllm import FAMILIES, layout, vllm_config_json  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_VERSION = tuple(int(p) for p in importlib.metadata.version("vllm").split(".")[:2])
GROUP = "vllm.general_plugins"
ENTRY = "megatron_reshard.vllm_api.plugin:register"

_PROBE = """
import json, logging, os
from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment
set_vllm_cpu_environment()
import importlib.metadata as md
from vllm.plugins import load_general_plugins
from vllm.distributed.weight_transfer import factory
F = factory.WeightTransferEngineFactory
T = getattr(factory, "WeightTransferTrainerFactory", None)  # from vLLM 0.26
before = "megatron_reshard" in F._registry or (T is not None and "megatron_reshard" in T._registry)
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("megatron_reshard").addHandler(Keep())
load_general_plugins()
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "megatron_reshard"]
print("PROBE " + json.dumps({"before": before, "after": "megatron_reshard" in F._registry,
                             "entry_points": eps, "cls": F._registry["megatron_reshard"]().__name__
                             if "megatron_reshard" in F._registry else None,
                             "trainer_registry": T is not None,
                             "trainer_cls": T._registry["megatron_reshard"]().__name__
                             if T is not None and "megatron_reshard" in T._registry else None,
                             "warnings": warnings}))
"""


def _probe(extra_path: str | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), env.get("PYTHONPATH"))
                                        if p)
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("PROBE "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.vllm_range
def test_pyproject_declares_the_entry_point():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"][GROUP] == {"megatron_reshard": ENTRY}


@pytest.mark.vllm_range
def test_load_general_plugins_registers_the_backend_from_the_entry_point():
    """A dist whose metadata is this checkout's entry point (what ``pip install`` writes);
    vLLM's plugin loader finds it and our register() runs."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    with tempfile.TemporaryDirectory() as site:
        info = pathlib.Path(site, "megatron_reshard_entry_point_probe-0.0.dist-info")
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: "
                                       "megatron-reshard-entry-point-probe\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(
            "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
                    for group, eps in meta["project"]["entry-points"].items()))
        got = _probe(site)
    assert got["before"] is False  # vLLM alone does not know the name
    assert got["after"] is True and ENTRY in got["entry_points"], got
    assert got["cls"] == "MegatronReshardWeightTransferEngine"
    assert got["warnings"] == [], got  # every registry this vLLM has took the backend
    # the trainer registry exists from vLLM 0.26: where it does, it knows the same name
    assert got["trainer_registry"] is (VLLM_VERSION >= (0, 26)), got
    assert got["trainer_cls"] == ("MegatronReshardTrainerWeightTransferEngine"
                                  if got["trainer_registry"] else None), got


@pytest.mark.vllm_range
def test_the_installed_dist_registers_the_backend():
    dist = importlib.metadata.distribution("megatron-reshard")
    if not any(e.group == GROUP and e.value == ENTRY for e in dist.entry_points):
        pytest.skip(f"the installed megatron-reshard ({dist.locate_file('')}) was installed "
                    f"before the entry point existed; reinstall it (pip install -e .) to check")
    got = _probe()
    assert got["after"] is True, got


# ---- factory and typed infos (this process; no model needed) -----------------------------

@pytest.fixture(scope="module")
def engine():
    """Our engine from vLLM's factory, over a vLLM config and a plain module (the factory
    and parse steps read neither)."""
    import torch
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_reshard.vllm_api.plugin import register

    cpu_platform_without_triton()  # VllmConfig() configures vLLM's CPU platform
    register()
    register()  # idempotent: vLLM may load its plugins more than once per process
    eng = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="megatron_reshard"), VllmConfig(), torch.device("cpu"),
        torch.nn.Linear(2, 2))
    assert isinstance(eng, WeightTransferEngine)
    return eng


GOOD = dict(host="127.0.0.1", ports_by_stage=[29500, 29501], group_sizes=[3, 3],
            payload={"schema_version": 1}, backend="gloo", timeout_s=30.0)


@pytest.mark.vllm_range
def test_create_engine_builds_ours(engine):
    from megatron_reshard.vllm_api.backend import (MegatronReshardInitInfo, MegatronReshardUpdateInfo,
                                                   MegatronReshardWeightTransferEngine)

    assert type(engine) is MegatronReshardWeightTransferEngine
    assert engine.init_info_cls is MegatronReshardInitInfo
    assert engine.update_info_cls is MegatronReshardUpdateInfo
    info = engine.parse_init_info(dict(GOOD))
    assert isinstance(info, MegatronReshardInitInfo) and info.group_rank is None
    assert engine.parse_update_info({}).version is None
    assert engine.parse_update_info({"version": 3}).version == 3


@pytest.mark.parametrize("change,words", [
    (dict(host=""), ["host", "expected", "''"]),
    (dict(ports_by_stage=[29500, 70000]), ["ports_by_stage[1]", "[1, 65535]", "70000"]),
    (dict(group_sizes="3"), ["group_sizes", "'3'"]),
    (dict(group_sizes={0: 3, 1: 1}), ["group_sizes[1]", ">= 2", "found 1"]),
    (dict(payload=[1]), ["payload", "dict", "[1]"]),
    (dict(payload={"hf_config": {}}), ["payload", "schema_version", "hf_config"]),
    (dict(group_rank=-1), ["group_rank", "-1"]),
    (dict(backend="mpi"), ["backend", "nccl", "'mpi'"]),
    (dict(timeout_s=0), ["timeout_s", "> 0", "found 0"]),
    (dict(prepare_options={"num_stream": 2}), ["prepare_options", "num_stream", "num_streams"]),
    (dict(hots="x"), ["hots", "fields: host"]),
])
@pytest.mark.vllm_range
def test_bad_init_info_names_the_field(engine, change, words):
    with pytest.raises(ValueError) as err:
        engine.parse_init_info({**GOOD, **change})
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_missing_init_field_is_named(engine):
    with pytest.raises(ValueError, match="payload"):
        engine.parse_init_info({k: v for k, v in GOOD.items() if k != "payload"})


@pytest.mark.parametrize("bad,words", [({"version": 1.5}, ["version", "1.5"]),
                                       ({"versoin": 2}, ["versoin"]), ([1], ["dict", "list"])])
@pytest.mark.vllm_range
def test_bad_update_info_names_the_field(engine, bad, words):
    with pytest.raises(ValueError) as err:
        engine.parse_update_info(bad)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.vllm_range
def test_lifecycle_out_of_order_is_refused(engine):
    with pytest.raises(RuntimeError, match="before init_weight_transfer_engine"):
        engine.start_weight_update()
    from megatron_reshard.vllm_api.backend import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="without an open weight update"):
        engine.finish_weight_update()


@pytest.mark.vllm_range
def test_engine_and_worker_extension_compose_one_worker_state(engine):
    """Neither adapter subclasses the other: both hold a ``RefitWorkerState`` (the
    extension creates its own on first use, vLLM running no ``__init__`` of it) and answer
    RPCs with plain dicts made from it."""
    from megatron_reshard.receiver import MegatronReshardWorkerExtension
    from megatron_reshard.receiver.worker_state import RefitWorkerState

    class VllmWorker(MegatronReshardWorkerExtension):  # as worker_extension_cls mixes it in
        def __init__(self):
            pass

    worker = VllmWorker()
    assert not isinstance(engine, MegatronReshardWorkerExtension)
    assert type(engine.state) is RefitWorkerState and engine.state.groups is None
    assert type(worker.refit_worker_state) is RefitWorkerState
    assert worker.refit_worker_state is worker.refit_worker_state  # one per worker
    fresh = RefitWorkerState().weights.as_dict()
    assert engine.refit_weights_state() == worker.refit_weights_state() == fresh
    assert engine.report() == worker.report() == {"prepared": False, "weights": fresh}
    with pytest.raises(RuntimeError, match="prepare_refit called before init_refit_groups"):
        worker.prepare_refit({"schema_version": 1})


# ---- the trainer side through vLLM's trainer factory (this process) ----------------------

TRAINER_GOOD = dict(host="127.0.0.1", ports_by_stage=[29500], group_backend="gloo", rank=0)


def test_the_trainer_factory_knows_our_engine_by_name():
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from megatron_reshard.vllm_api.trainer import (MegatronReshardTrainerInitInfo,
                                                   MegatronReshardTrainerWeightTransferEngine)

    info = MegatronReshardTrainerInitInfo(**TRAINER_GOOD)
    assert isinstance(info, TrainerInitInfo) and info.backend == "megatron_reshard"
    assert info.is_sender and not MegatronReshardTrainerInitInfo(**{**TRAINER_GOOD,
                                                                    "rank": 3}).is_sender
    cls = WeightTransferTrainerFactory._registry["megatron_reshard"]()
    assert cls is MegatronReshardTrainerWeightTransferEngine
    assert issubclass(cls, TrainerWeightTransferEngine)
    assert cls.init_info_cls is MegatronReshardTrainerInitInfo


@pytest.mark.parametrize("change,words", [
    (dict(rank=-1), ["rank", "-1"]),
    (dict(payload_format="json"), ["payload_format", "msgpack", "'json'"]),
    (dict(worker_options={"staging_bytes": 1}), ["worker_options", "staging_bytes",
                                                 "own fields"]),
    (dict(worker_options=[1]), ["worker_options", "[1]"]),
    (dict(batch_bytes=0), ["batch_bytes", ">= 1", "found 0"]),
    (dict(delta="yes"), ["delta", "DeltaConfig", "'yes'"]),
    (dict(planner="fast"), ["planner", "'auto'", "'fast'"]),
    (dict(node=3), ["node", "found 3"]),
    # the planner enters the plan fingerprint: the trainer's value goes to the workers
    (dict(worker_options={"planner": "link"}), ["worker_options", "planner", "own fields"]),
])
def test_bad_trainer_init_info_names_the_field(change, words):
    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo

    with pytest.raises(ValueError) as err:
        MegatronReshardTrainerInitInfo(**{**TRAINER_GOOD, **change})
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_trainer_init_refuses_a_source_that_is_not_ours_before_any_call():
    """vLLM's own ``ModuleSource`` (full tensors) is not what this backend sends; the client
    is never called."""
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo

    class Client:  # vLLM's VLLMWeightSyncClient protocol, recording what reaches it
        def __init__(self):
            self.calls = []

        def init_weight_transfer_engine(self, init_info):
            self.calls.append("init")

        def start_weight_update(self):
            self.calls.append("start")

        def update_weights(self, update_info):
            self.calls.append("update")

        def finish_weight_update(self, weight_version=None):
            self.calls.append("finish")

    client = Client()
    with pytest.raises(TypeError, match="expected a megatron_reshard MegatronRefitSource.*"
                                        "found ModuleSource"):
        WeightTransferTrainerFactory.trainer_init(
            MegatronReshardTrainerInitInfo(**TRAINER_GOOD), client=client,
            source=ModuleSource(torch.nn.Linear(2, 2)))
    assert client.calls == []


# ---- lifecycle with real processes -------------------------------------------------------

REFITS = 2


# (transport, driver): the process-group transport driven through vLLM's API on both sides
# (trainer engine -> client -> vLLM's worker methods -> worker engine), and the colocated
# transport (copies out of the training ranks' shared memory, which the generation side
# follows without choosing it) with each generation rank driving its engine itself
@pytest.fixture(scope="module", params=[("p2p", "trainer"), ("colocated", "worker")],
                ids=lambda p: "-".join(p))
def lifecycle(pool, request):
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job
    from megatron_reshard.tools.run_config import RefitRunConfig

    transport, driver = request.param
    family = FAMILIES["qwen3"]
    cfg = RefitRunConfig(model="dense", model_overrides=dict(family.model), refits=REFITS,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=30,
                         transport=transport, **layout("tp2", "tp2"))
    results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg,
                       vllm_config_json(family), fail_extra=True, driver=driver,
                       mismatch_rank=1 if driver == "worker" else None,
                       num_ports=cfg.train_pp * (3 if driver == "trainer" else 1) + 2,
                       timeout_s=300)
    by_rank = {r["role"] + str(r["rank"]): r for r in results}
    assert {by_rank[f"train{r}"]["transport"] for r in range(cfg.train_world)} == {transport}
    assert {by_rank[f"train{r}"]["driver"] for r in range(cfg.train_world)} == {driver}
    return by_rank


def _driver(lifecycle) -> str:
    return lifecycle["train0"]["driver"]


@pytest.mark.slow
def test_two_refits_through_the_backend_are_bit_equal_to_vllms_loading(lifecycle):
    # driver "trainer": then the restarted trainer's refit, version REFITS + 2
    restarted = [REFITS + 2] if _driver(lifecycle) == "trainer" else []
    for key in ("gen0", "gen1"):
        g = lifecycle[key]
        assert g["engine"] == "MegatronReshardWeightTransferEngine"
        assert g["differences"] == [[]] * (REFITS + len(restarted)), (key, g["differences"])
        # finish_weight_update committed
        assert g["versions"] == list(range(1, REFITS + 1)) + restarted, key


@pytest.mark.slow
def test_vllms_api_on_both_sides_carries_payload_and_version(lifecycle):
    """Driver "trainer": the generation ranks learn everything from the client's calls (the
    payload in init_weight_transfer_engine, the version in update_weights and in
    finish_weight_update's label), in vLLM's order."""
    if _driver(lifecycle) != "trainer":
        pytest.skip("the generation ranks drive their engines themselves in this run")
    for r in ("train0", "train1"):
        assert [s["version"] for s in lifecycle[r]["refits"]] == list(range(1, REFITS + 1))
        restarted = lifecycle[r]["bench"]["restarted"]
        assert restarted["version"] == REFITS + 2
        # delta=True in its init info reached the sender: its first refit is full and
        # leaves a base at its version (a sender reports a base only with delta on)
        assert restarted["mode"] == "full" and restarted["base"]["version"] == REFITS + 2, restarted
    update = ["start_weight_update", "update_weights", "finish_weight_update"]
    for key in ("gen0", "gen1"):
        g = lifecycle[key]
        assert g["payload_type"] == "bytes", key  # msgpack, as the trainer engine sent it
        # the good ones, the failed one, the restarted trainer's
        # the trainer asks for no version unless given one: the sender's check picks it
        assert g["asked_versions"] == [None] * (REFITS + 1) + [REFITS + 2], key
        assert g["labels"] == [str(v) for v in range(1, REFITS + 1)] + [str(REFITS + 2)], key
        assert g["calls"] == (["init_weight_transfer_engine"] + update * REFITS
                              + update[:2] + ["shutdown_weight_transfer_engine"]
                              + ["init_weight_transfer_engine", "shutdown_weight_transfer_engine"]
                              + ["init_weight_transfer_engine"] + update
                              + ["shutdown_weight_transfer_engine", "stop"]), (key, g["calls"])


@pytest.mark.slow
def test_a_trainer_init_the_workers_refuse_raises_on_every_training_rank(lifecycle):
    """The workers join the groups, then refuse the payload's options; only training rank 0
    hears it (through the client), and every training rank raises; nothing is left behind
    (the workers released their groups, a restarted trainer then works: the test above)."""
    if _driver(lifecycle) != "trainer":
        pytest.skip("no trainer engine in this run")
    refused = {r: lifecycle[r]["bench"]["refused"] for r in ("train0", "train1")}
    for r, error in refused.items():
        assert error is not None and error.startswith("TrainerWeightTransferError"), (r, error)
        assert "training rank 0 failed" in error and "init_weight_transfer_engine" in error, error
        assert "num_streams must be >= 1" in error, error  # the workers' own words
    for key in ("gen0", "gen1"):
        errors = lifecycle[key]["errors"]
        assert [m for m, _ in errors] == ["update_weights", "init_weight_transfer_engine"], errors
        assert "num_streams must be >= 1" in errors[1][1], errors


@pytest.mark.slow
def test_a_wrong_version_is_refused_with_the_weight_state(lifecycle):
    from megatron_reshard.tools.vllm_backend_refit import MISMATCH_OFFSET

    if _driver(lifecycle) != "worker":
        pytest.skip("the trainer engine sends the version it commits: no mismatch to ask for")
    assert lifecycle["gen0"]["mismatch"] is None
    m = lifecycle["gen1"]["mismatch"]
    assert m is not None
    assert f"expected {REFITS + MISMATCH_OFFSET}" in m["error"]
    assert f"committed version {REFITS}" in m["error"], m["error"]
    assert m["weights"]["state"] == "consistent" and m["weights"]["version"] == REFITS


@pytest.mark.slow
def test_a_failed_refit_leaves_the_weight_state_saying_what_is_held(lifecycle):
    from megatron_reshard.tools.vllm_backend_refit import PLANTED

    assert PLANTED in lifecycle["train0"]["bench"]["error"]
    assert lifecycle["train1"]["bench"]["error"] is not None  # both worlds learn of it
    for key in ("gen0", "gen1"):
        f = lifecycle[key]["failed"]
        assert f is not None, key
        w = f["weights"]
        assert "megatron_reshard refit failed" in f["error"] and PLANTED in f["error"], f["error"]
        assert w["failed_refits"] == 1 and w["refits"] == REFITS and w["version"] == REFITS, w
        # all or nothing, as the state says: what is not listed is bit-equal to version 2
        assert set(f["differ_from_last_good"]) <= set(w["overwritten"]), (key, f, w)
        # the fault struck half-way: some params already hold the failed refit's bytes
        assert w["overwritten"] and w["state"] == "inconsistent", w
        assert w["started_from"] == REFITS and "inconsistent" in f["error"], w
        # (here the fault strikes before the listed batch's bytes land: the list is what may
        # hold new bytes, a superset of what does)
        # shutdown leaves the state as it was
        if _driver(lifecycle) == "worker":
            assert "without an open weight update" in f["finish_error"]
            assert lifecycle[key]["weights"] == w
        else:
            assert lifecycle[key]["after_shutdown"][0] == w
            # and the restarted trainer's refit made them consistent again
            final = lifecycle[key]["weights"]
            assert final["state"] == "consistent" and final["version"] == REFITS + 2, final


# ---- init through the backend: params the payload does not cover ------------------------

_COVER_CFG = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  intermediate_size=64, num_hidden_layers=1, vocab_size=100,
                  tie_word_embeddings=False, gated=True, qk_norm=True, family="qwen3")
_EXTRA = "model.norm.extra_scale"


def _init_with_an_uncovered_param(job, prepare_options):
    """Rank 0 stands for the training side (waits in the first refit's opening collective);
    rank 1 initialises our engine, built by vLLM's factory, over a model holding one param
    the payload does not cover."""
    import torch
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_reshard.groups.collectives import all_gather_ints
    from megatron_reshard.groups.comm import create_refit_group
    from megatron_reshard.testing.vllm_like import (build_plain_payload, build_vllm_like_model,
                                                    random_hf_state_dict)
    from megatron_reshard.vllm_api.plugin import register

    def catch(fn):
        try:
            return {"value": fn(), "type": None, "error": None}
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return {"value": None, "type": type(exc).__name__, "error": str(exc)}

    if job.rank == 0:
        group = create_refit_group(job.host, job.port, 0, 2, "gloo", 60.0, who="train rank 0")
        out = catch(lambda: all_gather_ints([1], group, "the first refit"))
        import time

        time.sleep(2)  # this rank hosts the store: keep it up while the peer's wait ends
        return out
    payload = build_plain_payload(_COVER_CFG, random_hf_state_dict(_COVER_CFG, seed=0),
                                  {"tp_size": 1}, {"tp_size": 1}, 1, 1)
    model = build_vllm_like_model(_COVER_CFG, 0, 1, 1, torch.bfloat16)
    model.get_submodule("model.norm").register_parameter(
        "extra_scale", torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16), requires_grad=False))
    cpu_platform_without_triton()  # VllmConfig() configures vLLM's CPU platform
    register()
    eng = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="megatron_reshard"), VllmConfig(), torch.device("cpu"), model)
    info = dict(host=job.host, ports_by_stage=[job.port], group_sizes=2, payload=payload,
                group_rank=1, backend="gloo", timeout_s=60.0, prepare_options=prepare_options)
    out = catch(lambda: eng.init_transfer_engine(eng.parse_init_info(info)))
    out["summary"] = None if eng.summary is None else eng.summary.as_dict()
    if out["error"] is None:  # let the stand-in training rank's collective complete
        all_gather_ints([1], eng.state.groups[0], "the first refit")
    else:
        import time

        time.sleep(2)  # keep the group up while the peer reads the board
    return out


def test_an_uncovered_vllm_param_fails_backend_init_on_both_sides(pool):
    train, gen = pool.run(_init_with_an_uncovered_param, 2, None, timeout_s=120)
    assert gen["type"] == "UncoveredParamsError" and _EXTRA in gen["error"], gen
    assert train["type"] == "PeerFailure" and _EXTRA in train["error"], train


def test_backend_init_keeps_listed_params_as_loaded(pool):
    train, gen = pool.run(_init_with_an_uncovered_param, 2, {"keep_as_loaded": [_EXTRA]},
                          timeout_s=120)
    assert gen["error"] is None and train["error"] is None, (gen, train)
    assert gen["summary"]["kept_as_loaded"] == [_EXTRA], gen["summary"]
