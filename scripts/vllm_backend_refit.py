"""Refit into vLLM's own model classes through vLLM's weight-transfer API (the
``megatron_reshard`` backend), on this CPU machine, in the vLLM venv.

    .venv-vllm/bin/python scripts/vllm_backend_refit.py [--refits 2] [--gen-tp 2]

(``.venv-vllm``: the vLLM venv ``make install-vllm`` builds in the repository root.)

One launch of ``train_world + gen_world`` spawned processes (``tools.worlds.WorkerPool``):
the **training ranks** run a real megatron-core Qwen3-shaped model and the real
``RefitSender`` (``tools.e2e.run_training_rank``); each **generation rank** runs vLLM's own
parallel state and Qwen3 model class (dummy-loaded and post-processed by vLLM, as a worker
started with ``load_format="dummy"``), builds the engine with vLLM's
``WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="megatron_reshard"))``
and drives it with the calls vLLM's GPU worker makes: ``parse_init_info`` +
``init_transfer_engine``, then per refit ``start_weight_update``, ``update_weights({"version": N})``,
``finish_weight_update()`` (``tools.vllm_backend_refit``). After each refit every
generation rank compares all its params and buffers bit for bit with a second vLLM instance
loaded by vLLM's own ``load_weights`` from the full HF tensors. With ``--fail-extra`` one
more refit is broken part-way by training rank 0 and the weight state is printed.

With a real ``vllm.LLM`` the driver side is ``llm.init_weight_transfer_engine({"init_info":
{...}})``, ``llm.start_weight_update()``, ``llm.update_weights({"update_info": {"version": N}})``
(while the trainer runs ``sender.refit(version=N)``), ``llm.finish_weight_update(weight_version=str(N))``
and then ``llm.reset_prefix_cache(reset_running_requests=True)`` (README). That path (a
whole engine) does not start on this CPU-only machine; this script runs the engine inside
the processes that hold vLLM's models instead.

Prints ``VLLM_BACKEND_SUMMARY {...}``; exit status 0 when every refit committed and matched.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_reshard.tools.cli import HelpFormatter  # the docstring as written; defaults shown

# the tiny Qwen3 of tests/real_vllm (megatron-core overrides, and the HF config vLLM reads)
MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2,
         "ffn_hidden_size": 128, "vocab_size": 500, "qk_layernorm": True, "add_qkv_bias": False,
         "tie_embeddings": False, "head_dim": 16, "family": "qwen3"}
HF_CONFIG = {"vocab_size": 500, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
             "max_position_embeddings": 64, "tie_word_embeddings": False,
             "attention_bias": False, "architectures": ["Qwen3ForCausalLM"],
             "model_type": "qwen3", "torch_dtype": "bfloat16"}


def main(argv: list | None = None, pool=None) -> int:
    """Run the example; ``pool`` (a ``WorkerPool``) lends its workers instead of new ones
    (the test suite shares its pool: vLLM's import costs 6-10 s a process)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--refits", type=int, default=2,
                   help="refits through the backend, each compared with vLLM's load_weights")
    p.add_argument("--train-tp", type=int, default=2, choices=[1, 2],
                   help="training TP size (one training rank per TP rank, PP1)")
    p.add_argument("--gen-tp", type=int, default=2, choices=[1, 2],
                   help="vLLM TP size (one generation rank per TP rank)")
    p.add_argument("--fail-extra", action="store_true",
                   help="one more refit, broken part-way by training rank 0; prints the weight "
                        "state each generation rank is left with")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="the refit groups' timeout: a rank waiting longer fails")
    p.add_argument("--progress-s", type=float, default=10.0,
                   help="generation rank 0 prints how far the run got at most this often")
    args = p.parse_args(argv)

    from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment

    set_vllm_cpu_environment()  # inherited by the spawned ranks
    from megatron_reshard.tools.vllm_backend_refit import backend_refit_job
    from megatron_reshard.tools.run_config import RefitRunConfig
    from megatron_reshard.tools.worlds import WorkerPool

    cfg = RefitRunConfig(model="dense", model_overrides=dict(MODEL), refits=args.refits,
                         verify=False, dtype="bfloat16", quiet=True, timeout_s=args.timeout_s,
                         train_world=args.train_tp, train_tp=args.train_tp, train_pp=1,
                         train_ep=1, gen_world=args.gen_tp, gen_tp=args.gen_tp, gen_ep=1,
                         ports=(1, 2))  # placeholders: the pool hands each launch free ports
    problems = cfg.problems()
    if problems:
        print("invalid layout: " + "; ".join(problems), file=sys.stderr)
        return 2
    own_pool = pool is None
    pool = WorkerPool(cfg.train_world + cfg.gen_world) if own_pool else pool
    try:
        results = pool.run(backend_refit_job, cfg.train_world + cfg.gen_world, cfg, HF_CONFIG,
                           fail_extra=args.fail_extra, progress_s=args.progress_s,
                           num_ports=cfg.train_pp + 2,
                           timeout_s=120 + 60 * args.refits)
    finally:
        if own_pool:
            pool.close()
    gens = [r for r in results if r["role"] == "gen"]
    ok = all(g["differences"] == [[]] * args.refits
             and g["versions"] == list(range(1, args.refits + 1)) for g in gens)
    for g in gens:
        print(f"[gen {g['rank']}] {g['engine']}: versions {g['versions']}, params differing from "
              f"vLLM's load_weights per refit: {[len(d) for d in g['differences']]}",
              file=sys.stderr)
        if g["failed"]:
            w = g["failed"]["weights"]
            print(f"[gen {g['rank']}] broken refit: {w['state']}, version {w['version']}, "
                  f"started_from {w['started_from']}, {len(w['overwritten'])} params listed as "
                  f"overwritten", file=sys.stderr)
    summary = {"verified": ok, "refits": args.refits,
               "versions": [g["versions"] for g in gens],
               "differences": [g["differences"] for g in gens],
               "weights": [g["weights"]["state"] for g in gens],
               "failed": [g["failed"]["weights"] if g["failed"] else None for g in gens],
               "progress": gens[0]["progress"]}
    print("VLLM_BACKEND_SUMMARY " + json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
