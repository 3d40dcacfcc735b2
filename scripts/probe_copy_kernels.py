"""Which torch copy is fastest for the engine's slow local copies (a diagnostic, one GPU).

    python scripts/probe_copy_kernels.py            # CUDA
    python scripts/probe_copy_kernels.py --small    # CPU smoke

Cases (median of CUDA-event timings, GB/s and share of a contiguous memcpy of the same bytes):

- a rank's experts as a list of tensors -> one stacked destination (and back): a ``copy_``
  per expert, one ``_foreach_copy_`` over uint8 / int64 views, ``torch.stack(out=)``;
- a column block of a row-major tensor (a strided source or destination with a unit last
  stride): element-wise, as int64 words;
- a transposed destination storage: ``copy_`` as is.
"""

from __future__ import annotations

import argparse

import torch

from megatron_reshard.tools.bench.timing import median_timer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    timed = median_timer(device)

    def measure(fn, iters=20, warmup=3):
        return timed(fn, iters, warmup)

    bf16 = torch.bfloat16
    e, r, c = (8, 64, 48) if args.small else (128, 2048, 768)
    n = 1024 if args.small else 16384

    def memcpy_gbps(nbytes):
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        return nbytes / measure(lambda: b.copy_(a)) / 1e9

    def show(name, nbytes, seconds, ref):
        g = nbytes / seconds / 1e9
        print(f"{name:<44} {nbytes / 2**20:8.1f} MiB {1e6 * seconds:9.1f} µs {g:8.1f} GB/s "
              f"{g / ref:6.0%}")

    members = [torch.randn(r, c, device=device).to(bf16) for _ in range(e)]
    stacked = torch.empty(e, r, c, dtype=bf16, device=device)
    nbytes = stacked.numel() * 2
    ref = memcpy_gbps(nbytes)
    print(f"memcpy of {nbytes / 2**20:.0f} MiB: {ref:.1f} GB/s")
    show("experts: copy_ per member", nbytes,
         measure(lambda: [stacked[i].copy_(m) for i, m in enumerate(members)]), ref)
    dst8 = [stacked[i].view(-1).view(torch.uint8) for i in range(e)]
    src8 = [m.view(-1).view(torch.uint8) for m in members]
    show("experts: _foreach_copy_ uint8", nbytes, measure(lambda: torch._foreach_copy_(dst8, src8)), ref)
    dst64 = [x.view(torch.int64) for x in dst8]
    src64 = [x.view(torch.int64) for x in src8]
    show("experts: _foreach_copy_ int64", nbytes, measure(lambda: torch._foreach_copy_(dst64, src64)), ref)
    show("experts: _foreach_copy_ bf16", nbytes,
         measure(lambda: torch._foreach_copy_([stacked[i] for i in range(e)], members)), ref)
    show("experts: torch.stack(out=)", nbytes, measure(lambda: torch.stack(members, out=stacked)), ref)
    flat = stacked.view(e, -1).view(torch.int64)
    show("experts: torch.stack int64 (out=)", nbytes,
         measure(lambda: torch.stack([m.view(-1).view(torch.int64) for m in members], out=flat)), ref)
    back = [torch.empty_like(m) for m in members]
    back64 = [b.view(-1).view(torch.int64) for b in back]
    rows64 = [flat[i] for i in range(e)]
    show("experts back: _foreach_copy_ int64", nbytes, measure(lambda: torch._foreach_copy_(back64, rows64)), ref)
    show("experts back: unbind+copy_ per member", nbytes,
         measure(lambda: [b.copy_(s) for b, s in zip(back, stacked.unbind(0))]), ref)
    del members, stacked, back

    src = torch.randn(n, n, device=device).to(bf16)
    half = n // 2
    nbytes = n * half * 2
    ref = memcpy_gbps(nbytes)
    col = torch.empty(n, half, dtype=bf16, device=device)
    show("column block: element-wise pack", nbytes, measure(lambda: col.copy_(src[:, half:])), ref)
    show("column block: int64 words pack", nbytes,
         measure(lambda: col.view(torch.int64).copy_(src[:, half:].view(torch.int64))), ref)
    big = torch.empty(n, n, dtype=bf16, device=device)
    show("column block: int64 words unpack", nbytes,
         measure(lambda: big[:, half:].view(torch.int64).copy_(col.view(torch.int64))), ref)
    show("column block: 2-D memcpy (as_strided rows)", nbytes,
         measure(lambda: big[:, half:].copy_(col)), ref)
    nbytes = n * n * 2
    ref = memcpy_gbps(nbytes)
    tdst = torch.empty(n, n, dtype=bf16, device=device).t()
    show("transposed destination: copy_", nbytes, measure(lambda: tdst.copy_(src)), ref)
    tdst32 = torch.empty(n, n, dtype=torch.float32, device=device).t()
    src32 = src.float()
    show("transposed destination fp32: copy_", 2 * nbytes, measure(lambda: tdst32.copy_(src32)), ref)


if __name__ == "__main__":
    main()
