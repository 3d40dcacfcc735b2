"""What issue 51's trust checks cost per refit, beside one copy of the weights (same run).

Both run at the start of every refit, before the version vote:

- generation side, ``receiver.live_targets.LiveTargets.check()``: vLLM's params read again
  by name and compared with those the targets were bound to; timed when nothing moved
  (every refit pays it) and, after ``param.data = clone`` of every param, the check plus
  the payload mapped again onto the new storage (``build_receiver_param_map``), what a
  refit after vLLM re-allocated everything pays;
- training side with ``check_finite``, ``refit.finite.nonfinite`` over every tensor the
  sender reads (one multi-tensor max-abs per batch, one host sync).

The baseline of each side: one copy of that side's weights (``clone`` of every param), the
least a refit that reads them all does. One process, gloo, TP1: a real megatron-core MoE
model (experts one param per expert and projection) and a vLLM-layout model of the same
config (``testing.vllm_like``: experts fused as vLLM holds them).

    python scripts/bench_receiver_trust.py                    # 24 layers x 64 experts
    python scripts/bench_receiver_trust.py --layers 4 --experts 8 --repeat 5   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from megatron_reshard.tools.bench.timing import median_timer


def _median_s(fn, repeat: int) -> float:
    return median_timer(torch.device("cpu"))(fn, repeat, 0)


def _line(what: str, seconds: float, params: int, baseline: float) -> str:
    return (f"{what:<44} {seconds * 1e3:9.3f} ms = {seconds / params * 1e6:7.3f} us per param; "
            f"/ one copy {seconds / baseline:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_reshard.receiver.live_targets import LiveTargets
    from megatron_reshard.receiver.param_map import build_receiver_param_map
    from megatron_reshard.receiver.targets import VllmTargets
    from megatron_reshard.refit.finite import nonfinite
    from megatron_reshard.testing.vllm_like import build_vllm_like_model
    from megatron_reshard.tools.tiny_source import tiny_source
    from megatron_reshard.tools.worlds import free_ports
    from megatron_reshard.wire.records import RefitPayload

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}",
                            rank=0, world_size=1)
    model, source, _, _ = tiny_source("moe", 1, seed=0, num_layers=args.layers,
                                      num_moe_experts=args.experts)
    payload = RefitPayload.of(source.payload)

    # generation side: vLLM's layout of the same model, mapped as a session maps it
    gen = build_vllm_like_model(payload.hf_config, 0, 1, 1, torch.bfloat16)
    named = dict(gen.named_parameters())
    targets = VllmTargets.from_named_parameters(named, payload.hf_config, 0, 1, label="gen rank 0")
    rank_in_group = 1  # after the one training rank
    build_receiver_param_map(payload, targets, rank_in_group)
    live = LiveTargets(targets.params, named, gen, "gen rank 0")
    gen_params = len(named)
    gen_copy = _median_s(lambda: [p.detach().clone() for p in gen.parameters()], args.repeat)
    steady = _median_s(lambda: live.check(), args.repeat)

    def moved_and_remapped() -> float:
        with torch.no_grad():
            for p in gen.parameters():
                p.data = p.data.clone()
        t0 = time.perf_counter()
        changed = live.check()
        assert changed is not None and len(changed.moved) == gen_params and not changed.refused
        for name, param in changed.moved.items():
            targets.params[name] = param.detach()
        build_receiver_param_map(payload, targets, rank_in_group)
        live.accept()
        return time.perf_counter() - t0

    remap = statistics.median(moved_and_remapped() for _ in range(args.repeat))

    # training side: every tensor the sender reads
    converted = source.plan.local.converted
    tensors = [t for _, t in converted]
    train_copy = _median_s(lambda: [t.detach().clone() for t in tensors], args.repeat)
    finite = _median_s(lambda: nonfinite(tensors), args.repeat)

    mib = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**20  # noqa: E731
    print(f"model: {args.layers} layers x {args.experts} experts; host threads "
          f"{torch.get_num_threads()}")
    print(f"generation side: {gen_params} vLLM params, {mib(named.values()):.1f} MiB; "
          f"one copy {gen_copy * 1e3:.3f} ms")
    print(_line("  live targets check, nothing moved", steady, gen_params, gen_copy))
    print(_line("  check + payload mapped again, all moved", remap, gen_params, gen_copy))
    print(f"training side: {len(tensors)} tensors, {mib(tensors):.1f} MiB; "
          f"one copy {train_copy * 1e3:.3f} ms")
    print(_line("  check_finite before the vote", finite, len(tensors), train_copy))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
