"""The README's training snippet, run as written on real megatron-core models.

The code block after the README's ``training snippet`` marker is executed on every training
rank of a real refit job (spawned processes, gloo): the model is built under Megatron's
parallel state as a training job sets it up (dense TP2 with Megatron's default expert TP,
which is the TP size; MoE TP2 EP2 with the expert TP 1 the snippet asks for) and wrapped in
Megatron's ``Float16Module`` as ``get_model(bf16=True)`` does. The generation ranks are the
demo's (``tools.e2e``): they check every param after every refit against the digests of
the independent oracle (full HF tensors gathered on the training side, sliced by vLLM's
layout).
"""

from datetime import timedelta
from pathlib import Path

import pytest

from megatron_reshard.tools.run_config import RefitRunConfig

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- training snippet: tests/test_readme_snippet.py runs the next block -->"


def readme_training_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    after = text[text.index(MARKER) + len(MARKER):]
    assert after.lstrip().startswith("```python\n"), "the marker must sit right above the block"
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def _job(job, cfg, parallel_state_kwargs):
    cfg = RefitRunConfig(**{**cfg.__dict__, "ports": job.ports[: 1 + cfg.train_pp]})
    if job.rank >= cfg.train_world:
        from megatron_reshard.tools.e2e import run_rank

        return run_rank(job.rank, cfg)  # a generation rank, verifying every refit
    return _training_rank(job.rank, cfg, parallel_state_kwargs)


def _training_rank(rank, cfg, parallel_state_kwargs):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from megatron_reshard.groups import destroy_refit_group
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
    from megatron_reshard.tools.e2e import _init_world, _publish_expected, perturb_
    from megatron_reshard.tools.run_config import model_preset

    control = dist.TCPStore(cfg.host, cfg.ports[0], cfg.train_world + cfg.gen_world, rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s))
    _init_world(cfg, control, "train", rank, cfg.train_world, torch.device("cpu"))
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.train_tp,
                                 pipeline_model_parallel_size=cfg.train_pp,
                                 expert_model_parallel_size=cfg.train_ep, **parallel_state_kwargs)
    preset = model_preset(cfg)
    family = preset.pop("family")
    spec = TinyGPTSpec(**preset)
    model = build_gpt_model(spec)
    trained = Float16Module(model.config, model)  # what get_model(bf16=True) returns

    namespace: dict = {}
    exec(compile(readme_training_snippet(), "README.md training snippet", "exec"), namespace)
    source = namespace["refit_source"](trained, family=family, vocab_size=spec.vocab_size,
                                       gen_tp=cfg.gen_tp, gen_world_size=cfg.gen_world)
    if rank == 0:
        control.set("payload", source.payload_bytes())  # the generation ranks read it first
    sender, group = namespace["refit_sender"](
        source, gen_world_size=cfg.gen_world, host=cfg.host, port_of_stage=list(cfg.ports[1:]),
        backend="gloo", verify_checksums=cfg.verify, timeout_s=cfg.timeout_s)
    versions = []
    for step in range(cfg.refits):
        if step:
            perturb_(model, step)
        versions.append(sender.refit(version=10 * (step + 1))["version"])
        full = gather_full_hf_state_dict(model, family=family, vocab_size=spec.vocab_size)
        if rank == 0:
            _publish_expected(cfg, control, source.hf_config, full, step)
    destroy_refit_group(group)
    return {"role": "train", "rank": rank, "versions": versions}


CASES = {
    # Megatron's defaults: expert TP = TP = 2, which a model without experts has no use for
    "dense_tp2_megatron_defaults": (dict(model="dense", train_world=2, train_tp=2, train_pp=1,
                                         train_ep=1), {}),
    # MoE: expert TP 1, as the snippet's docstring asks
    "moe_tp2_ep2_expert_tp1": (dict(model="moe", train_world=2, train_tp=2, train_pp=1,
                                    train_ep=2), {"expert_tensor_parallel_size": 1}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_readme_training_snippet_refits_bit_exact_as_written(pool, case):
    layout, parallel_state_kwargs = CASES[case]
    cfg = RefitRunConfig(refits=2, quiet=True, timeout_s=60, gen_world=2, gen_tp=2, gen_ep=1,
                         **layout)
    results = pool.run(_job, cfg.train_world + cfg.gen_world, cfg, parallel_state_kwargs,
                       timeout_s=240)
    train = [r for r in results if r["role"] == "train"]
    gen = [r for r in results if r["role"] == "gen"]
    assert [r["versions"] for r in train] == [[10, 20]] * cfg.train_world
    assert len(gen) == cfg.gen_world
    for r in gen:
        # every param of the generation model compared (a name on one side only differs too)
        assert r["verified"] and r["mismatches"] == [[], []], (r["rank"], r["mismatches"])
        assert [s["version"] for s in r["refits"]] == [10, 20]


def test_the_snippet_says_a_bare_model_is_refused_for_its_fp32_norms():
    # the docstring points at the fix; the refusal itself names the params (test_megatron_source)
    text = readme_training_snippet()
    assert "keeps its norms in fp32 and is refused" in text
    assert "Float16Module(model.config, model)" in text
