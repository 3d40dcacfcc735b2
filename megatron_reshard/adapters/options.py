"""The adapters' engine options: one plain dict from the framework's configuration, checked
whole before anything joins a group. Every error names the configuration key (the
framework's own path to the options dict, then the option)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from megatron_reshard.errors import BadInputError

_GROUP_BACKENDS = ("nccl", "gloo")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AdapterOptions:
    """What the two sides of a framework-driven refit agree on (the same dict reaches both).

    ``gen_tp`` / ``gen_world_size``: vLLM's tensor-parallel size and its number of ranks (the
    rollout world the framework reports must equal it). ``family`` / ``vocab_size``: as
    ``MegatronRefitSource`` takes them. ``host``: where the refit groups' stores listen (the
    machine of each PP stage's first training rank; None: that rank's address).
    ``ports``: one store port per PP stage (None: each stage's first training rank picks a
    free one).
    ``model`` / ``target``: ``"module:function"`` returning the training model (Megatron
    chunks) / the vLLM model to write into; None: what ``adapters.hand_off`` gave this
    process (``adapters.handoff``). ``vllm_server``: the Ray actor name of verl's vLLM server
    a rollout worker beside it drives (``adapters.server_end``). ``keep_as_loaded``: vLLM params the payload does
    not write that may keep what was loaded (``prepare_refit``'s option).
    """

    gen_tp: int
    gen_world_size: int
    family: Optional[str] = None
    vocab_size: Optional[int] = None
    group_backend: str = "nccl"
    host: Optional[str] = None
    ports: Optional[tuple] = None
    timeout_s: float = 600.0
    verify_checksums: bool = False
    model: Optional[str] = None
    target: Optional[str] = None
    vllm_server: Optional[str] = None
    keep_as_loaded: tuple = ()

    @classmethod
    def parse(cls, kwargs: Mapping[str, Any], key: str, framework_keys: tuple = ()
              ) -> "AdapterOptions":
        """``kwargs``: the options dict; ``key``: its path in the framework's configuration
        (for the errors); ``framework_keys``: keys the framework adds itself (ignored)."""
        known = ("gen_tp", "gen_world_size", "family", "vocab_size", "group_backend", "host",
                 "ports", "timeout_s", "verify_checksums", "model", "target", "vllm_server",
                 "keep_as_loaded")
        unknown = sorted(set(kwargs) - set(known) - set(framework_keys))
        if unknown:
            raise BadInputError(f"{key}: unknown option(s) {unknown}; known: {list(known)}")

        def option(name: str, default: Any = None) -> Any:
            # the framework's options dict (some names are the payload's too: not a payload read)
            return kwargs.get(name, default)

        def bad(name: str, expected: str) -> BadInputError:
            value = option(name)
            return BadInputError(f"{key}.{name}: expected {expected}, found {value!r} "
                                 f"({type(value).__name__})")

        if "gen_tp" not in kwargs:
            raise BadInputError(f"{key}.gen_tp: required (vLLM's tensor_parallel_size), not set")
        gen_tp = option("gen_tp")
        if not _is_int(gen_tp) or gen_tp < 1:
            raise bad("gen_tp", "an int >= 1")
        gen_world = option("gen_world_size", gen_tp)
        if not _is_int(gen_world) or gen_world < gen_tp or gen_world % gen_tp:
            raise bad("gen_world_size", f"a multiple of gen_tp ({gen_tp})")
        family = option("family")
        if family is not None and not isinstance(family, str):
            raise bad("family", "a model family name (str) or None")
        vocab = option("vocab_size")
        if vocab is not None and (not _is_int(vocab) or vocab < 1):
            raise bad("vocab_size", "an int >= 1 or None")
        backend = option("group_backend", "nccl")
        if backend not in _GROUP_BACKENDS:
            raise bad("group_backend", f"one of {list(_GROUP_BACKENDS)}")
        host = option("host")
        if host is not None and (not isinstance(host, str) or not host):
            raise bad("host", "a host name or address, or None")
        ports = option("ports")
        if ports is not None and (isinstance(ports, (str, bytes)) or not all(
                _is_int(p) and 0 < p < 65536 for p in ports) or not ports):
            raise bad("ports", "a list of ports (one per PP stage) or None")
        timeout = option("timeout_s", 600.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise bad("timeout_s", "a number of seconds > 0")
        verify = option("verify_checksums", False)
        if not isinstance(verify, bool):
            raise bad("verify_checksums", "true or false")
        for name in ("model", "target"):
            value = option(name)
            if value is not None and (not isinstance(value, str) or value.count(":") != 1):
                raise bad(name, "a 'module:function' path or None")
        server = option("vllm_server")
        if server is not None and (not isinstance(server, str) or not server):
            raise bad("vllm_server", "the Ray actor name of verl's vLLM server (e.g. "
                                     "'vllm_server_0_0') or None")
        keep = option("keep_as_loaded", ())
        if isinstance(keep, str) or not all(isinstance(k, str) for k in keep):
            raise bad("keep_as_loaded", "a list of vLLM param names or fnmatch patterns")
        return cls(gen_tp=gen_tp, gen_world_size=gen_world, family=family, vocab_size=vocab,
                   group_backend=backend, host=host,
                   ports=None if ports is None else tuple(ports), timeout_s=float(timeout),
                   verify_checksums=verify, model=option("model"),
                   target=option("target"), vllm_server=server,
                   keep_as_loaded=tuple(keep))


def load_function(path: str, key: str) -> Callable[[], Any]:
    """The function a ``"module:function"`` option names; an error names the option."""
    module_name, name = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInputError(f"{key}: cannot import module {module_name!r} ({exc})") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise BadInputError(f"{key}: module {module_name!r} has no function {name!r}")
    return function


__all__ = ["AdapterOptions", "load_function"]
