"""vLLM's online block FP8 (``--quantization fp8_per_block``): the bytes come from vLLM's own function.

Torch + stdlib only. vLLM loads such a layer's BF16 weights and quantizes them itself in
``process_weights_after_loading`` with ``per_block_cast_to_fp8(w, block_size=[128, 128],
use_ue8m0=False)``: once per linear weight (the rank's fused weight), once per expert of
``w13_weight`` and of ``w2_weight``. What the layer holds is that function's result on
that device, not a format: on an H200 the trainer's own quantizer (``fp8.quant``, the same
torch expressions operand for operand) gave one element of 2,097,152 one step apart
(docs/DESIGN.md, "FP8 generation"). So the refit sends these weights in BF16
(``gen_quant="block_fp8_online"`` on the trainer) and the receiver calls vLLM's function,
found through the live quant method's module and looked up at each call (whatever vLLM's
loader would call), on the generation device, from the values vLLM's loader would hold
(cast to the layer's ``params_dtype``), per expert, into the FP8 storage and its scales.

The receiver gets a rank's part of such a weight piece by piece (q, k and v of a fused
weight; gate and up of ``w13``; one HF param each, in the engine's batches).
``OnlineBlockFp8`` gathers the BF16 values of each matrix vLLM quantizes (a linear
weight; one expert of ``w13`` / ``w2``) in a buffer of that matrix, and calls vLLM's
function on the whole matrix once its last piece arrives: the same call vLLM makes, on
the same values, so the same bytes, whatever its numerics on this device. At
``prepare_refit`` the plans must cover each such matrix exactly (``check_coverage``); after
each receive no matrix may be left incomplete (``finish``). The buffers held at once are
reported (``report()["peak_pending_bytes"]``): at most about one layer's BF16 weights of
the online layers, as the payload is ordered by layer.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from megatron_reshard.groups.faults import RefitError
from megatron_reshard.receiver.target_plan import Piece, TargetError

VLLM_BLOCK_QUANTIZER = "per_block_cast_to_fp8"  # vllm.utils.deep_gemm's, imported by online/fp8.py
ONLINE_GEN_QUANT = "block_fp8_online"  # the trainer's setting (fp8.plan.plan_block_fp8_online)
# one line, in every refusal: why the sender's quantization is not taken for these layers
GPU_FINDING = ("on an H200 the trainer's own block quantizer (the same torch expressions) "
               "gave one element of 2,097,152 of an expert's w2 one FP8 step away from "
               "vLLM's per_block_cast_to_fp8, silently")


@dataclass(frozen=True)
class VllmBlockQuantizer:
    """vLLM's ``per_block_cast_to_fp8`` as one online layer calls it."""

    layer: str
    module: Any  # the Python module of the layer's quant method (it imports the function)
    block_size: tuple[int, int]
    dtype: torch.dtype  # the dtype vLLM's loader holds the layer's weights in before quantizing

    def write(self, values: torch.Tensor, dst: torch.Tensor, scales: torch.Tensor) -> None:
        """Quantize ``values`` (``[..., N, K]``, the HF values of the FP8 box ``dst``) into
        ``dst`` and its scale box ``scales``: vLLM's function once per ``[N, K]`` matrix (per
        expert), as its ``process_weights_after_loading`` calls it."""
        fn = getattr(self.module, VLLM_BLOCK_QUANTIZER)  # at each call: a patched one too
        x = values.reshape(dst.shape).to(self.dtype)
        for lead in itertools.product(*(range(n) for n in dst.shape[:-2])):
            q, s = fn(x[lead], block_size=list(self.block_size), use_ue8m0=False)
            dst[lead].copy_(q)
            scales[lead].copy_(s.reshape(scales[lead].shape))


def find_block_quantizer(name: str, module: torch.nn.Module, method: Any,
                         tile: tuple[int, int]) -> tuple[Optional[VllmBlockQuantizer], str]:
    """vLLM's quantizer of an online block-FP8 layer, or None and why it was not found."""
    owner = sys.modules.get(type(method).__module__)
    if not callable(getattr(owner, VLLM_BLOCK_QUANTIZER, None)):
        return None, (f"vLLM's {VLLM_BLOCK_QUANTIZER} was not found in "
                      f"{type(method).__module__}, where vLLM 0.25-0.34 import it")
    block = getattr(method, "weight_block_size", None)
    if block is None or tuple(int(b) for b in block) != tuple(tile):
        return None, f"its weight_block_size is {block}, expected {list(tile)}"
    dtype = getattr(module, "params_dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None, (f"the layer's params_dtype (the dtype vLLM loads its weights in before "
                      f"quantizing) is {dtype!r}, expected a floating-point torch dtype")
    return VllmBlockQuantizer(name, owner, tuple(tile), dtype), ""


class OnlineQuantError(RefitError):
    """A matrix of an online block-FP8 layer was left incomplete by a refit."""


