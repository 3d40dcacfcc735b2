"""Nemotron-H's Mamba-2 rules below the real-vLLM test (tests/real_vllm/test_nemotron_h.py):
the converter on a real megatron-core ``MambaModel`` at TP 2 (built on CPU under
``testing.megatron_mamba``) against the independent gather; vLLM's per-rank layout of the
fused ``in_proj`` / ``conv1d`` (a single group replicated) against rows labelled by what they
are; the streams of the exact path; the refusals."""

from __future__ import annotations

import pytest
import torch

from megatron_reshard.megatron import mamba
from megatron_reshard.megatron.mamba import MambaDims
from megatron_reshard.receiver.full_weights import load_full_weights
from megatron_reshard.receiver.targets import TargetError, VllmTargets

# ---- vLLM's layout (vllm_layout.mamba) against labelled rows


def _labelled_in_proj(heads: int, head_dim: int, groups: int, state: int) -> torch.Tensor:
    """A checkpoint ``in_proj`` whose row i says (stream, index within the stream)."""
    rows = []
    for code, n in enumerate((heads * head_dim, heads * head_dim, groups * state, groups * state, heads)):
        rows += [[code, i] for i in range(n)]
    return torch.tensor(rows, dtype=torch.float32)


def _expected_rank_rows(heads, head_dim, groups, state, tp, r) -> list[list[int]]:
    """What vLLM's MambaMixer2 holds on rank r, by an explicit loop: each stream's r-th TP
    part; B and C whole where one group is replicated over the ranks."""
    rows = []
    for code, n in enumerate((heads * head_dim, heads * head_dim, groups * state, groups * state, heads)):
        if code in (2, 3) and groups % tp:  # n_groups == 1: the one group on every rank
            rows += [[code, i] for i in range(n)]
        else:
            rows += [[code, i] for i in range(r * n // tp, (r + 1) * n // tp)]
    return rows


@pytest.mark.parametrize("groups,tp", [(2, 1), (2, 2), (4, 2), (1, 2), (1, 4), (1, 1)])
def test_fused_in_proj_lands_where_vllm_keeps_it(groups, tp):
    heads, head_dim, state = 8, 2, 3
    cfg = dict(mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=groups, ssm_state_size=state)
    full = _labelled_in_proj(heads, head_dim, groups, state)
    name = "backbone.layers.0.mixer.in_proj.weight"
    for r in range(tp):
        want = torch.tensor(_expected_rank_rows(heads, head_dim, groups, state, tp, r), dtype=torch.float32)
        target = torch.full_like(want, -1.0)
        targets = VllmTargets.from_named_parameters({"model.layers.0.mixer.in_proj.weight": target}, cfg, r, tp)
        load_full_weights(targets, {name: full})
        assert torch.equal(target, want), (groups, tp, r)
        # the exact path's streams land in the same rows
        if groups % tp == 0:
            target.fill_(-1.0)
            streams = dict(zip(mamba.stream_names(name), full.split(MambaDims(heads, head_dim, groups, state)
                                                                    .in_proj_rows(1))))
            load_full_weights(targets, streams)
            assert torch.equal(target, want), (groups, tp, r, "streams")


def test_a_is_written_as_vllms_neg_exp_of_a_log_in_float32():
    cfg = dict(mamba_num_heads=4, mamba_head_dim=2, n_groups=1, ssm_state_size=2)
    a_log = torch.tensor([0.5, -1.25, 2.0, 0.0], dtype=torch.bfloat16)
    for r in range(2):
        target = torch.zeros(2, dtype=torch.float32)
        targets = VllmTargets.from_named_parameters({"model.layers.3.mixer.A": target}, cfg, r, 2)
        load_full_weights(targets, {"backbone.layers.3.mixer.A_log": a_log})
        assert torch.equal(target, -torch.exp(a_log[2 * r:2 * r + 2].float()))


def test_mamba_splits_vllm_cannot_hold_are_refused_by_name():
    cfg = dict(mamba_num_heads=8, mamba_head_dim=2, n_groups=2, ssm_state_size=3)
    targets = VllmTargets.from_named_parameters({"model.layers.0.mixer.D": torch.zeros(2)}, cfg, 0, 4)
    with pytest.raises(TargetError, match=r"backbone.layers.0.mixer.D: its 2 Mamba groups neither split "
                                          r"over tp_size=4 nor are one group"):
        targets.resolve("backbone.layers.0.mixer.D", (8,))
    targets = VllmTargets.from_named_parameters({"model.layers.0.mixer.D": torch.zeros(1)}, cfg, 0, 16)
    with pytest.raises(TargetError, match="its 8 Mamba heads do not split over tp_size=16"):
        targets.resolve("backbone.layers.0.mixer.D", (8,))


def test_streams_travel_apart_only_where_vllm_splits_them_as_megatron_does():
    d = MambaDims(num_heads=8, head_dim=2, num_groups=2, state_size=3)
    meta = {"backbone.layers.0.mixer.in_proj.weight": {"shape": [sum(d.in_proj_rows(1)), 5], "dtype": "x"},
            "backbone.layers.0.mixer.conv1d.bias": {"shape": [sum(d.conv1d_rows(1))], "dtype": "x"}}
    split = mamba.stream_metadata(meta, d, 2, keep_packed=lambda n: False)
    p = "backbone.layers.0.mixer."
    assert split == {p + "in_proj_z.weight": {"shape": [16, 5], "dtype": "x"},
                     p + "in_proj_x.weight": {"shape": [16, 5], "dtype": "x"},
                     p + "in_proj_B.weight": {"shape": [6, 5], "dtype": "x"},
                     p + "in_proj_C.weight": {"shape": [6, 5], "dtype": "x"},
                     p + "in_proj_dt.weight": {"shape": [8, 5], "dtype": "x"},
                     p + "conv1d_x.bias": {"shape": [16], "dtype": "x"},
                     p + "conv1d_B.bias": {"shape": [6], "dtype": "x"},
                     p + "conv1d_C.bias": {"shape": [6], "dtype": "x"}}
    assert mamba.stream_metadata(meta, d, 4, keep_packed=lambda n: False) == meta  # 2 groups over 4
    assert mamba.stream_metadata(meta, d, 2, keep_packed=lambda n: "in_proj" in n) == {
        p + "in_proj.weight": meta[p + "in_proj.weight"], **{k: v for k, v in split.items() if "conv1d" in k}}


# ---- the converter on a real megatron-core MambaModel (TP 2)


def _convert_and_gather(job) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_reshard.megatron.converters import ModelDims, NameConverter, full_from_tp_chunks
    from megatron_reshard.testing.megatron_mamba import (TinyMambaSpec, build_mamba_model,
                                                         gather_nemotron_h_hf_state_dict)
    from megatron_reshard.tools.worlds import init_gloo_world
    import torch.distributed as dist

    init_gloo_world(job)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, distributed_timeout_minutes=1)
    spec = TinyMambaSpec()
    model = build_mamba_model(spec)
    c = model.config
    dims = ModelDims(tp_size=2, num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
                     head_dim=c.kv_channels, vocab_size=spec.vocab_size, gated=False,
                     mamba=MambaDims.from_config(c))
    conv = NameConverter("nemotron_h", {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)},
                         gated=False)
    named = dict(model.named_parameters())
    converted, unknown = conv.convert_all(list(named))
    full, views = {}, {}
    for cv in converted:
        local = named[cv.megatron_name].detach()
        chunks = [local]
        if cv.tp_dim is not None:
            chunks = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(chunks, local.contiguous())
        full.update(full_from_tp_chunks(cv, chunks, dims))
        if cv.kind in mamba.KINDS:
            views.update({n: v.clone() for n, v in mamba.stream_views(cv.hf_names[0], local, dims.mamba, 2).items()})
    oracle = gather_nemotron_h_hf_state_dict(model, spec.vocab_size)
    from megatron_reshard.megatron import MegatronRefitSource

    try:  # 2 Mamba groups over gen TP 4: refused before any collective (attention would split)
        MegatronRefitSource(model, gen_parallelism={"tp_size": 4, "ep_size": 1}, gen_world_size=4,
                            family="nemotron_h", vocab_size=spec.vocab_size)
        refused = None
    except ValueError as err:
        refused = str(err)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return dict(full=full, oracle=oracle, unknown=unknown, views=views, names=sorted(named), refused=refused)


