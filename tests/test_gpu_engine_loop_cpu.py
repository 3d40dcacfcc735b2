"""The CPU half of scripts/gpu_engine_loop.py (the GPU run is in docs/GPU_ENGINE.md).

The training process of the loop (``scripts/gpu_engine_trainer.py``: real megatron-core,
spawned, serving the loop's commands over queues) runs here on the CPU, and this process
plays the vLLM worker with the receiver over the same colocated refit group (shared host
memory standing in for CUDA IPC): two refits, an AdamW step between them, each bit-equal
to the expected vLLM shards sliced from the trainer's own full HF tensors (its ``full``
answer). Also the loop's comparison (``differences``), its HF config, and ``--tp N --plan``:
the N trainers of a TP run on the CPU, up to where vLLM would start."""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import gpu_engine_loop as loop  # noqa: E402
from gpu_engine_trainer import trainer_main  # noqa: E402
from hf_configs import hf_config_kwargs  # noqa: E402

pytestmark = pytest.mark.slow


def _answer(res, kind):
    got, value = res.get(timeout=120)
    assert got == kind, value
    return value


def test_the_loops_trainer_refits_a_receiver_bit_exact_over_the_colocated_transport():
    from megatron_reshard.testing.vllm_like import build_vllm_like_model, expected_vllm_shard
    from megatron_reshard.tools.e2e import ModuleWorker
    from megatron_reshard.tools.worlds import free_ports
    from megatron_reshard.wire.codec import decode_payload
    from megatron_reshard.wire.records import RefitPayload

    spec, family, _ = loop.MODELS["moe"]
    spec = dict(spec, num_layers=2, hidden_size=64, num_moe_experts=8)
    world_port, refit_port = free_ports(2)
    ctx = mp.get_context("spawn")
    cmd, res = ctx.Queue(), ctx.Queue()
    cfg = {"device": "cpu", "world_port": world_port, "refit_port": refit_port, "spec": spec,
           "family": family, "gen_quant": None, "timeout_s": 60, "lr": 1e-3}
    trainer = ctx.Process(target=trainer_main, args=(cfg, cmd, res), daemon=True)
    trainer.start()
    try:
        payload = decode_payload(_answer(res, "payload")["payload"])
        hf = RefitPayload.of(payload).hf_config
        model = build_vllm_like_model(hf, 0, 1, 1, torch.bfloat16, device=torch.device("cpu"))
        worker = ModuleWorker(model)
        cmd.put(("connect",))
        worker.init_refit_groups("127.0.0.1", [refit_port], 1, 2, "gloo", 60)
        worker.prepare_refit(payload, {})
        _answer(res, "ready")
        before = None
        for version in (1, 2):
            if version > 1:
                cmd.put(("step", version))
                _answer(res, "stepped")
            cmd.put(("refit", version))
            assert worker.refit()["version"] == version
            sent = _answer(res, "refitted")
            assert sent["t1"] >= sent["t0"]
            cmd.put(("full",))
            full = _answer(res, "full")
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
            bad = [n for n, t in got.items()
                   if not torch.equal(t, expected_vllm_shard(hf, n, full, 0, 1, 1))]
            assert bad == [], f"refit {version}: {bad}"
            if before is not None:  # the optimizer step changed what the refit wrote (the
                # large matrices: at an lr of 1e-6 few BF16 elements move, a small tensor's may not)
                changed = loop.differences(before, got)
                assert {n for n in got if "experts" in n or "qkv" in n} <= set(changed), changed
            before = got
        cmd.put(("stop",))  # both sides leave the group together
        worker.destroy_refit_groups(60)
        trainer.join(60)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()


