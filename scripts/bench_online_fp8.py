"""What vLLM's online block FP8 costs now that its bytes come from vLLM's own function.

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/bench_online_fp8.py [--experts 8 --hidden 2048 --inter 768]

One MoE layer of one generation rank (``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``,
FP8 with their fp32 block scales) plus a dense ``qkv_proj`` of ``[3H, H]``. The pieces
arrive as the refit delivers them (gate, up, down for all experts; q, k, v), in BF16:

- **wire bytes** of these weights: BF16 (``gen_quant="block_fp8_online"``) against FP8 +
  fp32 scales (the sender-quantized plan, ``"block_fp8"``, now refused for online layers);
- **receiver quantization time**: the receiver's real code (``receiver.online_quant``:
  each matrix gathered, then vLLM's ``per_block_cast_to_fp8`` from vLLM's online module
  on it), against the same-run baseline of the receiver's old path for a BF16 weight
  (``fp8.quant.quantize_blockwise_fp8`` on each piece, ``fp8_targets.quantize_into``);
  the sender-quantized plan did the same work on the training side instead. The peak of
  the gathering buffers is printed too. Median of ``--repeats``.

CPU figures (torch on the host); on a GPU both paths are elementwise kernels over the same
bytes, and the wire bytes are the device's too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_reshard.fp8.quant import blockwise_scale_shape
from megatron_reshard.receiver.fp8_targets import quantize_into
from megatron_reshard.receiver.online_quant import OnlineBlockFp8, find_block_quantizer
from megatron_reshard.receiver.target_plan import Piece
from megatron_reshard.receiver.targets import VllmTargets


def _layer(e: int, h: int, i: int) -> dict[str, torch.Tensor]:
    params = {"w13_weight": torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn),
              "w2_weight": torch.zeros(e, h, i, dtype=torch.float8_e4m3fn),
              "qkv_proj.weight": torch.zeros(3 * h, h, dtype=torch.float8_e4m3fn)}
    for name in list(params):
        params[name + "_scale_inv"] = torch.zeros(blockwise_scale_shape(params[name].shape))
    return params


def _pieces(e: int, h: int, i: int) -> list[tuple[Piece, Piece]]:
    """(weight piece, scale piece) in arrival order: gate, up, down of all experts; q, k, v."""
    def piece(name: str, box: tuple) -> tuple[Piece, Piece]:
        tiles = tuple(box[:-2]) + tuple((a // 128, -(-b // 128)) for a, b in box[-2:])
        return Piece(name, box, box), Piece(name + "_scale_inv", tiles, tiles)

    return [piece("w13_weight", ((0, e), (0, i), (0, h))),
            piece("w13_weight", ((0, e), (i, 2 * i), (0, h))),
            piece("w2_weight", ((0, e), (0, h), (0, i)))] + \
        [piece("qkv_proj.weight", ((k * h, (k + 1) * h), (0, h))) for k in range(3)]


class _Method:  # stands for the layer's quant method object: its module is vLLM's online one
    weight_block_size = [128, 128]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8  # vLLM's module

    e, h, i = args.experts, args.hidden, args.inter
    _Method.__module__ = online_fp8.__name__
    holder = torch.nn.Module()
    holder.params_dtype = torch.bfloat16
    quantizer, why = find_block_quantizer("layer", holder, _Method(), (128, 128))
    assert quantizer is not None, why
    pieces = _pieces(e, h, i)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn([b - a for a, b in p.target_region], generator=g).bfloat16()
              for p, _ in pieces]
    weights = [n for n in _layer(1, 128, 128) if not n.endswith("_scale_inv")]

    def run(online: bool) -> tuple[float, int]:
        params = _layer(e, h, i)
        quantizers = OnlineBlockFp8({n: quantizer for n in weights}) if online else {}
        targets = VllmTargets.from_named_parameters(params, None, 0, 1, quantizers=quantizers)
        t0 = time.perf_counter()
        if online:
            quantizers.begin()
        for (piece, scale), v in zip(pieces, values):
            quantize_into(targets, piece, scale, v)
        if online:
            quantizers.finish("bench")
        return time.perf_counter() - t0, (quantizers.report()["peak_pending_bytes"] if online else 0)

    run(True), run(False)  # warm-up
    new, old, peak = [], [], 0
    for _ in range(args.repeats):
        t, peak = run(True)
        new.append(t)
        old.append(run(False)[0])
    numel = sum(v.numel() for v in values)
    tiles = sum(torch.Size(blockwise_scale_shape(p.shape)).numel() for p in _layer(e, h, i).values()
                if p.dtype == torch.float8_e4m3fn)
    bf16, fp8 = 2 * numel, numel + 4 * tiles
    t_new, t_old = statistics.median(new), statistics.median(old)
    print(f"layer: {e} experts, hidden {h}, expert intermediate {i}, qkv [{3 * h}, {h}]; "
          f"{numel / 1e6:.1f} M weight elements; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"wire bytes, online layers: BF16 {bf16 / 2**20:.1f} MiB (block_fp8_online) vs FP8 + "
          f"scales {fp8 / 2**20:.1f} MiB (sender-quantized block_fp8): x{bf16 / fp8:.3f}")
    print(f"receiver quantization, vLLM's per_block_cast_to_fp8 per matrix: {t_new * 1e3:.1f} ms "
          f"(median of {args.repeats}: {', '.join(f'{x * 1e3:.1f}' for x in new)})")
    print(f"baseline, fp8.quant per piece (the old receiver path, same run): {t_old * 1e3:.1f} ms "
          f"({', '.join(f'{x * 1e3:.1f}' for x in old)}); ratio x{t_new / t_old:.2f}")
    print(f"peak gathering buffers: {peak / 2**20:.1f} MiB "
          f"({peak / (2 * numel):.2f} of the layer's BF16 weights)")


if __name__ == "__main__":
    main()
