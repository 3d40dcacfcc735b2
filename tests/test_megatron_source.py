"""Train side on live megatron-core (CPU, gloo): meshes, metadata, local views, full tensors, payload.

Oracle: ``reference.gather_full_hf_state_dict`` (independent of the converter tables). Each
rank's local view must equal, bit for bit, the chunk of the oracle's HF tensor that the
refit info's src mesh and placements assign to it; the chunk is cut here with plain
``torch.chunk`` arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.tensor import Shard

from megatron_reshard.tools.worlds import init_gloo_world

pytestmark = pytest.mark.filterwarnings("ignore")


def chunk_of(full: torch.Tensor, mesh: torch.Tensor, placements, rank: int) -> torch.Tensor:
    from megatron_reshard.layout.placements import BlockShard

    coord = (mesh == rank).nonzero()[0].tolist()
    region = full
    for axis, p in enumerate(placements):
        if isinstance(p, BlockShard):  # explicit uneven blocks (q/k/v cut inside a KV group)
            i = coord[axis]
            region = region.narrow(p.dim, sum(p.sizes[:i]), p.sizes[i])
        elif isinstance(p, Shard):
            pieces = torch.chunk(region, mesh.shape[axis], dim=p.dim)
            i = coord[axis]
            region = pieces[i] if i < len(pieces) else region.narrow(p.dim, 0, 0)
    return region


def padded_rows_of(full: torch.Tensor, mesh: torch.Tensor, placements, rank: int):
    """(owned rows of ``full``, padded chunk size) for a vocab PaddedShard over one axis."""
    from megatron_reshard.layout.placements import PaddedShard

    coord = (mesh == rank).nonzero()[0].tolist()
    axis, p = next((a, p) for a, p in enumerate(placements) if isinstance(p, PaddedShard))
    chunk = p.padded_size // mesh.shape[axis]
    start = min(coord[axis] * chunk, full.shape[0])
    return full[start: min(start + chunk, full.shape[0])], chunk


def _init(job, tp=1, pp=1, ep=1, etp=1, order=None):
    init_gloo_world(job)
    from megatron.core import parallel_state as ps

    kwargs = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                  distributed_timeout_minutes=1)
    if order is not None:
        kwargs["order"] = order
    ps.initialize_model_parallel(**kwargs)


def _oracle_tensor(oracle: dict, info: dict) -> torch.Tensor:
    proj = info.get("grouped_expert_proj")
    if proj is None:
        # q/k/v travel per KV group: [nkv, rows per group, H], a row-major reshape of HF's
        return oracle[info["name"]].reshape(info["global_shape"])
    prefix = info["name"][: -len(f".{proj}.weight")]
    n = info["global_shape"][0]
    return torch.stack([oracle[f"{prefix}.{e}.{proj}.weight"] for e in range(n)])


def _storages(model) -> set[int]:
    # buffers too: the router's expert_bias (DeepSeek-V3 score-correction bias) is one
    return {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}


def _check_source(job, spec_kwargs, family, gen_parallelism, gen_world_size, layout):
    from megatron_reshard.layout.placements import build_mesh_info
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.megatron.source import MegatronRefitSource

    _init(job, **layout)
    spec = TinyGPTSpec(**spec_kwargs)
    model = build_gpt_model(spec)
    source = MegatronRefitSource(model, gen_parallelism=gen_parallelism, gen_world_size=gen_world_size,
                                 family=family, vocab_size=spec.vocab_size)
    oracle = gather_full_hf_state_dict(model, family=family, vocab_size=spec.vocab_size)
    failures = []

    # metadata: every HF tensor described once, with its global shape and dtype
    described = {**source.state_dict_metadata, **source.exact_extra_metadata,
                 **source.other_params_metadata}
    if set(described) != set(oracle):
        failures.append(f"metadata names differ from oracle: extra {sorted(set(described) - set(oracle))}, "
                        f"missing {sorted(set(oracle) - set(described))}")
    for name, meta in described.items():
        if name in oracle and (meta["shape"] != list(oracle[name].shape) or meta["dtype"] != str(oracle[name].dtype)):
            failures.append(f"{name}: metadata {meta} vs oracle {list(oracle[name].shape)} {oracle[name].dtype}")

    # the generation side derives the same names and shapes from hf_config alone
    if family in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe"):
        from megatron_reshard.testing.vllm_like import hf_param_shapes

        expected = {n: list(s) for n, s in hf_param_shapes(source.hf_config).items()}
        if expected != {n: m["shape"] for n, m in described.items()}:
            failures.append(f"hf_config does not describe the metadata: {sorted(set(expected) ^ set(described))}")

    # local views: the exact chunk the src mesh/placements assign to this rank
    param_map = source.build_hf_to_local_param_map()
    storages = _storages(model)
    checked = 0
    for layer in source.refit_info["layer_names"]:
        for info in source.refit_info["per_layer_params"][layer]:
            if info.get("pp_stage", 0) != source.stage:
                if info["name"] in param_map:
                    failures.append(f"{info['name']}: mapped on rank {job.rank} of another stage")
                continue
            spec_ = param_map.get(info["name"])
            if spec_ is None:
                failures.append(f"{info['name']}: no local spec on rank {job.rank}")
                continue
            if "grouped_expert_proj" not in info and spec_.base.untyped_storage().data_ptr() not in storages:
                failures.append(f"{info['name']}: dense view is not a view of a live parameter")
            buf = spec_.begin().buf
            if isinstance(buf, list):  # separate expert tensors: the live params, no copy
                if any(t.untyped_storage().data_ptr() not in storages for t in buf):
                    failures.append(f"{info['name']}: an expert is not a live parameter")
                buf = torch.stack(buf)
            if info["name"] in source.vocab_metadata:  # padded shard: owned rows, then padding
                rows, chunk = padded_rows_of(oracle[info["name"]], info["src_mesh_info"].mesh,
                                             info["src_placements"], source.stage_local_rank)
                if buf.shape[0] != chunk or not torch.equal(buf[: rows.shape[0]], rows):
                    failures.append(f"{info['name']}: rank {job.rank} vocab shard {list(buf.shape)} "
                                    f"does not start with its {rows.shape[0]} rows of the oracle")
                checked += 1
                continue
            want = chunk_of(_oracle_tensor(oracle, info), info["src_mesh_info"].mesh, info["src_placements"],
                            source.stage_local_rank)
            if buf.shape != want.shape or not torch.equal(buf, want):
                failures.append(f"{info['name']}: rank {job.rank} view {list(buf.shape)} != chunk {list(want.shape)}")
            checked += 1

    # other params: full HF tensors of this stage
    others = source.gather_other_params()
    mine = {p["name"] for p in source.payload["other_params"] if p["pp_stage"] == source.stage}
    if set(others) != mine:
        failures.append(f"other params of stage {source.stage}: got {sorted(others)}, payload says {sorted(mine)}")
    for name, t in others.items():
        if not torch.equal(t, oracle[name]):
            failures.append(f"{name}: full tensor differs from oracle on rank {job.rank}")

    # meshes under the default order equal build_mesh_info's
    per_stage = source.layout.world_size // source.layout.pp
    default_meshes = (build_mesh_info(per_stage, 0, tp_size=source.layout.tp)[0].mesh.tolist(),
                      build_mesh_info(per_stage, 0, ep_size=source.layout.ep)[0].mesh.tolist())
    live_meshes = [(s.dense.mesh.tolist(), s.expert.mesh.tolist()) for s in source.stages]

    data = source.payload_bytes()
    if decode_payload(data) != source.payload:
        failures.append("payload does not round-trip")
    # one frozen train-side plan; the payload held once, as records, beside its bytes
    import dataclasses

    try:
        source.plan.payload_bytes = b""
        failures.append("the TrainSidePlan can be changed after construction")
    except dataclasses.FrozenInstanceError:
        pass
    if source.payload_bytes() is not data or source.wire is not source.plan.payload:
        failures.append("the payload is re-encoded or held in another form per call")

    # a refit info that assigns this rank another region is refused, naming param and rank
    from torch.distributed.tensor import Replicate

    from megatron_reshard.wire.metadata import restore_refit_info_placements

    wrong = restore_refit_info_placements(decode_payload(data))
    victim = next((p for layer in wrong["layer_names"] for p in wrong["per_layer_params"][layer]
                  if p.get("pp_stage", 0) == source.stage and any(isinstance(x, Shard) for x in p["src_placements"])), None)
    if victim is not None:  # layouts where this rank holds only whole tensors have nothing to get wrong
        victim["src_placements"] = [Replicate() for _ in victim["src_placements"]]
        try:
            source.build_hf_to_local_param_map(wrong)
            mismatch_error = None
        except ValueError as err:
            mismatch_error = str(err)
        if mismatch_error is None or victim["name"] not in mismatch_error or f"rank {job.rank} " not in mismatch_error:
            failures.append(f"shape mismatch not reported for {victim['name']}: {mismatch_error}")
    return {
        "failures": failures,
        "checked": checked,
        "payload": data,
        "layer_to_pp_stage": source.layer_to_pp_stage,
        "hf_config": source.hf_config,
        "default_meshes": default_meshes,
        "live_meshes": live_meshes,
        "stage_ranks": [list(s.ranks) for s in source.stages],
        "stage_local_rank": source.stage_local_rank,
        "rank_order": source.rank_order,
        "n_other": len(others),
    }


def _run(pool, nprocs, *args):
    results = pool.run(_check_source, nprocs, *args)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}:\n" + "\n".join(r["failures"])
    assert len({r["payload"] for r in results}) == 1, "payload bytes differ between train ranks"
    return results


DENSE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, vocab_size=200, qk_layernorm=True)


def test_dense_swiglu_gqa_tp2_pp2_views_match_oracle_and_default_meshes(pool, tmp_path):
    results = _run(pool, 4, DENSE, "qwen3", {"tp_size": 2, "ep_size": 1, "pp_size": 1}, 2, dict(tp=2, pp=2))
    r0 = results[0]
    assert all(r["checked"] > 0 for r in results)
    assert r0["live_meshes"] == [r0["default_meshes"]] * 2
    assert r0["stage_ranks"] == [[0, 1], [2, 3]]
    assert r0["rank_order"] == "tp-pp"
    assert r0["layer_to_pp_stage"] == {
        "model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
        "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    cfg = r0["hf_config"]
    assert (cfg["vocab_size"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["gated"], cfg["qk_norm"], cfg["num_experts"], cfg["family"]) == (200, 2, 8, 48, True, True, 0, "qwen3")

    # The payload decodes in a process where megatron cannot be imported.
    path = tmp_path / "payload.bin"
    path.write_bytes(r0["payload"])
    script = textwrap.dedent(f"""
        import sys
        sys.modules["megatron"] = None  # any megatron import now fails
        from megatron_reshard.wire.codec import decode_payload
        from megatron_reshard.wire.metadata import restore_refit_info_placements
        p = decode_payload(open({str(path)!r}, "rb").read())
        restore_refit_info_placements(p)
        assert not any(m.startswith("megatron.") or m == "megatron" for m in sys.modules if sys.modules[m] is not None)
        print(p["schema_version"], p["train_layout"]["tp"], p["train_layout"]["pp"], p["gen_layout"]["tp"],
              p["hf_config"]["vocab_size"], len(p["other_params"]), type(p["per_layer_params"]["model.layers.0"][0]["src_placements"][0]).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2", "2", "2", "200", str(sum(r["n_other"] for r in results) // 2), "Shard"]


def test_pp2_uneven_stages_qkv_bias(pool):
    # (tied embeddings under PP > 1 need CUDA in megatron-core's constructor: tested at PP = 1)
    spec = dict(num_layers=5, hidden_size=32, num_attention_heads=4, num_query_groups=1, ffn_hidden_size=40,
                vocab_size=130, add_qkv_bias=True, num_layers_in_first_pipeline_stage=1)
    results = _run(pool, 2, spec, "qwen2", {"tp_size": 2, "ep_size": 1, "pp_size": 1}, 2, dict(pp=2))
    r0 = results[0]
    assert r0["layer_to_pp_stage"] == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
                                       "model.layers.2": 1, "model.layers.3": 1, "model.layers.4": 1,
                                       "model.norm": 1, "lm_head": 1}
    assert r0["hf_config"]["attention_bias"] is True
    assert r0["hf_config"]["num_hidden_layers"] == 5