class OnlineBlockFp8:
    """The online block-FP8 targets of one session, by FP8 param name, and the BF16 matrices
    being gathered for vLLM's function (see the module doc)."""

    def __init__(self, quantizers: Mapping[str, VllmBlockQuantizer]):
        self.quantizers = dict(quantizers)
        self._pending: dict[tuple, list] = {}  # (param, expert or None) -> [buffer, elements]
        self.stats = {"matrices": 0, "quantize_s": 0.0, "pending_bytes": 0,
                      "peak_pending_bytes": 0}

    def __contains__(self, target: str) -> bool:
        return target in self.quantizers

    def __bool__(self) -> bool:
        return bool(self.quantizers)

    @staticmethod
    def _matrices(shape: Sequence[int], box: Sequence[tuple[int, int]]) -> list[tuple]:
        """(matrix key suffix, the box's part in that matrix's [N, K] coordinates, the part's
        index into the box) for each matrix vLLM quantizes that ``box`` touches."""
        if len(shape) == 2:
            return [(None, tuple(box), ())]
        (e0, e1), rows, cols = box
        return [(e, (rows, cols), (e - e0,)) for e in range(e0, e1)]

    def check_coverage(self, params: Mapping[str, torch.Tensor], plans: Iterable[Any],
                       where: str) -> None:
        """Every matrix of an online param that the plans write at all, written exactly once
        (else its last piece would never come, or come twice). Raises ``TargetError``."""
        covered: dict[tuple, int] = {}
        for plan in plans:
            for piece in plan.pieces:
                if piece.target in self.quantizers:
                    shape = params[piece.target].shape
                    for e, (rows, cols), _ in self._matrices(shape, piece.target_region):
                        n = (rows[1] - rows[0]) * (cols[1] - cols[0])
                        covered[(piece.target, e)] = covered.get((piece.target, e), 0) + n
        for (target, e), n in sorted(covered.items(), key=str):
            want = math.prod(params[target].shape[-2:])
            if n != want:
                which = f"{target!r}" + ("" if e is None else f" expert {e}")
                raise TargetError(f"{which} on {where}: vLLM quantizes it online as one "
                                  f"{list(params[target].shape[-2:])} matrix, so the refit "
                                  f"gathers all of it before calling vLLM's "
                                  f"{VLLM_BLOCK_QUANTIZER}; expected {want} elements written "
                                  f"once, found {n} in the payload's plan")

    def begin(self) -> None:
        """A refit starts: nothing is pending (a failed refit's buffers are dropped)."""
        self._pending.clear()
        self.stats["pending_bytes"] = 0

    def write(self, targets: Any, piece: Any, scale: Any, values: torch.Tensor) -> None:
        """Take ``values`` (the HF values of ``piece``, a box of an online FP8 param; its
        scale box ``scale``) into the matrices they belong to; quantize each matrix with
        vLLM's function into the param and its scales once it is complete."""
        quantizer = self.quantizers[piece.target]
        param = targets.params[piece.target]
        box = piece.target_region
        vals = values.reshape([b - a for a, b in box])
        for e, (rows, cols), index in self._matrices(param.shape, box):
            key = (piece.target, e)
            if key not in self._pending:
                buf = torch.empty(param.shape[-2:], dtype=quantizer.dtype, device=param.device)
                self._pending[key] = [buf, 0]
                self.stats["pending_bytes"] += buf.numel() * buf.element_size()
                self.stats["peak_pending_bytes"] = max(self.stats["peak_pending_bytes"],
                                                       self.stats["pending_bytes"])
            entry = self._pending[key]
            entry[0][rows[0]:rows[1], cols[0]:cols[1]].copy_(vals[index] if index else vals)
            entry[1] += (rows[1] - rows[0]) * (cols[1] - cols[0])
            if entry[1] == entry[0].numel():
                self._quantize(targets, piece.target, scale.target, e, entry[0], quantizer)
                del self._pending[key]
                self.stats["pending_bytes"] -= entry[0].numel() * entry[0].element_size()

    def _quantize(self, targets: Any, target: str, scale_target: str, e: Optional[int],
                  matrix: torch.Tensor, quantizer: VllmBlockQuantizer) -> None:
        t0 = time.perf_counter()
        param, scales = targets.params[target], targets.params[scale_target]
        lead = () if e is None else (e,)
        shape, sshape = param.shape, scales.shape
        dst = targets.view(Piece(target, tuple([(e, e + 1)] if lead else []) +
                                 ((0, shape[-2]), (0, shape[-1])), ()))
        sdst = targets.view(Piece(scale_target, tuple([(e, e + 1)] if lead else []) +
                                  ((0, sshape[-2]), (0, sshape[-1])), ()))
        quantizer.write(matrix, dst, sdst)
        self.stats["matrices"] += 1
        self.stats["quantize_s"] += time.perf_counter() - t0

    def finish(self, where: str) -> None:
        """After a refit's receive: every matrix quantized. Raises ``OnlineQuantError``."""
        if self._pending:
            left = sorted(f"{t}" + ("" if e is None else f"[{e}]") for t, e in self._pending)
            self.begin()
            raise OnlineQuantError(f"{where}: the refit left {len(left)} matrices of layers vLLM "
                                   f"quantizes online incomplete ({left[:4]}): their FP8 bytes "
                                   f"are the previous version's; expected every piece the plan "
                                   f"lists")

    def report(self) -> dict:
        return dict(self.stats)


def sender_quantized_refusal(hf_name: str, target: str, where: str, found: str) -> str:
    """The refusal of FP8 bytes (or their scales) quantized by the sender for an online layer."""
    return (f"{hf_name}: on {where} it lands in {target!r}, a layer vLLM quantizes online "
            f"(--quantization fp8_per_block: {VLLM_BLOCK_QUANTIZER} of the BF16 weights); "
            f"expected the weight in BF16, quantized here by vLLM's own function "
            f"(gen_quant \"receiver\"), found {found}. Build the trainer's source with "
            f"gen_quant=\"{ONLINE_GEN_QUANT}\" (MegatronRefitSource(gen_quant=...)). Why: "
            f"{GPU_FINDING}")


__all__ = ["GPU_FINDING", "ONLINE_GEN_QUANT", "OnlineBlockFp8", "OnlineQuantError",
           "VLLM_BLOCK_QUANTIZER", "VllmBlockQuantizer", "find_block_quantizer",
           "sender_quantized_refusal"]
