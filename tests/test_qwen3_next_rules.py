"""Qwen3-Next's converter rules at name and tensor level (no model, no vLLM).

Names: megatron-core 0.16.1's Transformer-Engine spec (which cannot be built without TE)
fuses each layer's input norm into the first linear (``in_proj.layer_norm_weight`` for
Gated-DeltaNet, ``linear_qkv.layer_norm_weight`` for attention) and names grouped experts
``linear_fc1.weight<i>``; the local spec keeps ``input_layernorm``. Both convert. Tensors:
rows labelled by what they are (stream, head, row) go through the TP-chunk rules, and each
HF row must carry the label the checkpoint layout puts there.
"""

from __future__ import annotations

import pytest
import torch

from megatron_reshard.megatron.converters import ModelDims, NameConverter, full_from_tp_chunks, hf_global_shapes
from megatron_reshard.megatron.qwen3_next import LinearAttentionDims

NK, NV, DK, DV = 4, 8, 3, 2  # key heads, value heads, their dims
LINEAR = LinearAttentionDims(NK, NV, DK, DV)


def test_te_and_local_spec_names_both_convert():
    conv = NameConverter("qwen3_next", {0: 4, 1: 7}, num_local_experts=2, expert_offset=2)
    expect = {
        "decoder.layers.0.self_attention.in_proj.layer_norm_weight": ("replicated", ("model.layers.4.input_layernorm.weight",)),
        "decoder.layers.0.input_layernorm.weight": ("replicated", ("model.layers.4.input_layernorm.weight",)),
        "decoder.layers.0.self_attention.in_proj.weight": (
            "gdn_in_proj", ("model.layers.4.linear_attn.in_proj_qkvz.weight", "model.layers.4.linear_attn.in_proj_ba.weight")),
        "decoder.layers.0.self_attention.out_norm.weight": ("gdn_norm", ("model.layers.4.linear_attn.norm.weight",)),
        "decoder.layers.0.self_attention.A_log": ("column", ("model.layers.4.linear_attn.A_log",)),
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": ("replicated", ("model.layers.7.input_layernorm.weight",)),
        "decoder.layers.1.self_attention.linear_qkv.weight": (
            "gated_qkv", tuple(f"model.layers.7.self_attn.{x}_proj.weight" for x in "qkv")),
        "decoder.layers.1.mlp.experts.linear_fc2.weight1": ("expert_fc2", ("model.layers.7.mlp.experts.3.down_proj.weight",)),
        "decoder.layers.1.mlp.shared_experts.gate_weight": ("replicated", ("model.layers.7.mlp.shared_expert_gate.weight",)),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (
            "fc1", ("model.layers.7.mlp.shared_expert.gate_proj.weight", "model.layers.7.mlp.shared_expert.up_proj.weight")),
    }
    for name, (kind, hf) in expect.items():
        got = conv.convert(name)
        assert (got.kind, got.hf_names) == (kind, hf), name