MOE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
           vocab_size=200, num_moe_experts=4, moe_ffn_hidden_size=16)


def test_moe_sequential_ep2_shared_experts_first_dense_layer_tied_embeddings(pool):
    spec = dict(MOE, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=24, tie_embeddings=True)
    results = _run(pool, 2, spec, "deepseek_v3", {"tp_size": 1, "ep_size": 2, "pp_size": 1}, 2, dict(ep=2))
    r0 = results[0]
    assert r0["live_meshes"] == [r0["default_meshes"]]
    cfg = r0["hf_config"]
    assert (cfg["num_experts"], cfg["moe_intermediate_size"], cfg["moe_layers"],
            cfg["shared_expert_intermediate_size"], cfg["tie_word_embeddings"]) == (4, 16, [1, 2], 24, True)


def test_glm4_moe_tp2_ep2_partial_rotary_every_param_on_the_exact_path(pool):
    # GLM-4.5's shape: q/k/v biases, partial RoPE, sigmoid routing with the score-correction
    # bias, a shared expert, first layer dense
    spec = dict(MOE, head_dim=16, add_qkv_bias=True, rotary_percent=0.5, moe_layer_freq=[0, 1, 1],
                moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5)
    results = _run(pool, 4, spec, "glm4_moe", {"tp_size": 2, "ep_size": 2, "pp_size": 1}, 2,
                   dict(tp=2, ep=2))
    r0 = results[0]
    assert r0["n_other"] == 0  # router, its bias and the shared expert take the exact path too
    cfg = r0["hf_config"]
    assert (cfg["family"], cfg["attention_bias"], cfg["router_expert_bias"], cfg["moe_layers"],
            cfg["shared_expert_intermediate_size"], cfg["head_dim"]) == ("glm4_moe", True, True, [1, 2], 16, 16)