def test_converter_on_a_real_mamba_model_matches_the_independent_gather(pool):
    sides = pool.run(_convert_and_gather, 2, timeout_s=300)
    for s in sides:
        assert s["refused"] == ("gen_parallelism['tp_size']=4: the model's 2 Mamba groups neither split "
                                "over tp_size=4 nor are one group (vLLM's MambaMixer2 replicates only "
                                "a single group)"), s["refused"]
        assert s["unknown"] == []
        assert sorted(s["full"]) == sorted(s["oracle"])
        assert [n for n in s["full"] if not torch.equal(s["full"][n], s["oracle"][n])] == []
    # the model has every kind of Mamba-2 param, and the attention / MLP layers
    assert {"decoder.layers.0.mixer.in_proj.weight", "decoder.layers.0.mixer.conv1d.bias",
            "decoder.layers.0.mixer.A_log", "decoder.layers.0.mixer.norm.weight",
            "decoder.layers.1.self_attention.linear_qkv.weight", "decoder.layers.3.mlp.linear_fc1.weight",
            "decoder.final_norm.weight"} <= set(sides[0]["names"])
    # each stream sent apart is the TP part of that stream of the checkpoint tensor
    full = sides[0]["full"]
    d = MambaDims(8, 16, 2, 16)
    for which, rows in (("in_proj", d.in_proj_rows(1)), ("conv1d", d.conv1d_rows(1))):
        leaf = "weight"
        hf = full[f"backbone.layers.2.mixer.{which}.{leaf}"]
        names = mamba.stream_names(f"backbone.layers.2.mixer.{which}.{leaf}")
        for stream, part in zip(names, hf.split(rows)):
            for r, s in enumerate(sides):
                assert torch.equal(s["views"][stream], part.chunk(2)[r]), (stream, r)
