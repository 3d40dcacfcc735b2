"""The payload decoder and the receiver's validation against 1,200 mutated payloads: each is
either accepted or refused with the library's own error that says "refit payload" (or
names the param), never another exception, and a refused payload writes nothing."""

import copy
import random

import msgspec
import pytest
import torch

from megatron_reshard.wire.codec import decode_payload, encode_payload
from megatron_reshard.receiver import ReceiverSession, TargetError
from megatron_reshard.receiver.payload_check import RefitPayloadError
from megatron_reshard.testing.groups import NoCommGroup
from megatron_reshard.testing.vllm_like import (
    build_plain_payload,
    build_vllm_like_model,
    random_hf_state_dict,
)

CFG = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
           intermediate_size=64, num_hidden_layers=1, vocab_size=100, tie_word_embeddings=False,
           gated=True, qk_norm=True, num_experts=4, moe_intermediate_size=32, family="qwen3_moe")
JUNK = [None, -1, 0, 10 ** 12, 1.5, True, "x", "torch.float8", [], {}, [[-1, 5]], {"dim": 9},
        {"mesh": [[0, 0]]}, {"mesh": [[2, 3], [4]]}, {"mesh": []}, [[0, 1], [2, 99]]]


@pytest.fixture(scope="module")
def valid():
    full = random_hf_state_dict(CFG, seed=0)
    return build_plain_payload(CFG, full, {"tp_size": 2}, {"tp_size": 2}, 2, 2)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _mutate_structure(payload, rng):
    out = copy.deepcopy(payload)
    paths = [p for p in _paths(out) if p]
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(paths)
        parent = out
        try:
            for key in path[:-1]:
                parent = parent[key]
            if rng.random() < 0.2 and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(rng.choice(JUNK))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed the path
    return encode_payload(out)


def _mutate_bytes(data, rng):
    data = bytearray(data)
    kind = rng.random()
    if kind < 0.3:
        return bytes(data[:rng.randrange(len(data))])
    if kind < 0.4:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def _prepare(data):
    """Decode and prepare on gen rank 0 of a 2 + 2 group that cannot communicate."""
    model = build_vllm_like_model(CFG, 0, 2, 1, torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        payload = decode_payload(data)
        ReceiverSession(payload, model.named_parameters(), {0: NoCommGroup(2, 4)})
    except ValueError as exc:  # RefitPayloadError, TargetError, ... are ValueErrors
        text = str(exc)  # the library's own errors: payload problems, or a target naming its param
        assert isinstance(exc, (RefitPayloadError, TargetError)) or "refit payload" in text, \
            f"{type(exc).__name__}: {text}"
        for n, p in model.named_parameters():  # nothing of a refused payload landed
            assert torch.equal(p, before[n]) or torch.isnan(before[n]).any(), n
        return False
    return True


def test_the_unmutated_payload_prepares(valid):
    assert _prepare(encode_payload(valid))


def test_mutated_payloads_are_accepted_or_refused_clearly(valid):
    rng = random.Random(1234)
    data = encode_payload(valid)
    outcomes = [_prepare(_mutate_structure(valid, rng)) for _ in range(800)]
    outcomes += [_prepare(_mutate_bytes(data, rng)) for _ in range(400)]
    assert len(outcomes) == 1200
    assert outcomes.count(False) > 600  # most mutations are refused, each with its reason


def test_a_truncated_payload_says_refit_payload(valid):
    with pytest.raises(ValueError, match=r"refit payload: not a valid msgpack message"):
        decode_payload(encode_payload(valid)[:50])
    with pytest.raises(ValueError, match=r"refit payload: expected a map"):
        decode_payload(msgspec.msgpack.encode([1, 2]))