def _labelled(streams: list[tuple[str, int, int]], tp: int) -> list[torch.Tensor]:
    """Megatron's in_proj TP chunks, one row per (stream, head, row) label, as rank r holds
    them: each stream's heads of rank r in order, streams one after the other."""
    chunks = []
    for r in range(tp):
        rows = []
        for code, heads, dim in streams:
            for h in range(heads * r // tp, heads * (r + 1) // tp):
                rows += [[code, h, i] for i in range(dim)]
        chunks.append(torch.tensor(rows, dtype=torch.float32))
    return chunks


def test_in_proj_and_conv1d_rows_land_where_the_checkpoint_has_them():
    streams = [(0, NK, DK), (1, NK, DK), (2, NV, DV), (3, NV, DV), (4, NV, 1), (5, NV, 1)]  # q k v z b a
    per = NV // NK
    expected_qkvz, expected_ba = [], []
    for g in range(NK):
        expected_qkvz += [[0, g, i] for i in range(DK)] + [[1, g, i] for i in range(DK)]
        expected_qkvz += [[2, h, i] for h in range(g * per, (g + 1) * per) for i in range(DV)]
        expected_qkvz += [[3, h, i] for h in range(g * per, (g + 1) * per) for i in range(DV)]
        expected_ba += [[4, h, 0] for h in range(g * per, (g + 1) * per)]
        expected_ba += [[5, h, 0] for h in range(g * per, (g + 1) * per)]
    expected_conv = ([[0, g, i] for g in range(NK) for i in range(DK)] + [[1, g, i] for g in range(NK) for i in range(DK)]
                     + [[2, h, i] for h in range(NV) for i in range(DV)])
    for tp in (1, 2, 4):
        dims = ModelDims(tp, 4, 2, 8, 100, True, linear=LINEAR)
        conv = NameConverter("qwen3_next", {0: 0}).convert("decoder.layers.0.self_attention.in_proj.weight")
        chunks = _labelled(streams, tp)
        full = full_from_tp_chunks(conv, chunks, dims)
        qkvz, ba = full[conv.hf_names[0]], full[conv.hf_names[1]]
        assert qkvz.tolist() == expected_qkvz and ba.tolist() == expected_ba, tp
        assert hf_global_shapes(conv, chunks[0].shape, dims) == {n: list(t.shape) for n, t in full.items()}
        c1 = NameConverter("qwen3_next", {0: 0}).convert("decoder.layers.0.self_attention.conv1d.weight")
        conv_chunks = _labelled(streams[:3], tp)
        assert full_from_tp_chunks(c1, conv_chunks, dims)[c1.hf_names[0]].tolist() == expected_conv, tp


def _gated_qkv_rows(nh: int, ng: int, hd: int) -> torch.Tensor:
    """Megatron's gated linear_qkv rows, each labelled [stream (q, gate, k, v), head, dim]:
    per KV group its q heads, their gate heads, then k and v."""
    per = nh // ng
    groups = []
    for g in range(ng):
        groups += [[0, g * per + j, i] for j in range(per) for i in range(hd)]
        groups += [[1, g * per + j, i] for j in range(per) for i in range(hd)]
        groups += [[2, g, i] for i in range(hd)] + [[3, g, i] for i in range(hd)]
    return torch.tensor(groups, dtype=torch.float32)


def test_gated_qkv_puts_each_heads_gate_after_its_query():
    nh, ng, hd = 4, 2, 2
    rows = _gated_qkv_rows(nh, ng, hd)
    for tp in (1, 2):
        dims = ModelDims(tp, nh, ng, hd, 100, True)
        conv = NameConverter("qwen3_next", {0: 0}).convert("decoder.layers.0.self_attention.linear_qkv.weight")
        q, k, v = full_from_tp_chunks(conv, list(rows.chunk(tp)), dims).values()
        assert q.tolist() == [[w, h, i] for h in range(nh) for w in (0, 1) for i in range(hd)]
        assert k.tolist() == [[2, g, i] for g in range(ng) for i in range(hd)]
        assert v.tolist() == [[3, g, i] for g in range(ng) for i in range(hd)]


def test_the_gated_norm_gains_one_where_megatrons_norms_are_zero_centred():
    """Qwen3-Next is trained with ``layernorm_zero_centered_gamma`` (Megatron's out_norm then
    computes x·(1+w)); the checkpoint's gated norm computes x·w. Without zero-centred norms
    (the local spec's torch norm) the weight is copied."""
    from dataclasses import replace

    w = torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=torch.bfloat16)
    conv = NameConverter("qwen3_next", {0: 0}).convert("decoder.layers.0.self_attention.out_norm.weight")
    assert conv.kind == "gdn_norm" and conv.tp_dim is None
    plain = full_from_tp_chunks(conv, [w], ModelDims(2, 4, 2, 8, 100, True, linear=LINEAR))
    assert torch.equal(plain[conv.hf_names[0]], w)
    centred = ModelDims(2, 4, 2, 8, 100, True, linear=replace(LINEAR, out_norm_offset=1.0))
    got = full_from_tp_chunks(conv, [w], centred)[conv.hf_names[0]]
    assert got.dtype == torch.bfloat16 and got.tolist() == [0.0, 1.0, 1.5, 3.0]


