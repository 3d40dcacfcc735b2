"""vLLM re-allocates a param of its own model between two refits: the next refit lands in
the storage vLLM holds now, bit for bit as vLLM's own loading makes it (issue 51, 2).

One training rank (real megatron-core Qwen3-shaped model, bf16, deltas asked for) refits two
generation ranks running vLLM's own parallel state and ``Qwen3ForCausalLM`` (TP2, dummy
loaded and post-processed as a worker started with ``load_format="dummy"``) through the
real worker extension. Before refits 1 to 4 the generation ranks re-allocate params:

1. rank 0: ``param.data = param.data.clone()`` on one param (a post-load step); rank 1:
   a new ``Parameter`` put in the module (as post-load steps and vLLM's
   ``replace_parameter`` before 0.34 do);
2. every rank: ``model._apply(clone)`` (what ``Module.to()`` runs);
3. rank 1: one param turned to float32 (the payload sends bf16): refused on every rank
   before any byte moves, by name, the weights still consistent at version 3;
4. rank 1: that param back in bf16, a new ``Parameter`` again.

After every committed refit each generation rank loads the training side's full HF tensors
into a second instance of the model with vLLM's ``load_weights`` and post-load step, and
every parameter and buffer must be bit-equal. Before the fix the refits after a
re-allocation wrote into the storage bound at ``prepare_refit`` (the moved params stayed
stale) and the float32 param took bf16 bytes written into its old storage.
"""

from __future__ import annotations

import io
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm.distributed")  # the real vLLM, installed in the vLLM test venv

from test_real_vllm import FAMILIES, vllm_config_json  # noqa: E402

pytestmark = pytest.mark.slow

GEN, STEPS, REFUSED, TIMEOUT_S = 2, 5, 3, 120.0
DATA_MOVED = "model.layers.0.self_attn.qkv_proj.weight"   # step 1, rank 0: param.data =
REPLACED = "model.layers.1.mlp.gate_up_proj.weight"       # step 1, rank 1: replace_parameter
WIDENED = "model.layers.0.mlp.down_proj.weight"           # step 3, rank 1: float32


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"type": type(exc).__name__, "error": str(exc)}


def _job(job, hf_config: dict) -> dict:
    control = dist.TCPStore(job.host, job.ports[0], job.nprocs, job.rank == 0,
                            timeout=timedelta(seconds=TIMEOUT_S))
    if job.rank == 0:
        return _train(job, control)
    return _gen(job, control, job.rank - 1, hf_config)


def _train(job, control) -> list:
    from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
    from megatron_reshard.megatron.sender import RefitSender
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.testing.optimizer_steps import adam_step_
    from megatron_reshard.tools.tiny_source import tiny_source

    dist.init_process_group("gloo", store=dist.PrefixStore("world/train", control), rank=0,
                            world_size=1, timeout=timedelta(seconds=TIMEOUT_S))
    model, source, family, vocab = tiny_source("dense", GEN, seed=0, **FAMILIES["qwen3"].model)
    control.set("payload", source.payload_bytes())
    group = create_refit_group(job.host, job.ports[1], 0, 1 + GEN, "gloo", TIMEOUT_S,
                               who="train rank 0", label="refit group of PP stage 0")
    sender = RefitSender(source, group, delta=True)
    out = []
    for step in range(STEPS):
        if step:  # lr 1e-3: every element changes, so any stale storage shows
            adam_step_(model, step, lr=1e-3)
        out.append(_catch(sender.refit))
        full = gather_full_hf_state_dict(model, family=family, vocab_size=vocab)
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in full.items()}, buf)
        control.set(f"full/{step}", buf.getvalue())
    control.wait([f"done/{g}" for g in range(GEN)])
    destroy_refit_group(group, TIMEOUT_S)
    return out


@torch.no_grad()
def _reallocate(model: torch.nn.Module, step: int, gen_rank: int) -> None:
    params = dict(model.named_parameters())

    def replace(name: str, tensor: torch.Tensor) -> None:
        # a new Parameter object in the module (vLLM 0.34's replace_parameter copies into
        # the old storage where shape, stride and dtype match; older ones and many
        # post-load steps register a new one)
        prefix, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(prefix), leaf, torch.nn.Parameter(tensor, requires_grad=False))

    if step == 1 and gen_rank == 0:
        params[DATA_MOVED].data = params[DATA_MOVED].data.clone()
    if step == 1 and gen_rank == 1:
        replace(REPLACED, params[REPLACED].data.clone())
    if step == 2:
        model._apply(lambda t: t.clone())
    if step == REFUSED and gen_rank == 1:
        params[WIDENED].data = params[WIDENED].data.float()
    if step == REFUSED + 1 and gen_rank == 1:
        replace(WIDENED, params[WIDENED].data.to(torch.bfloat16))


