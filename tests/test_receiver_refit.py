"""End to end on CPU: plain-torch sender ranks refit vLLM-layout receiver ranks bit-exact.

Senders hold HF-layout shards cut from full HF tensors by the payload's source placements
(written here with torch.chunk, independently of the library's geometry); receivers are
``MegatronReshardWorkerExtension`` workers over a plain module with vLLM per-rank names.
Bulk params go through the engine, the rest through the packed broadcast. Each receiver
compares every parameter with ``expected_vllm_shard``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_reshard.refit.commit import commit_refit
from megatron_reshard.refit.version import agree_version

from megatron_reshard.groups.comm import create_refit_group
from megatron_reshard.wire.metadata import restore_refit_info_placements
from megatron_reshard.refit.packed import broadcast_packed, pack_entries
from megatron_reshard.receiver import MegatronReshardWorkerExtension
from megatron_reshard.refit.loop import RefitLoop
from megatron_reshard.refit.order import misc_items_by_stage, stage_params
from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec
from megatron_reshard.testing.vllm_like import (
    build_plain_payload,
    build_vllm_like_model,
    expected_vllm_shard,
    grouped_hf_tensors,
    random_hf_state_dict,
)

BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            intermediate_size=64, num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False,
            gated=True, qk_norm=True, family="qwen3")
MOE = dict(BASE, num_experts=8, moe_intermediate_size=32, family="qwen3_moe")
QWEN2_MOE = dict(MOE, qk_norm=False, attention_bias=True, tie_word_embeddings=True,
                 shared_expert_intermediate_size=32, family="qwen2_moe")

CASES = {
    # name: (hf_config, train parallelism, gen parallelism, train world, gen world, model options)
    "dense_tp2_to_tp4": (BASE, {"tp_size": 2}, {"tp_size": 4}, 2, 4, {}),
    "moe_pp2_tp2_ep2_to_tp2": (MOE, {"tp_size": 2, "ep_size": 2, "pp_size": 2}, {"tp_size": 2}, 4, 2,
                               {}),
    "qwen2moe_ep2_to_tp2_ep2_buffered": (
        QWEN2_MOE, {"tp_size": 1, "ep_size": 2}, {"tp_size": 2, "ep_size": 2}, 2, 2,
        {"routed_experts_nesting": True, "strided_in_place": False}),
}


def _layer_to_stage(cfg, pp):
    if pp == 1:
        return None
    per = cfg["num_hidden_layers"] // pp
    m = {f"model.layers.{i}": i // per for i in range(cfg["num_hidden_layers"])}
    m.update({"model.embed_tokens": 0, "model.norm": pp - 1, "lm_head": pp - 1})
    return m


def _slice_by_placements(full, mesh, placements, rank):
    """This rank's DTensor shard: chunk along each Shard axis in mesh-axis order."""
    hits = (mesh.mesh == rank).nonzero()
    if not len(hits):
        return None
    coord = hits[0].tolist()
    t = full
    for axis, p in enumerate(placements):
        if getattr(p, "dim", None) is None:
            continue
        chunks = torch.chunk(t, mesh.shape[axis], dim=p.dim)
        t = chunks[coord[axis]] if coord[axis] < len(chunks) else t.narrow(p.dim, 0, 0)
    return t.clone()


class _PlainModuleWorker(MegatronReshardWorkerExtension):
    def __init__(self, model):
        self._model = model

    def get_refit_model(self):
        return self._model


def _refit_job(job, case):
    cfg, train, gen, train_world, gen_world, opts = CASES[case]
    opts = dict(opts)
    nesting = opts.pop("routed_experts_nesting", False)
    pp = train.get("pp_size", 1)
    stage_world = train_world // pp
    full = random_hf_state_dict(cfg, torch.bfloat16, seed=7)
    payload = build_plain_payload(cfg, full, train, gen, train_world, gen_world, _layer_to_stage(cfg, pp))
    if job.rank >= train_world:  # generation rank: the payload arrives as decoded plain data
        gen_rank = job.rank - train_world
        tp, ep = gen["tp_size"], gen.get("ep_size", 1)
        model = build_vllm_like_model(cfg, gen_rank % tp, tp, ep, torch.bfloat16,
                                      routed_experts_nesting=nesting)
        worker = _PlainModuleWorker(model)
        worker.init_refit_groups(job.host, list(job.ports[:pp]), stage_world + gen_rank,
                                 [stage_world + gen_world] * pp, "gloo", 60.0)
        summary = worker.prepare_refit(json.loads(json.dumps(payload)), opts)
        worker.refit()
        worker.refit()  # a second refit reuses the plan and lands the same bytes
        report = worker.report()
        # both refits committed: the weights are version 2 everywhere, nothing mixed
        assert report["weights"]["state"] == "consistent", report["weights"]
        assert report["weights"]["version"] == 2 and report["refits"] == 2, report["weights"]
        bad = [n for n, p in model.named_parameters()
               if not torch.equal(p.view(torch.int16), expected_vllm_shard(
                   cfg, n, full, gen_rank % tp, tp, ep).view(torch.int16))]
        return {"bad": bad, "summary": summary, "report": report}
    # training rank: plain torch shards of the full HF tensors
    stage, local = divmod(job.rank, stage_world)
    restore_refit_info_placements(payload)
    grouped = grouped_hf_tensors(full)
    specs = HFToLocalParamMap()
    for p in stage_params(payload).get(stage, []):
        shard = _slice_by_placements(grouped[p.name], p.src_mesh_info, p.src_placements, local)
        if shard is not None:
            specs.specs[p.name] = LocalParamSpec(base=shard)
    group = create_refit_group(job.host, job.ports[stage], local, stage_world + gen_world, "gloo", 60.0)
    misc = misc_items_by_stage(payload)
    loop = RefitLoop(payload, specs, "src", {stage: group}, misc_items=misc)
    for version in (1, 2):  # the protocol of a refit: version check, bulk, packed, commit
        agreed = agree_version({stage: group}, side="src", version=version, pp_size=pp)
        assert agreed.version == version and not agreed.refused, agreed
        loop.run()
        items = misc.get(stage, [])
        if items:
            broadcast_packed(pack_entries(items), group, 0, torch.device("cpu"),
                             {n: full[n] for n, _, _ in items} if local == 0 else None)
        outcome = commit_refit({stage: group}, side="src", version=version,
                               checksum_failed=False, pp_size=pp)
        assert outcome.ok and outcome.version == version, outcome
    return {"bad": [], "params": len(specs)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_receivers_end_bit_exact(pool, case):
    cfg, train, gen, train_world, gen_world, _ = CASES[case]
    results = pool.run(_refit_job, train_world + gen_world, case, timeout_s=120)
    assert [r["bad"] for r in results] == [[]] * len(results)
    for r in results[train_world:]:
        rep = r["report"]
        assert rep["refits"] == 2 and rep["uncovered_targets"] == {}
        assert rep["params"] > 0 and rep["misc_params"] > 0 and rep["bytes_received"] > 0
    assert all(r["params"] > 0 for r in results[:train_world])


def test_receiver_imports_without_megatron_te_or_msgspec():
    blocker = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('megatron', 'transformer_engine', 'msgspec'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, _Block())\n"
        "import megatron_reshard.receiver as r\n"
        "import megatron_reshard.testing\n"
        "assert r.MegatronReshardWorkerExtension and r.ReceiverSession\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformer_engine', 'msgspec')]\n"
        "assert not bad, bad\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
