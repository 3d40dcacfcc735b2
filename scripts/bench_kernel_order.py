"""What writing through a GPU kernel's expert order costs (issue 34), against a plain write.

    # 1. on a machine with the vLLM test venv: learn the orders with vLLM's own code
    .venv-vllm/bin/python scripts/bench_kernel_order.py learn --out orders.pt
    # 2. on a GPU (torch only): time the writes
    python scripts/bench_kernel_order.py bench --orders orders.pt
    # or the permuted-row kernel's tile shapes on a colocated refit's per-expert writes
    python scripts/bench_kernel_order.py sweep --orders orders.pt

``learn`` builds one Qwen3-30B-A3B MoE layer (128 experts, hidden 2048, expert
intermediate 768: one generation rank at TP1) in vLLM 0.33 on the CPU with
``--moe-backend flashinfer_cutlass`` and then ``flashinfer_trtllm`` (vLLM's allocation and
post-load conversion, the CPU shims of ``testing/vllm_models.py``) and saves the
``KernelOrder`` the receiver learns for ``w13_weight`` / ``w2_weight``
(``receiver.kernel_layouts.storage_orders``).

``bench`` times, per backend and tensor, what a refit does with one received box per
HF projection (w13: the gate rows, then the up rows; w2: the whole tensor), all experts,
all measured in the same run (median of ``--iters``):

- ``checkpoint``: the write in checkpoint order, through the engine's copy kernels
  (``engine.kernel_copies.KernelCopies`` of the storage's view), and as torch's ``copy_``;
- ``through the order``: the write straight into the learned order, built once as a
  refit's copy batch is: the copy kernels of the strided view where the order keeps one
  (CUTLASS), else the permuted-row kernel (``PermutedTable``: TRTLLM), no staging buffer;
- ``scatter``: ``KernelOrder.scatter`` of a received box (host index math each call);
- a plain memcpy of the same bytes.

Results are checked bit for bit: the written storage read back through the order equals
the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

E, H, I = 128, 2048, 768
BACKENDS = ("flashinfer_cutlass", "flashinfer_trtllm")


def learn(out: str) -> int:
    from megatron_reshard.receiver.kernel_layouts import storage_orders
    from megatron_reshard.testing import vllm_models as vm
    from megatron_reshard.tools.worlds import free_ports

    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          "hidden_size": H, "intermediate_size": 6144, "moe_intermediate_size": I,
          "num_experts": E, "num_experts_per_tok": 8, "num_hidden_layers": 1,
          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
          "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
          "rope_theta": 1e6, "norm_topk_prob": True, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    saved = {}
    for backend in BACKENDS:
        t0 = time.perf_counter()
        config = vm.vllm_config_for(vm.write_model_dir(hf), 1, moe_backend=backend)
        with vm.vllm_parallel_state(config, 0, 1, free_ports(1)[0]):
            model = vm.dummy_loaded_model(config)
            orders = storage_orders(model)
            params = dict(model.named_parameters())
        for name, order in orders.items():
            leaf = name.rsplit(".", 1)[1]
            saved[f"{backend}/{leaf}"] = {"backend": order.backend, "terms": list(order.terms),
                                          "shape": list(params[name].shape)}
        print(f"{backend}: {sorted(orders)} learned in {time.perf_counter() - t0:.1f} s", flush=True)
        del model, params
    torch.save(saved, out)
    return 0


def _median_s(fn, iters: int, device) -> float:
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def bench(orders_file: str, iters: int, device: torch.device) -> int:
    from megatron_reshard.engine.kernel_copies import KernelCopies, permuted_tables
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    saved = torch.load(orders_file, weights_only=False)
    rows = []
    for key, item in sorted(saved.items()):
        order = KernelOrder(item["backend"], tuple(t.to(device) for t in item["terms"])).to(device)
        shape = tuple(item["shape"])
        leaf = key.split("/")[1]
        storage = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        plain = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        # the boxes a refit writes: w13 per projection (gate rows, up rows), w2 whole
        rows_ckpt = order.shape[1]
        inter = I if leaf == "w13_weight" else None
        boxes = ([((0, E), (0, inter), (0, shape[2])), ((0, E), (inter, 2 * inter), (0, shape[2]))]
                 if leaf == "w13_weight" else [((0, E), (0, shape[1]), (0, I))])
        values = [torch.randn([b - a for a, b in box], device=device).to(torch.bfloat16)
                  for box in boxes]
        nbytes = sum(v.numel() * v.element_size() for v in values)

        views = [order.view(storage, box) for box in boxes]
        pairs, permuted = [], []
        for box, view, v in zip(boxes, views, values):
            if view is not None:
                pairs.append((view, v))
            else:
                permuted.append((order.permuted_rows(storage, box), v))
        direct = KernelCopies(pairs, device)
        tables, rest = permuted_tables(permuted, device)
        assert not rest and not direct.rest, "a box the kernels do not take"

        def through_order():
            direct.run()
            for table in tables:
                table.run()

        def scatter():
            for box, v in zip(boxes, values):
                order.scatter(storage, box, v)

        ckpt_kernels = KernelCopies([(plain[tuple(slice(a, b) for a, b in box)], v)
                                     for box, v in zip(boxes, values)], device)

        def checkpoint_torch():
            for box, v in zip(boxes, values):
                plain[tuple(slice(a, b) for a, b in box)].copy_(v)

        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        scatter_s = _median_s(scatter, iters, device)
        through_s = _median_s(through_order, iters, device)
        ckpt_s = _median_s(ckpt_kernels.run, iters, device)
        ckpt_torch_s = _median_s(checkpoint_torch, iters, device)
        memcpy_s = _median_s(lambda: dst.copy_(src), iters, device)
        # bit for bit: each element read back where the order put it
        exact = True
        for box, v in zip(boxes, values):
            idx = [order.terms[d][a:b] for d, (a, b) in enumerate(box)]
            flat = (idx[0].view(-1, 1, 1) + idx[1].view(1, -1, 1) + idx[2].view(1, 1, -1))
            exact &= torch.equal(storage.view(-1)[flat.view(-1)].view(v.shape), v)
        # the scatter's result too (it ran first; the direct writes rewrote the same bytes)
        storage.zero_()
        scatter()
        for box, v in zip(boxes, values):
            idx = [order.terms[d][a:b] for d, (a, b) in enumerate(box)]
            flat = (idx[0].view(-1, 1, 1) + idx[1].view(1, -1, 1) + idx[2].view(1, 1, -1))
            exact &= torch.equal(storage.view(-1)[flat.view(-1)].view(v.shape), v)
        gb = nbytes / 1e9
        rows.append({"backend": item["backend"], "tensor": leaf, "shape": list(shape),
                     "padded_rows": rows_ckpt, "mib": nbytes / 2**20,
                     "written_as": "strided views" if not permuted else "permuted rows",
                     "through_order_gbps": gb / through_s, "checkpoint_order_gbps": gb / ckpt_s,
                     "checkpoint_torch_gbps": gb / ckpt_torch_s, "scatter_gbps": gb / scatter_s,
                     "memcpy_gbps": gb / memcpy_s, "through_vs_checkpoint": ckpt_s / through_s,
                     "through_vs_memcpy": memcpy_s / through_s, "bit_exact": bool(exact)})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"writes through the learned expert orders, {name}, torch {torch.__version__}, median of {iters}")
    print(f"{'backend':20} {'tensor':10} {'MiB':>5} {'written as':14} {'order GB/s':>10} {'ckpt GB/s':>9} "
          f"{'ckpt torch':>10} {'scatter':>8} {'memcpy':>7} {'order/ckpt':>10} {'order/memcpy':>12} exact")
    for r in rows:
        print(f"{r['backend']:20} {r['tensor']:10} {r['mib']:5.0f} {r['written_as']:14} "
              f"{r['through_order_gbps']:10.1f} {r['checkpoint_order_gbps']:9.1f} "
              f"{r['checkpoint_torch_gbps']:10.1f} {r['scatter_gbps']:8.1f} {r['memcpy_gbps']:7.1f} "
              f"{100 * r['through_vs_checkpoint']:9.0f}% {100 * r['through_vs_memcpy']:11.0f}% {r['bit_exact']}")
    print(json.dumps(rows))
    return 0 if all(r["bit_exact"] for r in rows) else 1


def sweep(orders_file: str, iters: int, device: torch.device) -> int:
    """The permuted-row kernel's tile shapes (rows per tile, bytes per tile, warps) on
    the writes a colocated refit issues for one TRTLLM layer: per expert, w13's gate and
    up rows and w2, each from its own source tensor (the training rank's experts);
    checkpoint order: the same pairs into contiguous expert slices (``BlockTable``).
    Every configuration bit-checked; median of ``iters``, same run, against a memcpy."""
    from megatron_reshard.engine.kernel_copies import BlockTable, KernelCopies, PermutedTable
    from megatron_reshard.engine.kernel_copies import permuted_tables
    from megatron_reshard.vllm_layout.kernel_order import KernelOrder

    saved = torch.load(orders_file, weights_only=False)
    order_pairs, ckpt_pairs, checks, plains = [], [], [], []
    for leaf in ("w13_weight", "w2_weight"):
        item = saved[f"flashinfer_trtllm/{leaf}"]
        order = KernelOrder(item["backend"], tuple(item["terms"])).to(device)
        shape = tuple(item["shape"])
        storage = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        plain = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        plains.append(plain)
        boxes = ([((0, E), (0, I), (0, H)), ((0, E), (I, 2 * I), (0, H))]
                 if leaf == "w13_weight" else [((0, E), (0, H), (0, I))])
        for box in boxes:
            rows = order.permuted_rows(storage, box)
            srcs = [torch.randn([b - a for a, b in box[1:]], device=device).to(torch.bfloat16)
                    for _ in range(E)]
            order_pairs += list(zip(rows.unbind(0), srcs))
            (r0, r1), (c0, c1) = box[1], box[2]
            ckpt_pairs += [(plain[e, r0:r1, c0:c1], s) for e, s in enumerate(srcs)]
            checks.append((order, storage, box, torch.stack(srcs)))
    nbytes = sum(s.numel() * s.element_size() for _, s in order_pairs)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    memcpy_s = _median_s(lambda: dst.copy_(src), iters, device)

    def order_exact() -> bool:
        ok = True
        for order, storage, box, values in checks:
            idx = [order.terms[d][a:b] for d, (a, b) in enumerate(box)]
            flat = (idx[0].view(-1, 1, 1) + idx[1].view(1, -1, 1) + idx[2].view(1, 1, -1))
            ok &= torch.equal(storage.view(-1)[flat.view(-1)].view(values.shape), values)
        return bool(ok)

    def ckpt_exact() -> bool:
        return all(torch.equal(d, s) for d, s in ckpt_pairs)

    def timed(fn, check) -> tuple:
        for x in [c[1] for c in checks] + plains:
            x.zero_()
        s = _median_s(fn, iters, device)
        return s, check()

    def set_attrs(cls, **kw) -> dict:
        old = {k: getattr(cls, k) for k in kw}
        for k, v in kw.items():
            setattr(cls, k, v)
        return old

    print(f"sweep, {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"{nbytes / 2**20:.0f} MiB, memcpy {nbytes / memcpy_s / 1e9:.0f} GB/s, median of {iters}")
    results = []
    kernels = KernelCopies(ckpt_pairs, device)
    assert not kernels.rest and [type(t) for t in kernels.tables] == [BlockTable]
    t, ok = timed(kernels.run, ckpt_exact)
    results.append(("checkpoint order: BlockTable", {}, t, ok))
    permuted_configs = [dict(ROWS=r, TILE_BYTES=k << 10, WARPS=w)
                        for k, r, w in ((32, 8, 4), (32, 16, 4), (32, 32, 4), (32, 64, 4),
                                        (16, 8, 4), (16, 16, 4), (16, 32, 4), (16, 64, 4),
                                        (8, 8, 4), (8, 16, 4), (8, 32, 4), (16, 32, 2),
                                        (16, 32, 8))]
    for cfg in permuted_configs:
        old = set_attrs(PermutedTable, **cfg)
        tables, rest = permuted_tables(order_pairs, device)
        assert not rest
        set_attrs(PermutedTable, **old)

        def run(tables=tables):
            for table in tables:
                table.run()
        t, ok = timed(run, order_exact)
        shape = ", ".join(f"{tb.br}x{tb.nb}" for tb in tables)
        results.append((f"TRTLLM PermutedTable ({shape})", cfg, t, ok))
    ckpt_best = results[0][2]
    for name, cfg, t, ok in results:
        print(f"{name:44} {cfg}  {nbytes / t / 1e9:7.0f} GB/s  {memcpy_s / t:6.1%} of memcpy"
              f"  {ckpt_best / t:6.1%} of checkpoint order  exact={ok}")
    return 0 if all(ok for *_, ok in results) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("learn")
    a.add_argument("--out", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--orders", required=True)
    b.add_argument("--iters", type=int, default=10)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--tile-kib", type=int, default=0, help="the permuted-row kernel's bytes "
                   "per program (0: its default)")
    b.add_argument("--warps", type=int, default=0, help="its warps per program (0: default)")
    b.add_argument("--rows", type=int, default=0, help="its rows per tile (0: default)")
    c = sub.add_parser("sweep", help="tile shapes of the permuted-row kernel")
    c.add_argument("--orders", required=True)
    c.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if args.cmd == "learn":
        return learn(args.out)
    if args.cmd == "sweep":
        return sweep(args.orders, args.iters, torch.device("cuda"))
    from megatron_reshard.engine.kernel_copies import PermutedTable

    if args.tile_kib:
        PermutedTable.TILE_BYTES = args.tile_kib << 10
    if args.warps:
        PermutedTable.WARPS = args.warps
    if args.rows:
        PermutedTable.ROWS = args.rows
    print(f"permuted-row kernel: {PermutedTable.TILE_BYTES >> 10} KiB a program, "
          f"{PermutedTable.ROWS} rows a tile, {PermutedTable.WARPS} warps")
    return bench(args.orders, args.iters, torch.device(args.device))


if __name__ == "__main__":
    sys.exit(main())
