"""``StagedRefits.flip`` in one process, for what the two-world test
(tests/test_staged_flip_moved.py) does not reach: a param beyond the staging budget (received
in place inside the pause) that vLLM re-allocates while its bytes wait for the pause. Its
receive is bound to the old storage, so the flip must refuse before the gate opens: nothing
written, N live and consistent. The session here writes as ``ReceiverSession.refit`` does
(tests/test_staging.py's ``_Writer``)."""

import pytest
import torch

from megatron_reshard.receiver.staging import StagedRefitError, StagedRefits
from megatron_reshard.receiver.state import WeightState
from test_staging import _Writer


def _params():
    return {n: torch.nn.Parameter(torch.zeros(size), requires_grad=False)
            for n, size in (("a", 4), ("b", 8))}


def test_an_in_place_param_re_allocated_while_it_waits_for_the_pause_refuses_the_flip():
    live, state = _params(), WeightState(version=1)
    stager = StagedRefits(live, state, budget_bytes=4 * 4)  # "a" staged, "b" in place
    assert stager.in_place == ["b"]
    session = _Writer(stager, stager.targets(live.items()), 5.0, 2)
    session.release.set()
    stager.start(session)
    assert stager.wait(10)["phase"] == "waiting_for_pause"
    old_b = live["b"].data
    live["b"].data = torch.zeros(8)  # vLLM's post-load step, say: same shape, new storage
    with pytest.raises(StagedRefitError) as caught:
        stager.flip()
    message = str(caught.value)
    assert "flip is refused before writing any byte" in message, message
    assert "b on" in message and "waited for the pause" in message, message
    assert "live weights are consistent at version 1" in message, message
    assert state.consistent and state.version == 1 and state.overwritten == set()
    for t in (live["a"], live["b"], old_b):  # not one byte: neither storage of "b"
        assert bool((t == 0).all()), t
    assert stager.state()["phase"] == "idle"


def test_a_staged_param_replaced_after_the_receive_takes_n_plus_1_at_the_flip():
    model = torch.nn.Module()
    for name, param in _params().items():
        model.register_parameter(name, param)
    live, state = dict(model.named_parameters()), WeightState(version=1)
    stager = StagedRefits(live, state, model=model)  # both staged
    session = _Writer(stager, stager.targets(live.items()), 7.0, 2)
    session.release.set()
    stager.start(session)
    assert stager.wait(10)["phase"] == "staged"
    old_a = model.a
    model.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)  # a new Parameter
    out = stager.flip()
    assert bool((model.a == 7).all()) and bool((model.b == 7).all())  # where vLLM reads
    assert bool((old_a == 0).all())  # not into the storage vLLM left
    assert out["staged"]["flip_rebound"] == ["a"] and state.version == 2 and state.consistent
