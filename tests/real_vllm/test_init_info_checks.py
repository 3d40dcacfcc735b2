"""Both init infos of the vLLM backend refuse the same bad fields when they are built, with
the same words (``vllm_api.init_checks``): the trainer's ``MegatronReshardTrainerInitInfo``
and the workers' ``MegatronReshardInitInfo`` through ``parse_init_info`` of the engine vLLM's
factory builds. Each case below was accepted on one side or both before (issue 50, item 4)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment  # noqa: E402

set_vllm_cpu_environment()

TRAINER = dict(host="127.0.0.1", ports_by_stage=[29600], group_backend="gloo", rank=0)
WORKER = dict(host="127.0.0.1", ports_by_stage=[29600], group_sizes=3,
              payload={"schema_version": 1}, backend="gloo", timeout_s=30.0)
# the same field under each side's name: (trainer, worker)
FIELD_NAMES = {"backend": ("group_backend", "backend"),
               "options": ("worker_options", "prepare_options")}


@pytest.fixture(scope="module")
def engine():
    import torch
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_reshard.vllm_api.plugin import register

    register()
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="megatron_reshard"), VllmConfig(), torch.device("cpu"),
        torch.nn.Linear(2, 2))


SHARED_CASES = [
    ("ports_by_stage", [70000], ["ports_by_stage[0]", "[1, 65535]", "found 70000"]),
    ("ports_by_stage", [0], ["ports_by_stage[0]", "[1, 65535]", "found 0"]),
    ("ports_by_stage", [], ["ports_by_stage", "at least one stage", "found []"]),
    ("ports_by_stage", ["29600"], ["ports_by_stage[0]", "found '29600' (str)"]),
    ("ports_by_stage", [29600, 29600], ["ports_by_stage", "distinct port", "port 29600",
                                        "stages 0 and 1"]),
    ("ports_by_stage", {0: 29600, "0": 29601}, ["ports_by_stage", "each PP stage once"]),
    ("backend", "mpi", ["expected one of ['nccl', 'gloo']", "found 'mpi' (str)"]),
    ("timeout_s", -1, ["timeout_s", "> 0", "found -1 (int)"]),
    ("timeout_s", float("nan"), ["timeout_s", "finite", "found nan"]),
    ("host", "", ["host", "non-empty", "found '' (str)"]),
    ("options", {"num_stream": 2}, ["unknown options ['num_stream']", "num_streams"]),
]


def _trainer_error(field: str, value) -> str:
    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo

    name = FIELD_NAMES.get(field, (field, field))[0]
    with pytest.raises(ValueError) as err:
        MegatronReshardTrainerInitInfo(**{**TRAINER, name: value})
    return str(err.value)


def _worker_error(engine, field: str, value) -> str:
    name = FIELD_NAMES.get(field, (field, field))[1]
    with pytest.raises(ValueError) as err:
        engine.parse_init_info({**WORKER, name: value})
    return str(err.value)


@pytest.mark.parametrize("field,value,words", SHARED_CASES,
                         ids=[f"{f}={v!r}" for f, v, _ in SHARED_CASES])
def test_both_sides_refuse_the_field_at_construction_with_the_same_words(engine, field, value,
                                                                         words):
    trainer, worker = _trainer_error(field, value), _worker_error(engine, field, value)
    for text in (trainer, worker):
        for w in words:
            assert w in text, (w, text)
    t_name, w_name = FIELD_NAMES.get(field, (field, field))
    assert trainer.startswith(f"MegatronReshardTrainerInitInfo.{t_name}")
    assert worker.startswith(f"MegatronReshardInitInfo.{w_name}")
    # one check wrote both: the texts differ only in the class and the field's name
    # (parse_init_info adds the list of fields after it; the trainer's options leave out
    # the ones that are its own fields)
    cut = (lambda text: text.split(";")[0]) if field == "options" else (lambda text: text)
    assert worker.split(":", 1)[1].startswith(cut(trainer.split(":", 1)[1]))


def test_the_good_values_pass_on_both_sides(engine):
    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo
    from megatron_reshard.wire.codec import encode_payload

    MegatronReshardTrainerInitInfo(**{**TRAINER, "ports_by_stage": {0: 29600, 1: 29601},
                                      "worker_options": {"num_streams": 1}})
    info = engine.parse_init_info({**WORKER, "ports_by_stage": {"0": 29600, "1": 29601},
                                   "payload": encode_payload({"schema_version": 1}),
                                   "prepare_options": {"num_streams": 1}})
    assert info.ports_by_stage == {"0": 29600, "1": 29601}


@pytest.mark.parametrize("payload,words", [
    (b"\x85\xa3abc", ["payload", "msgpack bytes of a refit payload", "5 bytes", "do not decode"]),
    (b"\x93\x01\x02\x03", ["payload", "expected a map"]),  # a list, not a map
    (b"", ["payload", "0 bytes"]),
])
def test_the_worker_refuses_payload_bytes_that_do_not_decode(engine, payload, words):
    text = _worker_error(engine, "payload", payload)
    assert text.startswith("MegatronReshardInitInfo.payload")
    for w in words:
        assert w in text, (w, text)


@pytest.mark.parametrize("change,words", [
    (dict(transport="rdma"), ["transport", "'p2p'", "'colocated'", "found 'rdma'"]),
    (dict(transport="colocated", group_backend="nccl"), ["group_backend", "'gloo'",
                                                        "colocated", "found 'nccl'"]),
])
def test_the_trainer_refuses_a_transport_it_cannot_build(change, words):
    from megatron_reshard.vllm_api.trainer import MegatronReshardTrainerInitInfo

    with pytest.raises(ValueError) as err:
        MegatronReshardTrainerInitInfo(**{**TRAINER, **change})
    for w in words:
        assert w in str(err.value), (w, str(err.value))
