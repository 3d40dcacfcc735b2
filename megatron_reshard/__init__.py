"""megatron_reshard: shard-to-shard weight refit from Megatron-Core training into vLLM.

The package root imports only the standard library (it is imported inside generation
workers); the engine's names (torch) are loaded on first use, through PEP 562
``__getattr__``, so ``import megatron_reshard`` alone (the CLI's ``--help``, vLLM's plugin
loader) does not pay for torch and ``torch.distributed.tensor`` (about 3 s on 2 cores).
The Megatron train side lives in ``megatron_reshard.megatron``.
"""

from megatron_reshard.errors import MegatronReshardError

__version__ = "0.1.0"
__all__ = ["DTensorRef", "Transfer", "xferdtensor", "xfer_batch", "MegatronReshardError"]

_ENGINE_NAMES = ("DTensorRef", "Transfer", "xferdtensor", "xfer_batch")


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from megatron_reshard import engine  # the root's one lazy import (see the docstring)

        value = getattr(engine, name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
