"""``check_finite`` looks at the training weights before the version vote (issue 51's trust
round): a NaN or Inf, an FP8 byte that is NaN or an FP8 scale not finite and > 0 refuses
the refit on every rank before any byte moves, and the generation side keeps version N,
live and consistent.

The unit tests feed ``refit.finite.nonfinite`` real tensors of every dtype it reads. The
process test: one training rank holding its linear weights in blockwise FP8
(``testing.fp8_training``, TE's data/scale layout) refits one generation rank holding
vLLM's block-FP8 layout (the training bytes and scales travel as they are). Refits: clean;
one scale of one FP8 weight zeroed (refused, named); clean; one FP8 byte turned into
e4m3's NaN (refused, named); clean. Before this round the FP8 buffers were not looked at
and such a refit committed.
"""

import json
import time

import pytest
import torch

from megatron_reshard.refit.finite import BATCH, nonfinite
from megatron_reshard.tools.e2e import ModuleWorker, tensor_digest
from two_worlds import join_world

NAN, INF = float("nan"), float("inf")


# -- the check itself -----------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False], ids=["foreach_max_abs", "float64_sums"])
def test_nan_and_inf_in_float_weights_are_found_among_many_batches(fused):
    weights = [torch.randn(8, 8, dtype=torch.bfloat16) for _ in range(BATCH + 40)]
    weights[3][1, 2] = NAN
    weights[BATCH + 7] = weights[BATCH + 7].float()
    weights[BATCH + 7][0, 0] = -INF
    strided = torch.randn(16, 16)
    strided[0, 4] = INF  # in the view below (every second column)
    weights.append(strided[:, ::2])
    weights.append(torch.full((3,), 7, dtype=torch.int32))  # not looked at
    bad, _ = nonfinite(weights, fused=fused)
    assert bad == [3, BATCH + 7, BATCH + 40]
    huge = [torch.full((4096,), 3.0e38, dtype=torch.bfloat16), torch.full((8,), 3.0e38)]
    assert nonfinite(huge, fused=fused) == ([], [])  # finite, however large: no overflow


def test_fp8_bytes_and_scales_are_checked():
    data = torch.randn(4, 4).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 2) + 0.5
    nan_byte = data.clone()
    nan_byte.view(torch.uint8)[1, 1] = 0x7F  # e4m3fn's NaN
    pairs = [(data, scales), (nan_byte, scales)]
    for wrong in (0.0, -1.0, NAN, INF):
        bad_scales = scales.clone()
        bad_scales[1, 0] = wrong
        pairs.append((data, bad_scales))
    e5m2 = torch.randn(4).to(torch.float8_e5m2)
    e5m2.view(torch.uint8)[2] = 0x7C  # e5m2's Inf
    bad, bad_fp8 = nonfinite([e5m2, torch.randn(3)], pairs)
    assert bad == [0] and bad_fp8 == [1, 2, 3, 4, 5]
    assert nonfinite([data, torch.randn(3)], [(data, scales)]) == ([], [])


# -- a refit from FP8-held training weights -------------------------------------------------

TIMEOUT_S = 60.0
STEPS = 5
FP8_WEIGHT = "decoder.layers.1.mlp.linear_fc2.weight"   # held in blockwise FP8
FP8_HF = "model.layers.1.mlp.down_proj.weight"
REFUSED = {1: "zero scale", 3: "NaN byte"}


def _catch(fn):
    try:
        return {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}


def _job(job):
    control, side, rank = join_world(job, 1, 1)
    return _train(job, control) if side == "train" else _gen(job, control)


