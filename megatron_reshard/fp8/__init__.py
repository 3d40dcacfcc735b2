"""FP8 refit: which linear weights are quantized where, and the quantizers themselves.

Torch + stdlib only. ``plan`` decides from the refit info which weights of a block-FP8 or
MXFP8 generation model are quantized, and where their scales go; ``quant`` holds the
block-FP8 (128×128, fp32 ``scale_inv``) and MXFP8 quantizers and dequantizers.
"""

from megatron_reshard.fp8.quant import (BLOCK_FP8_TILE, dequantize_blockwise_fp8, dequantize_mxfp8,
                                        quantize_blockwise_fp8, quantize_mxfp8)
from megatron_reshard.fp8.plan import Fp8SplitError, plan_block_fp8, plan_mxfp8

__all__ = ["BLOCK_FP8_TILE", "Fp8SplitError", "dequantize_blockwise_fp8", "dequantize_mxfp8",
           "plan_block_fp8", "plan_mxfp8", "quantize_blockwise_fp8", "quantize_mxfp8"]
