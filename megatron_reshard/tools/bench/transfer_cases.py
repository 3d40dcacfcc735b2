"""The transfer benchmark's layouts as data: one ``Case`` per table row, each a list of
``ParamSpec`` (global shape, dtype, placements on the 1-D source and destination meshes).
The layouts themselves are described in ``transfer_main``'s docstring.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
BF16, FP32 = torch.bfloat16, torch.float32


@dataclass(frozen=True)
class ParamSpec:
    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    src: tuple  # placements on the 1-D source mesh
    dst: tuple  # placements on the 1-D destination mesh

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Case:
    name: str
    layout: str
    params: tuple[ParamSpec, ...]
    dst_on: str = "dst"  # "dst": the destination ranks; "all": every rank (colocated)
    src_on: str = "src"  # "src": the source ranks; "all": every rank


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _pl(p) -> str:
    return f"S({p.dim})" if isinstance(p, Shard) else "R"


def _one(name: str, shape: Sequence[int], src, dst, dtype=BF16, dst_on: str = "dst",
         note: str = "", src_on: str = "src") -> Case:
    shape = tuple(shape)
    dt = {BF16: "bf16", FP32: "fp32"}.get(dtype, str(dtype))
    layout = f"{list(shape)} {dt} {_pl(src)}→{_pl(dst)}{note}"
    return Case(name, layout, (ParamSpec(name, shape, dtype, (src,), (dst,)),),
                dst_on, src_on)


def _mixed_params(count: int, dims: Sequence[int], experts: Sequence[int]) -> tuple[ParamSpec, ...]:
    rng = random.Random(1234)
    out = []
    for i in range(count):
        kind = i % 7
        a, b = rng.choice(dims), rng.choice(dims)
        if kind == 0:
            out.append(ParamSpec(f"p{i}.norm", (a,), FP32, (R,), (R,)))
        elif kind == 1:
            out.append(ParamSpec(f"p{i}.col", (a, b), BF16, (S0,), (S0,)))
        elif kind == 2:
            out.append(ParamSpec(f"p{i}.row", (a, b), BF16, (S1,), (S1,)))
        elif kind == 3:
            out.append(ParamSpec(f"p{i}.swap", (a, b), BF16, (S0,), (S1,)))
        elif kind == 4:
            out.append(ParamSpec(f"p{i}.rep_to_shard", (a, b), BF16, (R,), (S0,)))
        elif kind == 5:
            out.append(ParamSpec(f"p{i}.bias", (a,), BF16, (S0,), (R,)))
        else:
            out.append(ParamSpec(f"p{i}.experts", (rng.choice(experts), a, b), BF16,
                                 (S0,), (S1,)))
    return tuple(out)


def parse_size(text: str) -> int:
    """'64M', '1G', '512MiB', '4096' → bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _size_label(nbytes: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def build_cases(small: bool, world_size: int, sizes: Sequence[int] = ()) -> list[Case]:
    """The benchmark's layouts (see module docstring); ``small`` for CPU smoke runs."""
    k = 32 if small else 1  # shrink factor for the big dims
    cases = [
        _one("s0_s1", (16384 // k, 16384 // k), S0, S1),
        _one("colocated_s0_s1", (16384 // k, 16384 // k), S0, S1, src_on="all", dst_on="all",
             note=" (every rank on both sides)"),
    ]
    if world_size >= 4:
        cases.append(_one("tp2_tp4", (8192 // k, 8192 // k), S0, S0, dst_on="all",
                          note=" (TP2→TP4 on all ranks)"))
    cases += [
        _one("dense_s0_s0", (12288 // k, 4096 // k), S0, S0),
        _one("experts_s0_s1", (128 // (8 if small else 1), 768 // k, 2048 // k), S0, S1),
        _one("experts_s0_s2", (128 // (8 if small else 1), 2048 // k, 768 // k), S0, S2),
        _one("rep_s0", (16384 // k, 8192 // k), R, S0),
        _one("s0_dp2", (16384 // k, 8192 // k), S0, R, note=" (full replica per dst)"),
    ]
    n_small = 200
    shape_small = (4096 // (16 if small else 1),)
    cases.append(Case("small_200", f"{n_small}×{list(shape_small)} bf16 R→R, one batch",
                      tuple(ParamSpec(f"small{i}", shape_small, BF16, (R,), (R,))
                            for i in range(n_small))))
    n_mixed = 200 if small else 1000
    dims = (8, 16, 32) if small else (64, 128, 256, 512)
    cases.append(Case(f"mixed_{n_mixed}", f"{n_mixed} mixed small params, one batch",
                      _mixed_params(n_mixed, dims, (4, 8))))
    for nbytes in sizes:
        side = max(64, int(math.isqrt(nbytes // 2)) // 64 * 64)
        cases.append(_one(f"sweep_{_size_label(nbytes)}", (side, side), S0, S1))
    return cases