def test_qwen3_5_in_proj_streams_come_out_flat_and_land_in_vllms_output_shards():
    """Qwen3.5 (``qwen3_5_text`` / ``qwen3_5_moe_text``): Megatron's in_proj becomes the flat
    ``in_proj_qkv`` [q; k; v], ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` over all heads,
    and vLLM's rank r takes [q_r; k_r; v_r; z_r] of in_proj_qkvz and [b_r; a_r] of
    in_proj_ba, which is Megatron's rank-r chunk itself."""
    from megatron_reshard.vllm_layout.gated_delta_net import flat_in_proj_pieces
    from megatron_reshard.wire.extras import HFConfig

    streams = [(0, NK, DK), (1, NK, DK), (2, NV, DV), (3, NV, DV), (4, NV, 1), (5, NV, 1)]  # q k v z b a
    every = lambda code, heads, dim: [[code, h, i] for h in range(heads) for i in range(dim)]  # noqa: E731
    hf_config = HFConfig.of(dict(linear_num_key_heads=NK, linear_num_value_heads=NV,
                                 linear_key_head_dim=DK, linear_value_head_dim=DV))
    for family in ("qwen3_5_text", "qwen3_5_moe_text"):
        conv = NameConverter(family, {0: 5}).convert("decoder.layers.0.self_attention.in_proj.weight")
        la = "model.layers.5.linear_attn."
        assert (conv.kind, conv.hf_names) == ("gdn_in_proj_flat", tuple(
            la + f"in_proj_{w}.weight" for w in ("qkv", "z", "b", "a")))
        for tp in (1, 2, 4):
            dims = ModelDims(tp, 4, 2, 8, 100, True, linear=LINEAR)
            chunks = _labelled(streams, tp)
            full = full_from_tp_chunks(conv, chunks, dims)
            assert full[la + "in_proj_qkv.weight"].tolist() == every(*streams[0]) + every(*streams[1]) + every(*streams[2])
            for w, s in (("z", 3), ("b", 4), ("a", 5)):
                assert full[la + f"in_proj_{w}.weight"].tolist() == every(*streams[s]), (w, tp)
            assert hf_global_shapes(conv, chunks[0].shape, dims) == {n: list(t.shape) for n, t in full.items()}
            for r in range(tp):  # vLLM's rank r, filled from the flat tensors, is Megatron's chunk r
                qkvz_rows, ba_rows = 2 * (NK * DK + NV * DV) // tp, 2 * NV // tp
                held = {"in_proj_qkvz": torch.zeros(qkvz_rows, 3), "in_proj_ba": torch.zeros(ba_rows, 3)}
                for w in ("qkv", "z", "b", "a"):
                    target, rows, pieces = flat_in_proj_pieces(la + f"in_proj_{w}.weight", hf_config, tp, r)
                    key = target.rsplit(".", 2)[1]
                    assert rows == held[key].shape[0]
                    for (t0, t1), (h0, h1) in pieces:
                        held[key][t0:t1] = full[la + f"in_proj_{w}.weight"][h0:h1]
                assert torch.equal(torch.cat([held["in_proj_qkvz"], held["in_proj_ba"]]), chunks[r]), (tp, r)


def test_plan_reads_a_multimodal_qwen3_5_moe_config_as_its_text_model():
    """``plan --hf-config``: a Qwen3.5-MoE config.json (text_config inside the multimodal
    one, layer_types spelled out, no dense intermediate_size) gives the flat in_proj names on
    the linear-attention layers, and only the gated norm of the GDN layers travels packed,
    and the gated q/k/v where a training rank cuts a KV group (train TP 4 > 2)."""
    import json

    from megatron_reshard.tools.presets import config_from_hf_json, hf_params, travels_packed

    text = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=300, num_experts=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    cfg, problems = config_from_hf_json(json.dumps(dict(model_type="qwen3_5_moe", text_config=text)), "c")
    assert problems == [] and cfg["model_type"] == "qwen3_5_moe_text"
    params = {p.name: p.shape for p in hf_params(cfg)}
    assert params["model.layers.2.linear_attn.in_proj_qkv.weight"] == (2 * 32 + 32, 64)
    assert params["model.layers.2.linear_attn.in_proj_b.weight"] == (4, 64)
    assert "model.layers.1.linear_attn.in_proj_z.weight" not in params
    assert params["model.layers.1.self_attn.q_proj.weight"] == (2 * 4 * 16, 64)  # [q_h; gate_h]
    assert params["model.layers.3.mlp.shared_expert_gate.weight"] == (1, 64)
    assert sum(travels_packed(cfg, n) for n in params) == 2
    assert sum(travels_packed(cfg, n, train_tp=4) for n in params) == 2 + 2 * 3


