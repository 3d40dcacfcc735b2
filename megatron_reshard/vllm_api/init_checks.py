"""The checks both init infos of the vLLM backend run on their fields, written once.

``trainer.MegatronReshardTrainerInitInfo`` (every training rank) and
``backend.MegatronReshardInitInfo`` (every vLLM worker, through ``parse_init_info``) share
the fields that say where and how the refit groups meet (``host``, ``ports_by_stage``, the
group backend, ``timeout_s``) and the workers' options. Each side calls the functions here
from its ``__post_init__``, so a bad value is refused when the info is built, with the same
words on both sides: ``<class>.<field>: expected ..., found <value> (<type>)``, before any
store or collective exists.

Plain checks, stdlib only at import (the payload's msgpack decoder loads msgspec inside
``wire.codec.decode_payload`` only when a payload arrives as bytes), and no vLLM: importing
this module needs neither megatron nor msgspec.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional

from megatron_reshard.errors import BadInputError

GROUP_BACKENDS = ("nccl", "gloo")
PORT_RANGE = (1, 65535)  # 0 would let each store pick its own port: the peers could not know it


def field_error(cls: str, name: str, expected: str, value: Any) -> BadInputError:
    return BadInputError(f"{cls}.{name}: expected {expected}, found {value!r} "
                         f"({type(value).__name__})")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_host(cls: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise field_error(cls, "host", "a non-empty host name or address (str)", value)


def check_choice(cls: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise field_error(cls, name, f"one of {choices}", value)


def check_timeout_s(cls: str, value: Any, name: str = "timeout_s") -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not value > 0):
        raise field_error(cls, name, "a finite number of seconds > 0", value)


def per_stage_items(cls: str, name: str, value: Any, what: str, *,
                    scalar_ok: bool = False) -> list[tuple[Any, Any]]:
    """``(stage, value)`` pairs of a per-PP-stage field: a list (index = stage), a dict
    stage -> value (stage keys as ints or, after JSON, digit strings), or with
    ``scalar_ok`` one value for every stage (stage ``"*"``). Refuses any other shape, no
    stage at all, and a stage given twice (``{0: .., "0": ..}``)."""
    shape = ("a list (index = PP stage) or a dict stage -> value of " + what
             + (", or one such int for every stage" if scalar_ok else ""))
    if scalar_ok and is_int(value):
        return [("*", value)]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        raise field_error(cls, name, shape, value)
    if not items:
        raise field_error(cls, name, shape + " (at least one stage)", value)
    stages: dict[int, Any] = {}
    for stage, _ in items:
        if not (is_int(stage) and stage >= 0) and not (isinstance(stage, str) and stage.isdigit()):
            raise BadInputError(f"{cls}.{name}: expected PP stage keys as ints >= 0, found "
                                f"{stage!r} ({type(stage).__name__})")
        if int(stage) in stages:
            raise BadInputError(f"{cls}.{name}: expected each PP stage once, found stage "
                                f"{int(stage)} as {stages[int(stage)]!r} and {stage!r}")
        stages[int(stage)] = stage
    return items


def check_per_stage_ints(cls: str, name: str, value: Any, *, lo: int, hi: Optional[int] = None,
                         scalar_ok: bool = False) -> None:
    what = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
    for stage, v in per_stage_items(cls, name, value, what, scalar_ok=scalar_ok):
        if not is_int(v) or v < lo or (hi is not None and v > hi):
            where = "" if stage == "*" else f"[{stage}]"
            raise BadInputError(f"{cls}.{name}{where}: expected {what}, found {v!r} "
                                f"({type(v).__name__})")


def check_ports_by_stage(cls: str, value: Any) -> None:
    """One TCP port per PP stage, each in 1..65535 and none twice: every stage's store
    listens on the same ``host``, so two stages on one port would meet in one store."""
    check_per_stage_ints(cls, "ports_by_stage", value, lo=PORT_RANGE[0], hi=PORT_RANGE[1])
    items = value.items() if isinstance(value, Mapping) else enumerate(value)
    first: dict[int, Any] = {}
    for stage, port in items:
        if port in first:
            raise BadInputError(f"{cls}.ports_by_stage: expected a distinct port per PP stage "
                                f"(all stages' stores listen on one host), found port {port} "
                                f"for stages {first[port]!r} and {stage!r}")
        first[port] = stage


def check_options(cls: str, name: str, value: Any, known: Iterable[str],
                  reserved: Iterable[str] = ()) -> None:
    """A dict of option names the receiver knows (``None``: none); ``reserved`` names are
    known but belong to another field of the same info."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise field_error(cls, name, "a dict or None", value)
    reserved = set(reserved)
    allowed = [k for k in known if k not in reserved]
    taken = sorted((k for k in value if k in reserved), key=str)
    if taken:
        raise BadInputError(f"{cls}.{name}: {taken} are this init info's own fields (the "
                            f"sender and the workers must agree on them); set them there")
    unknown = sorted((k for k in value if k not in allowed), key=str)
    if unknown:
        raise BadInputError(f"{cls}.{name}: unknown options {unknown}; expected a dict with "
                            f"keys among {allowed}")


def check_payload(cls: str, value: Any, decode: Callable[[bytes], Any]) -> Any:
    """The refit payload as a plain dict or its msgpack bytes (``decode``: the library's
    codec, ``wire.codec.decode_payload``); returns the payload as a dict. Bytes that do not
    decode to a map (truncated, corrupted) are refused here, not at the first collective."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = decode(bytes(value))
        except BadInputError as exc:
            raise BadInputError(f"{cls}.payload: expected the msgpack bytes of a refit payload "
                                f"(MegatronRefitSource.payload_bytes()), found {len(value)} "
                                f"bytes that do not decode: {exc}") from None
    elif not isinstance(value, dict):
        raise field_error(cls, "payload", "the refit payload as a dict (or its msgpack bytes)",
                          value)
    if "schema_version" not in value:
        raise BadInputError(f"{cls}.payload: expected a refit payload (a map with "
                            f"'schema_version'), found one with keys "
                            f"{sorted(map(str, value))[:8]}")
    return value


__all__ = ["GROUP_BACKENDS", "PORT_RANGE", "check_choice", "check_host", "check_options",
           "check_payload", "check_per_stage_ints", "check_ports_by_stage", "check_timeout_s",
           "field_error", "is_int", "per_stage_items"]
