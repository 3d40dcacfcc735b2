"""Qwen3-Next's converter rules, checked between a real megatron-core model and vLLM's own class.

A tiny Qwen3-Next-shaped ``GPTModel`` (megatron-core 0.16.1's own ``GatedDeltaNet`` layers in
three of four layers, ``attention_output_gate`` on the fourth, MoE with a gated shared
expert) is built on CPU at TP 2 (``testing.megatron_models.gated_delta_net_block_spec``
says what differs from megatron-core's TE-only spec). Its params go through the converter
(``megatron.qwen3_next``: TP chunks -> full HF tensors) into vLLM 0.33's
``Qwen3NextForCausalLM`` by vLLM's own ``load_weights`` (every vLLM param must be loaded).
Then each side's own code reads the same input: the six Gated-DeltaNet streams (q, k, v,
z, b, a) as ``GatedDeltaNet.forward`` splits Megatron's ``in_proj`` on each TP rank against
vLLM's ``fix_query_key_value_ordering`` of its ``in_proj_qkvz`` / ``in_proj_ba``; the output
gate and v of the full-attention layer from Megatron's ``get_query_key_value_tensors``
against vLLM's ``_project_qkv_gate``; conv1d channels of each TP rank against the rows
vLLM's own conv1d loader gives a TP rank. Bit for bit.

This checks names and layouts on each side's own reading; the refits themselves are
checked in ``test_real_vllm.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed")
pytest.importorskip("compressed_tensors")  # vLLM's Gated-DeltaNet layer imports it

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

SPEC = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16,
            ffn_hidden_size=96, vocab_size=200, qk_layernorm=True, num_moe_experts=4,
            moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
            experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
            attention_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
TP = 2


def hf_config() -> dict:
    s = SPEC
    return dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", torch_dtype="bfloat16",
                vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["ffn_hidden_size"],
                num_hidden_layers=s["num_layers"], num_attention_heads=s["num_attention_heads"],
                num_key_value_heads=s["num_query_groups"], head_dim=s["head_dim"], hidden_act="silu",
                rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=1.0,
                max_position_embeddings=64, tie_word_embeddings=False,
                linear_conv_kernel_dim=s["linear_conv_kernel_dim"], linear_key_head_dim=s["linear_key_head_dim"],
                linear_value_head_dim=s["linear_value_head_dim"],
                linear_num_key_heads=s["linear_num_key_heads"],
                linear_num_value_heads=s["linear_num_value_heads"],
                full_attention_interval=s["linear_attention_freq"], num_experts=s["num_moe_experts"],
                num_experts_per_tok=2, moe_intermediate_size=s["moe_ffn_hidden_size"],
                shared_expert_intermediate_size=s["moe_shared_expert_intermediate_size"],
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def _megatron_side(job) -> dict:
    """Build the TP-2 model, convert every param, and read each rank's own streams."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_reshard.megatron.converters import ModelDims, NameConverter, full_from_tp_chunks, hf_global_shapes
    from megatron_reshard.megatron.qwen3_next import LinearAttentionDims
    from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
    from megatron_reshard.tools.worlds import init_gloo_world

    init_gloo_world(job)
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, distributed_timeout_minutes=1)
    model = build_gpt_model(TinyGPTSpec(**SPEC))
    c = model.config
    dims = ModelDims(tp_size=TP, num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
                     head_dim=c.kv_channels, vocab_size=SPEC["vocab_size"], gated=True,
                     linear=LinearAttentionDims.from_config(c))
    conv = NameConverter("qwen3_next", {i: i for i in range(c.num_layers)})
    named = dict(model.named_parameters())
    converted, unknown = conv.convert_all(list(named))
    full, shape_problems = {}, []
    for cv in converted:
        local = named[cv.megatron_name].detach()
        chunks = [local]
        if cv.tp_dim is not None:
            chunks = [torch.empty_like(local) for _ in range(TP)]
            dist.all_gather(chunks, local.contiguous())
        tensors = full_from_tp_chunks(cv, chunks, dims)
        expected = hf_global_shapes(cv, local.shape, dims)
        for name, t in tensors.items():
            if list(t.shape) != expected[name]:
                shape_problems.append((name, list(t.shape), expected[name]))
        full.update({n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()})
    # each rank's own streams, as megatron-core's code splits them
    x = torch.randn(3, 1, c.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    streams = {}
    for layer in model.decoder.layers:
        i, attn = layer.layer_number - 1, layer.self_attention
        with torch.no_grad():
            if hasattr(attn, "in_proj"):  # GatedDeltaNet.forward's split of in_proj
                qkvzba = torch.nn.functional.linear(x, attn.in_proj.weight)
                qkv, z, b, a = torch.split(qkvzba, [(attn.qk_dim * 2 + attn.v_dim) // TP, attn.v_dim // TP,
                                                     attn.num_value_heads // TP, attn.num_value_heads // TP], -1)
                q, k, v = torch.split(qkv, [attn.qk_dim // TP, attn.qk_dim // TP, attn.v_dim // TP], -1)
                streams[i] = dict(q=q, k=k, v=v, z=z, b=b, a=a, conv1d=attn.conv1d.weight.detach().clone())
            else:
                _, _, v, gate = attn.get_query_key_value_tensors(x, output_gate=True)
                streams[i] = dict(v=v, gate=gate)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return dict(full=full, unknown=unknown, shape_problems=shape_problems, streams=streams,
                names=sorted(named))


def _vllm_side(job, full: dict, tp_streams: list) -> dict:
    """vLLM's own load of the converted tensors (TP 1), and its own reading of the streams."""
    import torch

    from megatron_reshard.testing import vllm_models as vm

    vm.ARCHITECTURE_MODULES.setdefault("Qwen3NextForCausalLM", "qwen3_next")
    cfg = hf_config()
    config = vm.vllm_config_for(vm.write_model_dir(cfg), 1)
    x = torch.randn(3, 1, cfg["hidden_size"], generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    x = x.reshape(3, cfg["hidden_size"])
    bad = []
    with vm.vllm_parallel_state(config, 0, 1, job.ports[1]):
        model = vm.loaded_model(config, full)  # raises if any vLLM param was left unloaded
        for i, layer in enumerate(model.model.layers):
            with torch.no_grad():
                if hasattr(layer, "linear_attn"):
                    la = layer.linear_attn
                    qkvz, _ = la.in_proj_qkvz(x)
                    ba, _ = la.in_proj_ba(x)
                    q, k, v, z, b, a = la.fix_query_key_value_ordering(qkvz, ba)
                    ours = dict(q=q, k=k, v=v, z=z, b=b, a=a)
                    conv = la.conv1d.weight
                    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
                    val_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
                    for r, st in enumerate(tp_streams):
                        for name, got in ours.items():
                            part = got.reshape(3, TP, -1)[:, r]  # heads are in order: TP chunks
                            if not torch.equal(part, st[i][name].reshape(3, -1)):
                                bad.append(f"layer {i} {name} tp{r}")
                        # vLLM's conv1d loader gives TP rank r the rows [q_r, k_r, v_r]
                        rows = [(lo + r * n // TP, lo + (r + 1) * n // TP) for lo, n in
                                ((0, key_dim), (key_dim, key_dim), (2 * key_dim, val_dim))]
                        mine = torch.cat([conv[lo:hi] for lo, hi in rows], 0)
                        if not torch.equal(mine, st[i]["conv1d"]):
                            bad.append(f"layer {i} conv1d tp{r}")
                else:
                    qkv, _ = layer.self_attn.qkv_proj(x)
                    # RoPE (q, k only) through vLLM's portable path: its CPU op is in vllm._C
                    rope = layer.self_attn.rotary_emb
                    rope._forward_method = rope.forward_native
                    _, _, v, gate = layer.self_attn._project_qkv_gate(qkv, torch.zeros(3, dtype=torch.long))
                    for r, st in enumerate(tp_streams):
                        for name, got in (("v", v), ("gate", gate)):
                            part = got.reshape(3, TP, -1)[:, r]
                            if not torch.equal(part, st[i][name].reshape(3, -1)):
                                bad.append(f"layer {i} {name} tp{r}")
    return dict(bad=bad, vllm_params=len(vm.model_tensors(model)))


def test_qwen3_next_converter_agrees_with_vllms_own_loading_and_reading(pool):
    sides = pool.run(_megatron_side, TP, timeout_s=300)
    for s in sides:
        assert s["unknown"] == [], s["unknown"]
        assert s["shape_problems"] == [], s["shape_problems"]
    # both TP ranks produce the same full HF tensors
    a, b = sides[0]["full"], sides[1]["full"]
    assert sorted(a) == sorted(b)
    assert [n for n in a if not (a[n].shape == b[n].shape and bool((a[n] == b[n]).all()))] == []
    # every GDN / gated-attention name of the checkpoint is produced
    for n in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
              "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.A_log",
              "model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.norm.weight",
              "model.layers.0.linear_attn.out_proj.weight", "model.layers.3.self_attn.q_proj.weight",
              "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.2.mlp.experts.3.down_proj.weight"):
        assert n in a, n
    assert list(a["model.layers.3.self_attn.q_proj.weight"].shape) == [2 * 4 * 16, 64]
    result = pool.run(_vllm_side, 1, a, [s["streams"] for s in sides], timeout_s=300)[0]
    assert result["bad"] == [], result["bad"]