def test_exact_path_views_are_each_ranks_rows_of_the_streams_and_gated_groups():
    """The exact path's views (no copy): each rank's rows of Qwen3.5's in_proj streams and of
    the conv1d segments are that rank's TP chunk of the checkpoint stream (q, k, v of
    in_proj_qkv apart); a gated linear_qkv seen per KV group is the checkpoint's q_proj rows
    reshaped to [nkv, heads, 2, head_dim, ...] (q then its gate per head), k and v per group."""
    from megatron_reshard.megatron import qwen3_next as q3

    streams = [(0, NK, DK), (1, NK, DK), (2, NV, DV), (3, NV, DV), (4, NV, 1), (5, NV, 1)]
    names = [f"model.layers.0.linear_attn.in_proj_{s}.weight" for s in ("qkv", "z", "b", "a")]
    for tp in (1, 2, 4):
        dims = ModelDims(tp, 4, 2, 8, 100, True, linear=LINEAR)
        conv = NameConverter("qwen3_5_text", {0: 0}).convert("decoder.layers.0.self_attention.in_proj.weight")
        chunks = _labelled(streams, tp)
        qkv, z, b, a = full_from_tp_chunks(conv, chunks, dims).values()
        kd = NK * DK
        hf = {"q": qkv[:kd], "k": qkv[kd:2 * kd], "v": qkv[2 * kd:], "z": z, "b": b, "a": a}
        for r in range(tp):
            views = q3.stream_views(names, chunks[r], LINEAR, tp)
            for which, full in hf.items():
                name = f"model.layers.0.linear_attn.in_proj_{which}.weight"
                assert torch.equal(views[name], full.chunk(tp)[r]), (tp, r, which)
                assert views[name].data_ptr() >= chunks[r].data_ptr()
            conv_rows = _labelled(streams[:3], tp)[r]
            segs = q3.conv1d_stream_views("model.layers.0.linear_attn.conv1d.weight", conv_rows, LINEAR, tp)
            for which in "qkv":
                assert torch.equal(segs[f"model.layers.0.linear_attn.conv1d_{which}.weight"],
                                   hf[which].chunk(tp)[r]), (tp, r, which)
    nh, ng, hd = 4, 2, 2
    rows = _gated_qkv_rows(nh, ng, hd)
    for tp in (1, 2):
        conv = NameConverter("qwen3_next", {0: 0}).convert("decoder.layers.0.self_attention.linear_qkv.weight")
        q, k, v = full_from_tp_chunks(conv, list(rows.chunk(tp)), ModelDims(tp, nh, ng, hd, 100, True)).values()
        wire_q = q.reshape(q3.gated_q_group_shape(ng, hd, q.shape))
        for r, chunk in enumerate(rows.chunk(tp)):
            views = q3.gated_qkv_views(conv.hf_names, chunk, nh, ng, hd, tp)
            got_q, got_k, got_v = (views[n] for n in conv.hf_names)
            assert torch.equal(got_q, wire_q.chunk(tp)[r]), (tp, r)
            assert torch.equal(got_k, k.view(ng, hd, 3).chunk(tp)[r]), (tp, r)
            assert torch.equal(got_v, v.view(ng, hd, 3).chunk(tp)[r]), (tp, r)


def test_a_gated_q_region_reads_as_one_block_of_checkpoint_rows():
    from megatron_reshard.errors import BadInputError
    from megatron_reshard.vllm_layout.dense import is_qkv_per_group, per_group_as_hf_rows

    shape = (2, 4, 2, 8, 16)  # nkv, heads per group, q/gate, head_dim, hidden
    assert is_qkv_per_group("model.layers.3.self_attn.q_proj.weight", shape)
    assert not is_qkv_per_group("model.layers.3.self_attn.k_proj.weight", shape)
    # a group's heads split over two ranks (vLLM TP 4 > 2 KV heads): rank 3 holds heads 2..3 of group 1
    hf_shape, rows = per_group_as_hf_rows(shape, ((1, 2), (2, 4), (0, 2), (0, 8), (0, 16)))
    assert hf_shape == (2 * 4 * 16, 16) and rows == ((4 * 16 + 2 * 16, 4 * 16 + 4 * 16), (0, 16))
    with pytest.raises(BadInputError, match="cuts a head"):
        per_group_as_hf_rows(shape, ((0, 1), (0, 4), (0, 1), (0, 8), (0, 16)))
