"""The staged flip's copies (``receiver.staging._copy_all``) are bit for bit on a GPU: a
bfloat16 NaN with a payload (0x7f81), which CUDA's ``_foreach_copy_`` of a float dtype
rewrites to 0x7fc0 (seen on an H200), survives both paths: the fused copy of the small
pairs and the memcpy of the large ones. Needs one CUDA GPU:
``python -m pytest tests/gpu/test_staging_copies_gpu.py -q``."""

import pytest
import torch

from megatron_reshard.receiver.staging import MEMCPY_BYTES, _copy_all

pytestmark = [pytest.mark.one_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _with_nan_payloads(numel: int) -> torch.Tensor:
    bits = torch.randint(-(1 << 15), 1 << 15, (numel,), dtype=torch.int16, device="cuda")
    bits[::97] = 0x7F81  # NaN, payload 1
    bits[1::89] = -0x7F  # 0xff81: a negative NaN with a payload
    return bits.view(torch.bfloat16)


def test_flip_copies_keep_every_bit():
    small = [_with_nan_payloads(n) for n in (1, 77, 4096, 300_001)]
    large = [_with_nan_payloads(MEMCPY_BYTES // 2 + 5)]
    strided = _with_nan_payloads(64 * 130).view(64, 130)[:, :128]  # a non-contiguous view
    src = small + large + [strided]
    dst = [torch.zeros_like(s) for s in src]
    _copy_all(dst, src)
    torch.cuda.synchronize()
    for d, s in zip(dst, src):
        assert torch.equal(d.view(torch.int16), s.view(torch.int16))
