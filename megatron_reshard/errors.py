"""The one root of every error this library raises.

``except MegatronReshardError`` catches any of them. Each error class also keeps the
built-in base its callers caught before the root existed (``ValueError`` for bad input,
``RuntimeError`` for a failed refit, ``TimeoutError``, ``AssertionError`` where the seed
asserted), so code written against those bases keeps working.

Stdlib only: the receiver (torch-only inside vLLM workers) and the engine import it.
"""

from __future__ import annotations

import traceback


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


def kept_without_frames(exc: BaseException) -> BaseException:
    """``exc``, to be kept past the frame that caught it (a thread's failure handed to a later
    call), with the tracebacks of it and of the exceptions it chains dropped and their text
    added as a note. Kept with its frames, it would hold their locals (the object keeping it,
    a refit group) in a cycle until Python's cyclic collector runs: a failed group's gloo
    threads and sockets outliving its retirement (issue 52)."""
    trace = "".join(traceback.format_exception(exc)).rstrip()
    chained, seen = [exc], set()
    while chained:
        error = chained.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        chained += [error.__cause__, error.__context__]
    exc.add_note(f"(where it was raised, on the thread that caught it:)\n{trace}")
    return exc