def test_the_comparison_sees_one_flipped_bit_a_dtype_a_shape_and_a_missing_name():
    a = {"w": torch.randn(4, 3).bfloat16(), "s": torch.tensor(1.5), "b": torch.ones(2)}
    b = {k: v.clone() for k, v in a.items()}
    assert loop.differences(a, b) == []
    b["w"].view(-1).view(torch.uint8)[5] ^= 1
    b["s"] = b["s"].double()
    b["b"] = torch.ones(1, 2)
    b["extra"] = torch.zeros(())
    assert loop.differences(a, b) == ["extra", "b", "s", "w"]
    nan = {"x": torch.tensor([float("nan")])}
    assert loop.differences(nan, {"x": nan["x"].clone()}) == []  # bits, not values


@pytest.mark.parametrize("model", sorted(loop.MODELS))
def test_the_loops_hf_config_is_the_tests_mapping_of_the_same_spec(model):
    spec, _, arch = loop.MODELS[model]
    mine = loop.hf_config(spec, arch)
    m = {**dict(num_moe_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2,
                moe_shared_expert_intermediate_size=None, moe_layer_freq=1, tie_embeddings=False),
         **spec}
    theirs = hf_config_kwargs(m, arch, dict(attention_bias=False))
    skip = {"max_position_embeddings", "attention_dropout", "attn_implementation"}
    assert {k: v for k, v in theirs.items() if k not in skip} == \
        {k: mine[k] for k in theirs if k not in skip}


