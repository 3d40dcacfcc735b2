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

The receiver quantizes a rank's box piece by piece (q, k and v of a fused weight; gate and
up of ``w13``), each made of whole 128x128 tiles (``fp8_targets.scale_piece`` checks it).
vLLM's function computes each tile from that tile's values alone (its amax, then an
elementwise scale and cast), so a piece gives exactly the bytes of the same tiles of the
whole matrix vLLM quantizes.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

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


def sender_quantized_refusal(hf_name: str, target: str, where: str, found: str) -> str:
    """The refusal of FP8 bytes (or their scales) quantized by the sender for an online layer."""
    return (f"{hf_name}: on {where} it lands in {target!r}, a layer vLLM quantizes online "
            f"(--quantization fp8_per_block: {VLLM_BLOCK_QUANTIZER} of the BF16 weights); "
            f"expected the weight in BF16, quantized here by vLLM's own function "
            f"(gen_quant \"receiver\"), found {found}. Build the trainer's source with "
            f"gen_quant=\"{ONLINE_GEN_QUANT}\" (MegatronRefitSource(gen_quant=...)). Why: "
            f"{GPU_FINDING}")


__all__ = ["GPU_FINDING", "ONLINE_GEN_QUANT", "VLLM_BLOCK_QUANTIZER", "VllmBlockQuantizer",
           "find_block_quantizer", "sender_quantized_refusal"]
