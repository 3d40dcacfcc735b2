"""Blockwise-FP8 training weights (Megatron ``fp8_param`` with the blockwise recipe) as plain tensors.

With ``fp8_param`` and the blockwise recipe, Transformer Engine keeps each linear weight of
a rank as FP8 bytes plus one fp32 ``scale_inv`` per 128x128 tile of the rank's local shard
(2-D block scaling); the nominal dtype stays BF16. The refit reads them through
``blockwise_fp8_storage(param)``, which gives a ``BlockwiseFp8Weight``:

- ``data``: ``float8_e4m3fn`` with the local shard's shape;
- ``scale_inv``: fp32 ``[ceil(N/128), ceil(K/128)]``; ``data * scale_inv[tile]`` is the value.

Two sources of it: a ``BlockwiseFp8Weight`` attached to the parameter as
``param.blockwise_fp8`` (what ``testing.fp8_training`` builds from plain tensors on CPU,
where Transformer Engine cannot be installed), or a Transformer Engine
``Float8BlockwiseQTensor`` read by ``read_te_blockwise_fp8_untested``, the one adapter
that touches TE's internals and that has not run on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_reshard.errors import BadInputError
from megatron_reshard.fp8.quant import blockwise_scale_shape


@dataclass
class BlockwiseFp8Weight:
    data: torch.Tensor       # float8_e4m3fn, the local shard's shape
    scale_inv: torch.Tensor  # fp32, one per 128x128 tile of the local shard

    def __post_init__(self):
        expected = blockwise_scale_shape(self.data.shape)
        if self.data.dtype != torch.float8_e4m3fn or tuple(self.scale_inv.shape) != expected:
            raise BadInputError(f"blockwise FP8 weight: data {self.data.dtype} {list(self.data.shape)} "
                             f"with scale_inv {list(self.scale_inv.shape)}; expected "
                             f"torch.float8_e4m3fn data and scale_inv {list(expected)}")


def read_te_blockwise_fp8_untested(param: Any) -> Optional[BlockwiseFp8Weight]:
    """A Transformer Engine ``Float8BlockwiseQTensor`` weight as ``BlockwiseFp8Weight``.

    UNTESTED on this machine (no CUDA, TE not installable). From TE's public layout: the
    row-wise copy is ``_rowwise_data`` (uint8 bytes of e4m3) and ``_rowwise_scale_inv``
    (fp32, ``[ceil(N/128), ceil(K/128)]`` possibly padded in its inner dim for alignment,
    hence the crop); weights use 2-D (128x128) blocks (``_is_2D_scaled``).
    """
    if type(param).__name__ != "Float8BlockwiseQTensor":
        return None
    data, scale_inv = getattr(param, "_rowwise_data", None), getattr(param, "_rowwise_scale_inv", None)
    if data is None or scale_inv is None or not getattr(param, "_is_2D_scaled", True):
        raise BadInputError(f"Float8BlockwiseQTensor of shape {list(param.shape)} has no row-wise 2-D "
                         f"blockwise data (the refit needs 128x128 block scales)")
    rows, cols = blockwise_scale_shape(data.shape)
    return BlockwiseFp8Weight(data.view(torch.float8_e4m3fn), scale_inv[:rows, :cols])


def blockwise_fp8_storage(param: Any) -> Optional[BlockwiseFp8Weight]:
    """The FP8 storage of a training weight, None when it is kept in high precision."""
    attached = getattr(param, "blockwise_fp8", None)
    if isinstance(attached, BlockwiseFp8Weight):
        return attached
    return read_te_blockwise_fp8_untested(param)


__all__ = ["BlockwiseFp8Weight", "blockwise_fp8_storage", "read_te_blockwise_fp8_untested"]
