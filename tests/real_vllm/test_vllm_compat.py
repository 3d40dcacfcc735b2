"""``vllm_api.compat`` against the installed vLLM (run under each end of the supported range):
the worker engine is a complete ``WeightTransferEngine`` there (vLLM < 0.26 declares the
trainer's send abstract on it), and that send refuses with what to use instead."""

import pytest

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in a vLLM test venv

from megatron_reshard.vllm_api import compat  # noqa: E402
from megatron_reshard.vllm_api.backend import MegatronReshardWeightTransferEngine  # noqa: E402


def test_the_worker_engine_has_nothing_abstract_left_under_this_vllm():
    assert MegatronReshardWeightTransferEngine.__abstractmethods__ == frozenset()


def test_the_legacy_trainer_send_refuses_naming_the_trainer_side():
    if not compat.LEGACY_TRAINER_SEND:
        assert not hasattr(MegatronReshardWeightTransferEngine, "trainer_send_weights")
        return
    with pytest.raises(NotImplementedError, match="RefitSender"):
        MegatronReshardWeightTransferEngine.trainer_send_weights(iter(()), {})