def test_moe_tp2_ep2_four_ranks_kv_heads_fewer_than_tp(pool):
    spec = dict(MOE, num_query_groups=1, qk_layernorm=True)
    results = _run(pool, 4, spec, "qwen3_moe", {"tp_size": 2, "ep_size": 1, "pp_size": 1}, 2, dict(tp=2, ep=2))
    r0 = results[0]
    assert r0["live_meshes"] == [r0["default_meshes"]]
    assert r0["live_meshes"][0] == ([[0, 1], [2, 3]], [[0, 1], [2, 3]])


def test_non_default_rank_order_is_described_by_the_real_rank_tensor(pool):
    # order dp-tp-pp: DP is innermost, so TP pairs are (0, 2) and (1, 3)
    results = _run(pool, 4, DENSE, "qwen3", {"tp_size": 2, "ep_size": 1, "pp_size": 1}, 2,
                   dict(tp=2, order="dp-tp-cp-ep-pp"))
    r0 = results[0]
    assert r0["rank_order"] == "dp-tp"
    assert r0["live_meshes"] == [([[0, 2], [1, 3]], [0, 1, 2, 3])]
    assert r0["live_meshes"][0][0] != r0["default_meshes"][0]


def _bad_inputs(job):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.megatron.source import MegatronRefitSource

    gen = dict(gen_parallelism={"tp_size": 2, "ep_size": 1, "pp_size": 1}, gen_world_size=2)
    messages = {}

    def attempt(key, model, **kwargs):
        try:
            MegatronRefitSource(model, **gen, **kwargs)
        except ValueError as err:
            messages[key] = str(err)
        else:
            messages[key] = None

    init_gloo_world(job)
    attempt("no_parallel_state", torch.nn.Linear(2, 2))

    spec = TinyGPTSpec(**MOE)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 distributed_timeout_minutes=1)  # expert-TP defaults to TP = 2
    attempt("etp_family_vocab", build_gpt_model(spec), family="gpt_neox", vocab_size=10**6,
            packed_params="self_attn.(")
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1, distributed_timeout_minutes=1)
    model = build_gpt_model(spec)
    if job.rank == 1:
        model.decoder.layers[0].self_attention.mystery = torch.nn.Parameter(torch.zeros(3))
    attempt("unknown_name", model, family="qwen3_moe", vocab_size=spec.vocab_size)
    # Nemotron-H: the family for a GPT model, a real MambaModel under no family, and one
    # with MoE layers (refused: megatron.nemotron_h)
    from megatron_reshard.testing.megatron_mamba import TinyMambaSpec, build_mamba_model
    attempt("nemotron_h_family", model, family="nemotron_h", vocab_size=spec.vocab_size)
    mamba_moe = build_mamba_model(TinyMambaSpec(pattern="M*-E", num_moe_experts=4))
    attempt("mamba_model", mamba_moe)
    attempt("nemotron_h_moe", mamba_moe, family="nemotron_h")
    try:  # the generation sizes are checked before anything else
        MegatronRefitSource(model, gen_parallelism={"tp_size": 0, "ep_size": 1}, gen_world_size=2)
        messages["gen_tp_zero"] = None
    except ValueError as err:
        messages["gen_tp_zero"] = str(err)
    dist.barrier()  # nobody was left inside a collective
    return messages