def _train(job, control):
    from megatron.core import parallel_state as ps

    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron import MegatronRefitSource
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.fp8_training import attach_blockwise_fp8_
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.tools.e2e import _publish_expected
    from megatron_reshard.tools.run_config import RefitRunConfig, model_preset

    ps.initialize_model_parallel(1, 1, distributed_timeout_minutes=1)
    cfg = RefitRunConfig(model="dense", train_world=1, gen_world=1, gen_tp=1,
                         gen_precision="fp8", train_precision="fp8_blockwise")
    preset = model_preset(cfg)  # sizes in whole 128-row FP8 blocks
    family = preset.pop("family")
    torch.manual_seed(0)
    model = build_gpt_model(TinyGPTSpec(dtype="bfloat16", **preset)).to(dtype=torch.bfloat16)
    attach_blockwise_fp8_(model)
    source = MegatronRefitSource(model, gen_parallelism={"tp_size": 1, "ep_size": 1, "pp_size": 1},
                                 gen_world_size=1, family=family, vocab_size=preset["vocab_size"],
                                 gen_quant="block_fp8")
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 2, "gloo", TIMEOUT_S,
                               who="train rank 0", label="refit group of PP stage 0")
    sender = RefitSender(source, group, check_finite=True)
    held = dict(model.named_parameters())[FP8_WEIGHT].blockwise_fp8
    out = []
    for step in range(STEPS):
        if step == 1:
            saved = held.scale_inv[0, 0].item()
            held.scale_inv[0, 0] = 0.0
        if step == 2:
            held.scale_inv[0, 0] = saved
        if step == 3:
            saved_byte = held.data.view(torch.uint8)[0, 0].item()
            held.data.view(torch.uint8)[0, 0] = 0x7F
        if step == 4:
            held.data.view(torch.uint8)[0, 0] = saved_byte
        out.append(_catch(sender.refit))
        if step not in REFUSED:
            full = gather_full_hf_state_dict(model, family=family, vocab_size=preset["vocab_size"])
            _publish_expected(cfg, control, source.hf_config, full, step)
        control.set(f"sent/{step}", "1")
    destroy_refit_group(group, TIMEOUT_S)
    return out


def _gen(job, control):
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.wire.codec import decode_payload

    control.wait(["payload"])
    payload = decode_payload(control.get("payload"))
    model = build_vllm_like_model(payload["hf_config"], 0, 1, 1, torch.bfloat16, quant="block_fp8")
    worker = ModuleWorker(model)
    worker.init_refit_groups(job.host, [job.ports[1]], 1, 2, "gloo", TIMEOUT_S)
    worker.prepare_refit(payload)
    out = {"refits": [], "states": [], "mismatched": [], "unchanged": []}
    for step in range(STEPS):
        before = {n: tensor_digest(p) for n, p in model.named_parameters()}
        out["refits"].append(_catch(worker.refit))
        out["states"].append(worker.refit_weights_state())
        actual = {n: tensor_digest(p) for n, p in model.named_parameters()}
        out["unchanged"].append(before == actual)
        if step in REFUSED:
            continue
        control.wait([f"expected/{step}/0"])
        expected = json.loads(control.get(f"expected/{step}/0"))
        out["mismatched"].append(sorted(n for n in set(expected) | set(actual)
                                        if expected.get(n) != actual.get(n)))
    control.wait([f"sent/{STEPS - 1}"])
    worker.destroy_refit_groups(TIMEOUT_S)
    time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def fp8_refits(pool):
    return pool.run(_job, 2, num_ports=2, timeout_s=300)


def test_fp8_weights_refit_bit_exact_when_their_bytes_and_scales_are_sound(fp8_refits):
    train, gen = fp8_refits
    assert all(train[s]["ok"] for s in range(STEPS) if s not in REFUSED), train
    assert gen["mismatched"] == [[]] * (STEPS - len(REFUSED)), gen["mismatched"]
    assert gen["states"][-1]["state"] == "consistent" and gen["states"][-1]["version"] == 3


@pytest.mark.parametrize("step", sorted(REFUSED))
def test_a_zero_scale_or_a_nan_fp8_byte_refuses_the_refit_before_any_byte_moves(fp8_refits, step):
    train, gen = fp8_refits
    for who, row in (("train", train[step]), ("gen", gen["refits"][step])):
        assert not row["ok"] and row["type"] == "NonFiniteRefused", (who, row)
        assert FP8_HF in row["error"] and "check_finite" in row["error"], (who, row)
    assert "held in FP8" in train[step]["error"], train[step]
    assert gen["unchanged"][step], REFUSED[step]
    state = gen["states"][step]
    assert state["state"] == "consistent" and state["version"] == gen["states"][step - 1]["version"]
