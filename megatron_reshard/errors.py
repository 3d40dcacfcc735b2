"""The one root of every error this library raises.

``except MegatronReshardError`` catches any of them. Each error class also keeps the
built-in base its callers caught before the root existed (``ValueError`` for bad input,
``RuntimeError`` for a failed refit, ``TimeoutError``, ``AssertionError`` where the seed
asserted), so code written against those bases keeps working.

Stdlib only: the receiver (torch-only inside vLLM workers) and the engine import it.
"""

from __future__ import annotations


class MegatronReshardError(Exception):
    """Base of every error of megatron_reshard."""
