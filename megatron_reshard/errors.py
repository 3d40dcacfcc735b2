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


class BadInputError(MegatronReshardError, ValueError):
    """An argument, model, layout or payload the library cannot take.

    Raised before any collective starts, naming what was expected and what was found.
    """


class BadInputTypeError(MegatronReshardError, TypeError):
    """An argument of the wrong type (a list where a mapping belongs, a non-tensor target)."""


class MissingEntryError(MegatronReshardError, KeyError):
    """A name the library looked up and did not find (a param without a rule, a layer
    without a PP stage)."""


class CallOrderError(MegatronReshardError, RuntimeError):
    """A call made out of its order (a refit before ``prepare_refit``, an update outside
    ``start_weight_update`` / ``finish_weight_update``)."""
