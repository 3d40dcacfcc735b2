"""Every error the library defines derives from one root, and keeps the built-in base its
callers caught before the root existed."""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil

import pytest

import megatron_reshard
import megatron_reshard.errors
from megatron_reshard.errors import MegatronReshardError

# Tooling and test fixtures are not the library (docs/DESIGN.md, "Modules")
NOT_LIBRARY = ("megatron_reshard.tools", "megatron_reshard.testing")
# imported only where vLLM is installed (the vLLM weight-transfer backend)
NEEDS_VLLM = ("megatron_reshard.vllm_api.backend", "megatron_reshard.vllm_api.compat",
              "megatron_reshard.vllm_api.trainer")
# imported only where their RL framework is installed (docs/ADAPTERS.md)
NEEDS_FRAMEWORK = {"megatron_reshard.adapters.verl": "verl",
                   "megatron_reshard.adapters.nemo_rl": "nemo_rl"}

def _library_modules():
    for info in pkgutil.walk_packages(megatron_reshard.__path__, "megatron_reshard."):
        if info.name.startswith(NOT_LIBRARY):
            continue
        if info.name in NEEDS_VLLM and importlib.util.find_spec("vllm") is None:
            continue
        if info.name in NEEDS_FRAMEWORK and importlib.util.find_spec(NEEDS_FRAMEWORK[info.name]) is None:
            continue
        yield importlib.import_module(info.name)


def _exception_classes():
    found = {}
    for module in _library_modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


CLASSES = _exception_classes()


def test_the_scan_finds_the_library_errors():
    names = {name.rsplit(".", 1)[1] for name in CLASSES}
    assert {"RefitError", "PeerFailure", "RefitTimeout", "PlanMismatchError", "PlanError",
            "RefitPayloadError", "TargetError", "Fp8SplitError", "MeshSizeError",
            "InconsistentWeightsError"} <= names


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_library_error_derives_from_the_root(name, request):
    assert issubclass(CLASSES[name], MegatronReshardError)


@pytest.mark.parametrize("name, builtin", [
    ("megatron_reshard.wire.check.RefitPayloadError", ValueError),
    ("megatron_reshard.receiver.target_plan.TargetError", ValueError),  # receiver.targets re-exports it
    ("megatron_reshard.fp8.plan.Fp8SplitError", ValueError),
    ("megatron_reshard.layout.placements.MeshSizeError", ValueError),
    ("megatron_reshard.layout.placements.MeshSizeError", AssertionError),  # the seed asserted
    ("megatron_reshard.groups.faults.RefitError", RuntimeError),
    ("megatron_reshard.groups.faults.RefitTimeout", TimeoutError),
    ("megatron_reshard.refit.loop.PlanMismatchError", RuntimeError),
    ("megatron_reshard.engine.plan_check.PlanError", RuntimeError),
    ("megatron_reshard.receiver.state.InconsistentWeightsError", RuntimeError),
])
def test_the_builtin_bases_callers_catch_stay(name, builtin):
    assert issubclass(CLASSES[name], builtin)


def test_a_plan_mismatch_is_a_refit_error():
    from megatron_reshard.groups.faults import RefitError
    from megatron_reshard.refit.loop import PlanMismatchError

    assert issubclass(PlanMismatchError, RefitError)


def test_the_root_is_public():
    assert megatron_reshard.MegatronReshardError is MegatronReshardError


# ---- no raise site bypasses the root -----------------------------------------------------

BUILTINS = ("ValueError", "TypeError", "KeyError", "RuntimeError", "TimeoutError")


def _bare_raises(source: str) -> list[int]:
    """Lines of ``source`` that raise one of ``BUILTINS`` itself rather than a library class."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                lines.append(node.lineno)
    return lines


def test_the_raise_scan_sees_bare_builtins():
    assert _bare_raises("def f():\n    raise ValueError('x')\n") == [2]
    assert _bare_raises("def f():\n    raise BadInputError('x')\n") == []


def test_no_library_module_raises_a_bare_builtin():
    root = pathlib.Path(megatron_reshard.__file__).parent
    offenders = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("tools", "testing"):
            continue
        found = _bare_raises(path.read_text())
        if found:
            offenders[rel.as_posix()] = found
    assert offenders == {}, f"raise sites that bypass MegatronReshardError: {offenders}"


@pytest.mark.parametrize("name, builtin", [
    ("BadInputError", ValueError), ("BadInputTypeError", TypeError),
    ("MissingEntryError", KeyError), ("CallOrderError", RuntimeError)])
def test_the_general_errors_keep_their_builtin(name, builtin):
    cls = getattr(megatron_reshard.errors, name)
    assert issubclass(cls, MegatronReshardError) and issubclass(cls, builtin)