def test_bad_input_raises_one_clear_error_on_every_rank(pool):
    results = pool.run(_bad_inputs, 4)
    for rank, m in enumerate(results):
        assert m["no_parallel_state"] is not None and "parallel_state is not initialised" in m["no_parallel_state"]
        assert "not a Megatron GPT-style model" in m["no_parallel_state"]
        err = m["etp_family_vocab"]
        assert err is not None, rank
        assert "expert tensor parallel size 2 > 1 is not supported" in err
        assert "unknown model family 'gpt_neox'" in err
        assert "vocab_size=1000000" in err
        assert "packed_params='self_attn.(' is not a regular expression" in err
        err = m["unknown_name"]
        assert err is not None and "rank 1: unknown Megatron parameter 'decoder.layers.0.self_attention.mystery'" in err, err
        assert "family='nemotron_h' needs a megatron-core MambaModel, got GPTModel" in m["nemotron_h_family"]
        assert "MambaModel refits under Nemotron-H's names only: pass family='nemotron_h'" in m["mamba_model"]
        assert "Nemotron-H MoE layers ('E' in the hybrid pattern 'M*-E') are not supported yet" \
            in m["nemotron_h_moe"], m["nemotron_h_moe"]
        assert m["gen_tp_zero"] == "gen_parallelism['tp_size'] must be a positive int, got 0"


def test_sender_refuses_anything_but_the_train_side_plan():
    """The sender takes a ``MegatronRefitSource`` or its ``TrainSidePlan``; a duck-typed
    object (what the sender used to probe with ``getattr``) is refused by name."""
    from megatron_reshard.errors import BadInputTypeError
    from megatron_reshard.megatron.sender import RefitSender

    class LooksLikeASource:
        stage, stage_local_rank, payload = 0, 0, {"schema_version": 1}

    with pytest.raises(BadInputTypeError, match="expected a MegatronRefitSource or its "
                       "TrainSidePlan .*, found .*LooksLikeASource"):
        RefitSender(LooksLikeASource(), None)