def test_the_tp_plan_runs_on_the_cpu_up_to_vllm(tmp_path):
    """``--tp 2 --plan``: the two Megatron trainers the TP2 run spawns (TP2, EP2 for the MoE
    model) build the same payload aimed at vLLM TP2, step and gather, and stop cleanly."""
    import json

    out = tmp_path / "plan.json"
    assert loop.main(["--model", "moe", "--tp", "2", "--plan", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["checks"]) == 4, report["checks"]
    plan = report["plan"]
    assert plan["refit_group"] == {"size": 4, "trainers": [0, 1], "vllm_workers": [2, 3]}
    assert plan["payload"]["gen_tp_size"] == plan["llm"]["tensor_parallel_size"] == 2
    assert [t["rank"] for t in plan["trainers"]] == [0, 1]


@pytest.mark.parametrize("tp,groups,problem", [(1, 2, None), (2, 2, None), (4, 4, None),
                                               (8, 8, None), (3, 3, "attention heads"),
                                               (0, 2, "at least 1")])
def test_tp_gives_each_rank_a_kv_head_and_refuses_what_cannot_split(tp, groups, problem):
    spec = loop.model_spec("dense", "tiny", tp)
    assert spec["num_query_groups"] == groups
    found = loop.tp_problem(spec, tp, None)
    assert (found is None) if problem is None else (problem in found), found
    if problem is None:
        assert "2 visible" in loop.tp_problem(spec, 4, 2)  # more ranks than GPUs


def test_fp8_under_tp_that_cuts_a_tile_is_refused_before_anything_starts(capsys):
    """``--quant fp8_per_block`` with ``--size large --tp 4``: the MoE model's 768 expert
    rows give each vLLM rank 192, not whole 128-row tiles; the argument check refuses it
    naming the sizes and the ``--tp`` values that fit (the tiny model's sizes are raised)."""
    with pytest.raises(SystemExit) as exit_info:
        loop.main(["--model", "moe", "--size", "large", "--tp", "4", "--quant", "fp8_per_block",
                   "--plan"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "192 of its 768 rows per vLLM rank under TP 4" in err, err
    assert "use --tp 1 or 2" in err, err
    for tp in (1, 2, 4, 8):  # the tiny model: every per-rank slice whole tiles
        spec = loop.model_spec("moe", "tiny", tp, "fp8_per_block")
        assert loop.quant_problem("moe", "tiny", tp, "fp8_per_block") is None, tp
        for rows in (spec["num_query_groups"] * spec["head_dim"], spec["moe_ffn_hidden_size"]):
            assert rows % (128 * tp) == 0, (tp, spec)
    assert loop.quant_problem("moe", "large", 4, "none") is None
    assert loop.model_spec("moe", "tiny", 2) == loop.model_spec("moe", "tiny", 2, "none")


@pytest.mark.parametrize("change,cut", [({}, None), ({"head_dim": 64}, "k_proj"),
                                        ({"moe_ffn_hidden_size": 128}, "experts")])
def test_the_librarys_fp8_plan_refuses_what_the_check_refuses(tmp_path, monkeypatch, change, cut):
    """``--model moe --tp 2 --quant fp8_per_block --plan``: the two trainers plan the
    block-FP8 refit with the library (``fp8.plan``), which checks every vLLM rank's slice for
    whole tiles. The picked sizes pass; each size the run had before (head_dim 64: 64 KV
    rows per rank; expert intermediate 128: 64 rows per rank) is refused by the library at
    the trainers' init, naming the weight the script's own check names before anything starts."""
    import json

    spec = dict(loop.model_spec("moe", "tiny", 2, "fp8_per_block"), **change)
    found = loop.fp8_cut(spec, 2)
    assert (found is None) if cut is None else (cut in found), found
    monkeypatch.setattr(loop, "model_spec", lambda *args: dict(spec))  # past the script's check
    monkeypatch.setattr(loop, "quant_problem", lambda *args: None)
    out = tmp_path / "plan.json"
    code = loop.main(["--model", "moe", "--tp", "2", "--quant", "fp8_per_block", "--plan",
                      "--json", str(out)])
    report = json.loads(out.read_text())
    if cut is None:
        assert code == 0 and report["ok"], report
        assert report["plan"]["llm"] == {"tensor_parallel_size": 2, "quantization": "fp8_per_block"}
    else:
        assert code == 1 and not report["ok"], report
        refused = report["error"][report["error"].index("Fp8SplitError:"):]
        assert "cuts a 128x128 FP8 block" in refused and cut in refused.split("\n")[1], refused


def _staged_row(pause_ms: float, flip_copy_ms: float, flip_bytes: int) -> dict:
    return {"pause_s": pause_ms / 1e3, "rounds_during_transfer_s": [0.2],
            "worker": {"flip_bytes": flip_bytes, "flip_copy_s": flip_copy_ms / 1e3,
                       "flip_s": flip_copy_ms / 1e3, "transfer_s": 0.007, "staging_bytes": 100}}


def test_the_staged_cases_figures_compare_with_the_loops_in_place_pause(tmp_path, capsys):
    """gpu_engine_staged's figures: the staged pause against the in-place pause of the loop's
    report given by --compare (an engine prepared without staged), else against its own
    updates without staged (stage and flip at once), each named as such; the flip's copies
    against a memcpy scaled to the flipped bytes."""
    import argparse
    import json

    import gpu_engine_staged as staged

    report = tmp_path / "moe_large.json"
    report.write_text(json.dumps({"speed": {"ours_pause_ms": 8.0}}))
    for compare, base, label in ((str(report), 8.0, "staged / in place"),
                                 (None, 4.0, "staged / stage + flip"),
                                 (str(tmp_path / "missing.json"), 4.0, "staged / stage + flip")):
        args = argparse.Namespace(
            model="moe", graphs="on", size="tiny", staged=2, compare=compare, staging_budget=None,
            kill=False, timeout_s=60.0, lr=1e-3, json=None, quant="none", tp=1, refits=0,
            speed=0, plan=False)
        run = staged.StagedLoop(args)
        run.model_bytes = 1000
        rows = [_staged_row(2.0, 1.0, 500), _staged_row(2.0, 1.0, 500)]
        run.figures(rows, [{"pause_s": 0.004}], [0.1], copy_s=1e-3)  # memcpy of 500 B: 0.5 ms
        table = run.report["figures"]
        assert table["pause_ratio"] == pytest.approx(2.0 / base)
        assert table["flip_vs_memcpy"] == pytest.approx(0.5)
        assert table["generation_slowdown"] == pytest.approx(2.0)
        assert label in capsys.readouterr().out
