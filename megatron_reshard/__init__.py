"""megatron_reshard: shard-to-shard weight refit from Megatron-Core training into vLLM.

The package root imports only torch and the standard library (it is imported inside
generation workers). The Megatron train side lives in ``megatron_reshard.megatron``.
"""

from megatron_reshard.engine import DTensorRef, Transfer, xfer_batch, xferdtensor
from megatron_reshard.errors import MegatronReshardError

__version__ = "0.1.0"
__all__ = ["DTensorRef", "Transfer", "xferdtensor", "xfer_batch", "MegatronReshardError"]