def _gen(job, control, gen_rank: int, hf_config: dict) -> dict:
    from megatron_reshard.testing import vllm_models as vm
    from megatron_reshard.tools.e2e import ModuleWorker, tensor_digest
    from megatron_reshard.wire.codec import decode_payload

    model_dir = vm.write_model_dir(hf_config)
    new_config = lambda: vm.vllm_config_for(model_dir, GEN)  # noqa: E731 - one per instance
    out = {"refits": [], "states": [], "differences": [], "moved": [], "unchanged": None}
    with vm.vllm_parallel_state(new_config(), gen_rank, GEN, job.ports[2]):
        model = vm.dummy_loaded_model(new_config())
        control.wait(["payload"])
        worker = ModuleWorker(model)
        worker.init_refit_groups(job.host, [job.ports[1]], 1 + gen_rank, 1 + GEN, "gloo",
                                 TIMEOUT_S)
        worker.prepare_refit(decode_payload(control.get("payload")))
        addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
        for step in range(STEPS):
            _reallocate(model, step, gen_rank)
            out["moved"].append(sorted(n for n, p in model.named_parameters()
                                       if p.data_ptr() != addresses[n]))
            addresses = {n: p.data_ptr() for n, p in model.named_parameters()}
            before = {n: tensor_digest(p) for n, p in model.named_parameters()}
            out["refits"].append(_catch(worker.refit))
            out["states"].append(worker.refit_weights_state())
            if step == REFUSED:  # nothing may have been written
                out["unchanged"] = before == {n: tensor_digest(p)
                                              for n, p in model.named_parameters()}
                out["differences"].append(None)
                continue
            control.wait([f"full/{step}"])
            full = torch.load(io.BytesIO(control.get(f"full/{step}")), weights_only=True)
            oracle = vm.loaded_model(new_config(), full)
            out["differences"].append(vm.bitwise_differences(model, oracle))
            del oracle
        out["params"] = len(addresses)
        control.set(f"done/{gen_rank}", "1")
        worker.destroy_refit_groups(TIMEOUT_S)
        time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def refits(pool):
    return pool.run(_job, 1 + GEN, vllm_config_json(FAMILIES["qwen3"]), num_ports=3,
                    timeout_s=600)


def test_a_param_vllm_reallocated_takes_the_next_refit_bit_exact_as_vllms_loading(refits):
    gen0, gen1 = refits[1], refits[2]
    assert gen0["moved"][1] == [DATA_MOVED] and gen1["moved"][1] == [REPLACED]
    assert len(gen0["moved"][2]) == gen0["params"], gen0["moved"][2]  # model._apply: all
    for gen in (gen0, gen1):
        assert [d for i, d in enumerate(gen["differences"]) if i != REFUSED] == \
            [[]] * (STEPS - 1), gen["differences"]
        assert gen["states"][-1]["state"] == "consistent"
        assert gen["states"][-1]["version"] == STEPS - 1
    assert [gen0["refits"][i]["rebound"] for i in (0, 1, 2, 4)] == [0, 1, gen0["params"], 0]
    assert [gen1["refits"][i]["rebound"] for i in (0, 1, 2, 4)] == [0, 1, gen1["params"], 1]


def test_a_param_vllm_turned_to_another_dtype_is_refused_by_name_on_every_rank(refits):
    train, gen0, gen1 = refits
    own = gen1["refits"][REFUSED]
    assert own.get("type") == "TensorsRefused", own
    assert WIDENED in own["error"] and "torch.float32" in own["error"], own
    peer = train[REFUSED]
    assert peer.get("type") == "TensorsRefused", peer
    assert "generation group rank 2 of stage 0's refit group" in peer["error"], peer
    assert "model.layers.0.mlp.down_proj.weight among them" in peer["error"], peer
    assert gen0["refits"][REFUSED].get("type") == "TensorsRefused", gen0["refits"][REFUSED]
    for gen in (gen0, gen1):
        assert gen["unchanged"] is True
        state = gen["states"][REFUSED]
        assert state["state"] == "consistent" and state["version"] == REFUSED, state
