"""Nemotron-H refitted into vLLM's own ``NemotronHForCausalLM``, checked against vLLM's loading.

A tiny real megatron-core ``MambaModel`` (hybrid pattern ``M*M-``: Mamba-2, attention, Mamba-2,
MLP; built on CPU under ``testing.megatron_mamba``'s construction-only shims) is refitted by
the real ``RefitSender`` into generation ranks running vLLM's own NemotronH class
(``tools.vllm_refit``, the harness of the other families). After each of two refits every
vLLM param and buffer must equal, bit for bit, a second vLLM instance loaded by vLLM's own
``load_weights`` from the full HF tensors (``testing.megatron_mamba``'s independent gather):
the fused ``in_proj`` ``[z, x, B, C, dt]`` and ``conv1d`` ``[x, B, C]`` per TP rank, vLLM's
``A = -exp(A_log)``, ``D``, ``dt_bias``, the gated norm, ``out_proj``, attention, MLP, norms,
vocab. Layouts: gen TP 1 and 2, train TP 2 -> gen TP 1, uneven PP, a single Mamba group
replicated over gen TP 2; a planted z/x/B/C/dt split error is seen.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm.distributed")

from megatron_reshard.testing.megatron_mamba import TinyMambaSpec  # noqa: E402
from megatron_reshard.tools.run_config import RefitRunConfig  # noqa: E402
from megatron_reshard.tools.vllm_refit import vllm_refit_job  # noqa: E402
from test_real_vllm import check_equal_to_vllm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
REFITS = 2
SPEC = TinyMambaSpec()
# (train, gen, spec): gen TP 2 splits the 2 groups; with one group vLLM replicates it
LAYOUTS = {
    "tp2-to-tp1": (dict(train_tp=2), dict(gen_tp=1), SPEC),
    "tp1-to-tp2": (dict(train_tp=1), dict(gen_tp=2), SPEC),
    "tp2-pp2-uneven-to-tp2": (dict(train_tp=2, train_pp=2), dict(gen_tp=2),
                              TinyMambaSpec(num_layers_in_first_pipeline_stage=1)),
    "one-group-tp1-to-tp2": (dict(train_tp=1), dict(gen_tp=2), TinyMambaSpec(mamba_num_groups=1)),
}


def hf_config(spec: TinyMambaSpec) -> dict:
    return dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", torch_dtype="bfloat16",
                vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                num_hidden_layers=len(spec.pattern), hybrid_override_pattern=spec.pattern,
                num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_query_groups,
                head_dim=spec.head_dim, attention_bias=False, intermediate_size=spec.ffn_hidden_size,
                mlp_bias=False, mlp_hidden_act="relu2", mamba_num_heads=spec.mamba_num_heads,
                mamba_head_dim=spec.mamba_head_dim, ssm_state_size=spec.mamba_state_dim,
                n_groups=spec.mamba_num_groups, conv_kernel=spec.mamba_conv_kernel, use_conv_bias=True,
                use_bias=False, mamba_hidden_act="silu", layer_norm_epsilon=spec.layernorm_epsilon,
                residual_in_fp32=False, tie_word_embeddings=False, max_position_embeddings=64,
                chunk_size=128)


def _build(mamba_spec, gpt_spec, device, dtype):
    """The harness's model builder: the MambaModel of ``mamba_spec`` (``gpt_spec``, the
    harness's GPT spec, carries only the dtype and vocab the sender reads)."""
    from megatron_reshard.testing.megatron_mamba import build_mamba_model

    assert gpt_spec.vocab_size == mamba_spec.vocab_size
    return build_mamba_model(mamba_spec).to(device=device, dtype=dtype)


def run_layout(pool, key: str, **options) -> list[dict]:
    train, gen, spec = LAYOUTS[key]
    train = {"train_pp": 1, "train_ep": 1, **train}
    world = dict(train_world=train["train_tp"] * train["train_pp"], gen_world=gen["gen_tp"])
    # verify=False: the stand-in (testing.vllm_like) has no Nemotron-H layout; vLLM is the oracle
    cfg = RefitRunConfig(model="dense", model_overrides=dict(family="nemotron_h", vocab_size=spec.vocab_size),
                         refits=REFITS, verify=False, dtype="bfloat16", quiet=True, timeout_s=120,
                         **train, **gen, **world)
    results = pool.run(vllm_refit_job, cfg.train_world + cfg.gen_world, cfg, hf_config(spec),
                       model_builder=functools.partial(_build, spec), num_ports=cfg.train_pp + 2,
                       timeout_s=420, **options)
    return [r for r in results if r["role"] == "gen"]


@pytest.fixture(scope="module")
def refitted(pool):
    cache: dict = {}

    def get(key: str) -> list[dict]:
        if key not in cache:
            cache[key] = run_layout(pool, key)
        return cache[key]

    return get


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_nemotron_h_refit_is_bit_equal_to_vllms_own_loading(refitted, key):
    gens = refitted(key)
    for g in gens:
        check_equal_to_vllm(g, f"{key} gen rank {g['rank']}", REFITS)


def test_nemotron_h_sends_only_a_log_packed_where_vllm_splits_every_stream(refitted):
    """Every param but A_log (vLLM holds -exp(A_log)) takes the exact path where the gen TP
    divides the Mamba groups: in_proj and conv1d as their streams (megatron.mamba), q/k/v per
    KV group, vocab, norms, D, dt_bias, the gated norm, out_proj, MLP. With one group over
    two gen ranks vLLM replicates B and C: in_proj and conv1d travel whole (packed) too."""
    for key in LAYOUTS:
        per_mamba_layer = 4 if key.startswith("one-group") else 1  # A_log (+ in_proj, conv1d w/b)
        for g in refitted(key):
            assert g["summary"]["misc_params"] == 2 * per_mamba_layer, (key, g["rank"], g["summary"])
            assert all(s["bulk_bytes"] > 0 for s in g["refits"]), (key, g["refits"])


@pytest.mark.parametrize("key", ["tp2-to-tp1", "one-group-tp1-to-tp2"])
def test_nemotron_h_a_planted_in_proj_split_error_is_seen(pool, key):
    """Training ranks that send in_proj with each rank's B and C rows exchanged (as streams on
    the exact path; whole where one group is replicated) leave exactly the in_proj of both
    Mamba layers different from vLLM's own loading."""
    for g in run_layout(pool, key, plant_mamba_split_error=True):
        assert len(g["differences"]) == REFITS, g["rank"]
        for bad in g["differences"]:
            assert bad == [f"model.layers.{i}.mixer.in_proj.weight" for i in (0, 2)], (g["rank"], bad)
