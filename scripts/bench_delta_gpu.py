"""What cutting and applying a delta costs on one GPU (issue 35), against a device memcpy.

    python scripts/bench_delta_gpu.py [--mib 1024] [--iters 10]

Torch only (Triton from the CUDA build of torch). For each change rate (default 0.1%, 1%,
1.8% measured by ``scripts/measure_change_rate.py``, 5%, 30%): a bf16 region of ``--mib``
MiB (``old``) and ``new`` with that fraction of its elements changed (one bit flipped, at
random places). Timed, median of ``--iters`` with the device synchronised (a cut includes
its one host read of the count):

- ``cut``: ``delta.encoding.encode(new, old)`` (on CUDA: ``delta.kernels.cut``,
  whose scan of the region, the payload it writes before its one host read where the
  device's choice allows, and that read are also timed alone as ``find``; its one kernel
  over the region, ``cut_mark``, alone as ``scan``; the second pass, ``Cut.payload``,
  alone as ``write``: the path of a payload not written before the read), and the torch
  path (``MEGATRON_RESHARD_DELTA_KERNELS=0``);
- ``apply``: ``apply`` of that payload into a contiguous copy of ``old`` and into a column
  block (half the columns of a [rows, 2 x cols] tensor), and the torch path's apply;
- ``memcpy``: ``dst.copy_(src)`` of the region's bytes;
- with ``--regions K,...``: the same bytes as K regions (row blocks) of one batch, as the
  delta mover takes them: ``encode_many`` (one host read per group of regions) and
  ``apply_many`` (one host read after all the launches), timed whole, and the same K
  regions one at a time (``encode`` / ``apply`` each, a host read each: the mover before).

GB/s are of the region scanned (its bytes / time). ``cut+apply``: the region over the sum
of both times. The last columns give the parts in µs: ``cut``, ``scan``, ``find``, ``write``
(the second pass from one ``Cut``), ``apply`` (contiguous). Each payload is checked byte
for byte against the torch path's, and each apply bit for bit against ``new``. The GPU's
clock varies between runs (cut + apply ±10%): compare figures of one run, or several.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

RATES = (0.001, 0.01, 0.018, 0.05, 0.30)


def _median_s(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _torch_path(fn):
    os.environ["MEGATRON_RESHARD_DELTA_KERNELS"] = "0"
    try:
        return fn()
    finally:
        del os.environ["MEGATRON_RESHARD_DELTA_KERNELS"]


def _scan_alone(delta_kernels, new, old):
    """A launch of the cut's region scan alone (``cut_mark``), its batch's table and scratch
    made once: the bound the rest of the cut adds to."""
    a, b = new.view(torch.int16).reshape(-1), old.view(torch.int16).reshape(-1)
    totals = torch.empty(1, 6, dtype=torch.int64, device=a.device)
    return delta_kernels._Batch([(0, a, b)], delta_kernels._pack(a, b), 4, totals).mark


def main(argv=None) -> int:
    from megatron_reshard.delta.encoding import apply, apply_many, encode, encode_many
    from megatron_reshard.delta.wire_format import encoding_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--torch-iters", type=int, default=3)
    ap.add_argument("--rates", default=",".join(map(str, RATES)))
    ap.add_argument("--block", type=int, default=0, help="elements per program (0: default)")
    ap.add_argument("--warps", type=int, default=0, help="warps per program (0: default)")
    ap.add_argument("--chunk", type=int, default=0, help="index entries per program of the "
                    "apply (0: default)")
    ap.add_argument("--apply-warps", type=int, default=0, help="warps per program of the "
                    "apply (0: default)")
    ap.add_argument("--slot-entries", type=int, default=0, help="slot entries per step of a "
                    "slot_write program (0: default)")
    ap.add_argument("--slot-sub", type=int, default=0, help="of each block's slot a step (0: default)")
    ap.add_argument("--slot-warps", type=int, default=0, help="warps per slot_write program "
                    "(0: default)")
    ap.add_argument("--no-torch", action="store_true", help="skip timing the torch path")
    ap.add_argument("--regions", default="", help="also time the region as K regions of one "
                    "batch, for each K of this comma list")
    args = ap.parse_args(argv)
    from megatron_reshard.delta import kernel_apply
    from megatron_reshard.delta import kernels as delta_kernels

    if args.block:
        delta_kernels.BLOCK = args.block
    if args.warps:
        delta_kernels.WARPS = args.warps
    if args.chunk:
        kernel_apply.CHUNK = args.chunk
    if args.apply_warps:
        kernel_apply.APPLY_WARPS = args.apply_warps
    for flag, name in ((args.slot_entries, "SLOT_ENTRIES"), (args.slot_sub, "SLOT_SUB"),
                       (args.slot_warps, "SLOT_WARPS")):
        if flag:
            setattr(delta_kernels, name, flag)
    dev = torch.device("cuda")
    cols = 4096
    rows = args.mib * 2**20 // 2 // cols
    n, nbytes = rows * cols, rows * cols * 2
    g = torch.Generator(device=dev).manual_seed(0)
    old = torch.randint(-2**15, 2**15, (rows, cols), dtype=torch.int16, device=dev,
                        generator=g).view(torch.bfloat16)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    memcpy_s = _median_s(lambda: dst.copy_(src), args.iters)
    flat = old.clone()
    wide = torch.empty(rows, 2 * cols, dtype=torch.bfloat16, device=dev)
    block = wide[:, cols // 2: cols // 2 + cols]
    out = []
    for rate in (float(r) for r in args.rates.split(",")):
        new = old.clone()
        pick = torch.rand((rows, cols), device=dev, generator=g) < rate
        new.view(torch.int16)[pick] ^= 1
        del pick
        count, enc, payload = encode(new, old)
        t_count, t_enc, t_payload = _torch_path(lambda: encode(new, old))
        same_payload = (count, enc) == (t_count, t_enc) and (
            payload is None if t_payload is None else torch.equal(payload, t_payload))
        del t_payload
        cut_s = _median_s(lambda: encode(new, old), args.iters)
        find_s = _median_s(lambda: delta_kernels.cut(new, old), args.iters)
        scan_s = _median_s(_scan_alone(delta_kernels, new, old), args.iters)
        write_s = 0.0
        if count and enc & 7 != 3:  # not DENSE: the payload written from one cut
            cut = delta_kernels.cut(new, old)
            index = {1: "positions", 2: "bitmask", 4: "gaps"}[enc & 7]
            write_s = _median_s(lambda: cut.payload(index, bool(enc & 8)), args.iters)
            del cut
        cut_torch_s = float("inf") if args.no_torch else _torch_path(
            lambda: _median_s(lambda: encode(new, old), args.torch_iters))
        exact = same_payload
        timings = {}
        for name, view in (("contiguous", flat), ("column block", block)):
            view.copy_(old)
            apply(view, count, enc, payload)
            exact &= torch.equal(view.view(torch.int16), new.view(torch.int16))
            timings[name] = _median_s(lambda: apply(view, count, enc, payload), args.iters)
        view = flat
        view.copy_(old)
        _torch_path(lambda: apply(view, count, enc, payload))
        exact &= torch.equal(view.view(torch.int16), new.view(torch.int16))
        apply_torch_s = float("inf") if args.no_torch else _torch_path(
            lambda: _median_s(lambda: apply(view, count, enc, payload), args.torch_iters))
        gb = nbytes / 1e9
        batched = {}
        for k in (int(x) for x in args.regions.split(",") if x):
            pairs = list(zip(new.chunk(k), old.chunk(k)))
            cuts = encode_many(pairs)
            views = list(flat.chunk(k))
            flat.copy_(old)
            apply_many([(v, *c) for v, c in zip(views, cuts)])
            exact &= torch.equal(flat.view(torch.int16), new.view(torch.int16))
            exact &= all(c[:2] == encode(n, o)[:2] for c, (n, o) in zip(cuts, pairs))
            many_cut_s = _median_s(lambda: encode_many(pairs), args.iters)
            many_apply_s = _median_s(lambda: apply_many([(v, *c) for v, c in zip(views, cuts)]),
                                     args.iters)
            one_cut_s = _median_s(lambda: [encode(n, o) for n, o in pairs], args.iters)
            one_apply_s = _median_s(lambda: [apply(v, *c) for v, c in zip(views, cuts)],
                                    args.iters)
            batched[k] = (many_cut_s, many_apply_s, one_cut_s, one_apply_s)
            del cuts, pairs
        out.append({"rate": rate, "changed": count, "encoding": encoding_name(enc),
                    "payload_mib": 0 if payload is None else payload.numel() / 2**20,
                    "cut_gbps": gb / cut_s, "find_gbps": gb / find_s, "scan_gbps": gb / scan_s,
                    "cut_us": 1e6 * cut_s, "scan_us": 1e6 * scan_s, "find_us": 1e6 * find_s,
                    "write_us": 1e6 * write_s, "apply_us": 1e6 * timings["contiguous"],
                    "cut_torch_gbps": gb / cut_torch_s,
                    "apply_gbps": gb / timings["contiguous"],
                    "apply_block_gbps": gb / timings["column block"],
                    "apply_torch_gbps": gb / apply_torch_s,
                    "cut_apply_gbps": gb / (cut_s + timings["contiguous"]),
                    "memcpy_gbps": gb / memcpy_s, "bit_exact": bool(exact),
                    "batched": {k: {"cut_us": 1e6 * c, "apply_us": 1e6 * a,
                                    "cut_apply_of_memcpy": memcpy_s / (c + a),
                                    "one_at_a_time_cut_us": 1e6 * c1,
                                    "one_at_a_time_apply_us": 1e6 * a1,
                                    "one_at_a_time_of_memcpy": memcpy_s / (c1 + a1)}
                                for k, (c, a, c1, a1) in batched.items()}})
        del new, payload
    print(f"delta cut / apply on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"region {args.mib} MiB bf16 [{rows}, {cols}], median of {args.iters} "
          f"(torch path: {args.torch_iters}); memcpy {gb / memcpy_s:.0f} GB/s; "
          f"cut: {delta_kernels.BLOCK} elements, {delta_kernels.WARPS} warps a program; apply: "
          f"{kernel_apply.CHUNK} entries, {kernel_apply.APPLY_WARPS} warps; slots: "
          f"{delta_kernels.SLOT_ENTRIES} entries ({delta_kernels.SLOT_SUB} a block), "
          f"{delta_kernels.SLOT_WARPS} warps")
    print(f"{'rate':>6} {'encoding':14} {'payload MiB':>11} {'cut GB/s':>9} {'cut/mc':>7} {'scan/mc':>7} {'find/mc':>7} "
          f"{'apply GB/s':>10} {'apply/mc':>8} {'block/mc':>8} {'cut+apply/mc':>12} "
          f"{'torch cut/mc':>12} {'torch apply/mc':>14} exact   "
          f"µs: {'cut':>6} {'scan':>6} {'find':>6} {'write':>6} {'apply':>6}")
    for r in out:
        mc = r["memcpy_gbps"]
        print(f"{100 * r['rate']:5.1f}% {r['encoding']:14} {r['payload_mib']:11.1f} "
              f"{r['cut_gbps']:9.0f} {100 * r['cut_gbps'] / mc:6.0f}% {100 * r['scan_gbps'] / mc:6.0f}% {100 * r['find_gbps'] / mc:6.0f}% "
              f"{r['apply_gbps']:10.0f} "
              f"{100 * r['apply_gbps'] / mc:7.0f}% {100 * r['apply_block_gbps'] / mc:7.0f}% "
              f"{100 * r['cut_apply_gbps'] / mc:11.0f}% {100 * r['cut_torch_gbps'] / mc:11.0f}% "
              f"{100 * r['apply_torch_gbps'] / mc:13.0f}% {str(r['bit_exact']):5}       "
              f"{r['cut_us']:6.0f} {r['scan_us']:6.0f} {r['find_us']:6.0f} {r['write_us']:6.0f} "
              f"{r['apply_us']:6.0f}")
    if args.regions:
        print("as K regions of one batch: µs cut, apply, cut+apply/mc grouped (encode_many / "
              "apply_many) | one at a time (encode / apply)")
        for r in out:
            cells = "  ".join(f"K={k}: {b['cut_us']:6.0f} {b['apply_us']:6.0f} "
                              f"{100 * b['cut_apply_of_memcpy']:3.0f}% | "
                              f"{b['one_at_a_time_cut_us']:6.0f} {b['one_at_a_time_apply_us']:6.0f} "
                              f"{100 * b['one_at_a_time_of_memcpy']:3.0f}%"
                              for k, b in r["batched"].items())
            print(f"{100 * r['rate']:5.1f}%  {cells}")
    print(json.dumps(out))
    return 0 if all(r["bit_exact"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
