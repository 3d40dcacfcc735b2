"""The library (what a training job or a vLLM worker imports) never imports the tooling
(``megatron_reshard.tools``: CLI, demo, benches, plan presets) or the test fixtures
(``megatron_reshard.testing``), not even lazily inside a function; only the vLLM backend
modules import vLLM; no two of the library's packages import each other, directly or
through a third; and the package root and the CLI's parser import no torch."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import megatron_reshard

PACKAGE = pathlib.Path(megatron_reshard.__file__).parent
TOOLING = ("megatron_reshard.tools", "megatron_reshard.testing")


def _library_files() -> list[pathlib.Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p.relative_to(PACKAGE).parts[0] not in ("tools", "testing")]


def _imported_modules(source: str, package: str) -> list[str]:
    """Absolute names of every module ``source`` (a module of ``package``) imports, at any
    depth, relative imports resolved."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def test_library_files_are_found():
    files = {p.relative_to(PACKAGE).as_posix() for p in _library_files()}
    assert {"refit/loop.py", "receiver/worker.py", "megatron/source.py"} <= files
    assert not any(f.startswith(("tools/", "testing/")) for f in files)


def test_library_never_imports_tooling_or_fixtures():
    offenders = {}
    for path in _library_files():
        package = ".".join(("megatron_reshard",) + path.relative_to(PACKAGE).parent.parts)
        bad = [m for m in _imported_modules(path.read_text(), package) if m.startswith(TOOLING)]
        if bad:
            offenders[path.relative_to(PACKAGE).as_posix()] = sorted(set(bad))
    assert offenders == {}, f"library modules importing tooling or test fixtures: {offenders}"


def test_the_checker_sees_lazy_and_relative_imports():
    source = "import os\ndef f():\n    from ..tools.cli import main\n    from . import plan\n"
    names = _imported_modules(source, "megatron_reshard.engine")
    assert "megatron_reshard.tools.cli" in names and "megatron_reshard.engine.plan" in names


VLLM_MODULES = {"vllm_api/plugin.py", "vllm_api/backend.py", "vllm_api/trainer.py",
                "vllm_api/compat.py"}  # both sides, and what differs between vLLM versions


def test_only_the_vllm_backend_modules_import_vllm():
    offenders = {}
    for path in _library_files():
        rel = path.relative_to(PACKAGE).as_posix()
        package = ".".join(("megatron_reshard",) + path.relative_to(PACKAGE).parent.parts)
        bad = [m for m in _imported_modules(path.read_text(), package)
               if m == "vllm" or m.startswith("vllm.")]
        if bad and rel not in VLLM_MODULES:
            offenders[rel] = sorted(set(bad))
    assert offenders == {}, f"library modules importing vllm outside the backend: {offenders}"
    assert VLLM_MODULES <= {p.relative_to(PACKAGE).as_posix() for p in _library_files()}


def test_the_package_root_holds_only_what_a_user_imports():
    """docs/DESIGN.md, "The package root": the errors, the seed-compatible face and its
    support table; everything else lives in a package named for its job."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "errors.py", "nccl_reshard_utils.py", "support.py"], loose


# ---- no import loop between the library's packages --------------------------------------

def _library_unit(module: str) -> str:
    """The library unit a module belongs to: its package below ``megatron_reshard``
    (``wire``, ``engine``, ...) or, for a root module, the module (``placements``)."""
    return module.split(".")[1]


def _unit_imports() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files that import it (the library's own units only)."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in _library_files():
        rel = path.relative_to(PACKAGE)
        if rel.as_posix() == "__init__.py":
            continue  # the root's public list imports what it exports, nothing imports it
        package = ".".join(("megatron_reshard",) + rel.parent.parts)
        unit = rel.parts[0].removesuffix(".py")
        for name in _imported_modules(path.read_text(), package):
            if not name.startswith("megatron_reshard.") or name.count(".") < 1:
                continue
            target = _library_unit(name)
            if target != unit and not target.startswith(("tools", "testing")):
                edges.setdefault(unit, {}).setdefault(target, set()).add(rel.as_posix())
    return edges


def _loops(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Every pair of units that reach each other, as the shortest path between them."""
    def path(a: str, b: str):
        seen, todo = {a: [a]}, [a]
        while todo:
            x = todo.pop(0)
            for y in sorted(edges.get(x, {})):
                if y not in seen:
                    seen[y] = seen[x] + [y]
                    todo.append(y)
        return seen.get(b)

    found = []
    for a in sorted(edges):
        for b in sorted(edges[a]):
            back = path(b, a)
            if back is not None and a < b:
                found.append([a] + back)
    return found


def test_the_loop_finder_sees_a_loop_through_a_third_package():
    edges = {"groups": {"engine": {"groups/comm.py"}}, "engine": {"refit": {"x"}},
             "refit": {"groups": {"y"}}, "wire": {"placements": {"z"}}}
    assert _loops(edges) == [["engine", "refit", "groups", "engine"]]


def test_no_import_loop_between_library_packages():
    # among others: groups never imports the engine (it carries a transport's name, the
    # engine builds it); wire -> vllm_layout -> placements, never back into wire
    edges = _unit_imports()
    loops = _loops(edges)
    detail = {" -> ".join(loop): sorted(edges[loop[0]][loop[1]]) for loop in loops}
    assert loops == [], f"import loops between library packages: {detail}"
    assert "engine" not in edges.get("groups", {})
    assert "wire" not in edges.get("vllm_layout", {})


# ---- the package root and the CLI's parser stay cheap -------------------------------------

_CHEAP_IMPORTS = """
import json, sys
import megatron_reshard
root = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "msgspec"))
from megatron_reshard.tools import cli
cli.build_parser()
parser = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron", "msgspec"))
print(json.dumps({"root": root, "parser": parser, "engine": "megatron_reshard.engine" in sys.modules}))
"""


def test_the_package_root_and_the_cli_parser_import_no_torch():
    # what vLLM's plugin loader (megatron_reshard.vllm_api.plugin) and `megatron-reshard --help` pay
    out = subprocess.run([sys.executable, "-c", _CHEAP_IMPORTS], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent).stdout
    assert json.loads(out.splitlines()[-1]) == {"root": [], "parser": [], "engine": False}


def test_the_package_root_gives_the_engine_names_on_first_use():
    from megatron_reshard import engine

    assert megatron_reshard.__all__ == ["DTensorRef", "Transfer", "xferdtensor", "xfer_batch",
                                        "MegatronReshardError"]
    for name in ("DTensorRef", "Transfer", "xferdtensor", "xfer_batch"):
        assert getattr(megatron_reshard, name) is getattr(engine, name)
        assert name in dir(megatron_reshard)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        megatron_reshard.no_such_name  # noqa: B018


# ---- no import loop between two modules, tooling and fixtures included ---------------------

def _module_imports() -> dict[str, dict[str, set[str]]]:
    """module -> imported module -> {its file}, for every module of the package but the
    packages' ``__init__`` (a package's public list imports its rooms; nothing in it loops)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            rel = path.relative_to(PACKAGE.parent).with_suffix("")
            names[".".join(rel.parts)] = path
    edges: dict[str, dict[str, set[str]]] = {}
    for name, path in names.items():
        for imported in _imported_modules(path.read_text(), name.rsplit(".", 1)[0]):
            if imported in names and imported != name:
                edges.setdefault(name, {}).setdefault(imported, set()).add(path.name)
    return edges


def test_no_import_loop_between_modules():
    # e.g. tools.cli -> tools.demo -> tools.cli (the demo's option errors printed by cli.fail):
    # the CLI asks the demo for its problems and prints them itself
    # (issue 56 took apart the last three: this one, refit.delta_kernels <-> delta_transport
    # and testing.fp8_reference <-> testing.vllm_like)
    loops = _loops(_module_imports())
    assert loops == [], f"import loops between modules: {loops}"


# ---- function-local imports of the library's own modules: each with its reason -------------

def _function_local_imports() -> set[tuple[str, str]]:
    """(library file, module) for each import of a ``megatron_reshard`` module made inside a
    function of a library file."""
    found = set()
    for path in _library_files():
        rel = path.relative_to(PACKAGE)
        package = ".".join(("megatron_reshard",) + rel.parent.parts)
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in fn.body:
                    for inner in ast.walk(node):
                        if isinstance(inner, (ast.Import, ast.ImportFrom)):
                            names = _imported_modules(ast.unparse(inner), package)
                            base = names[0]
                            if base.startswith("megatron_reshard"):
                                found.add((rel.as_posix(), base))
    return found


# Each one and why it cannot be at the top; a new one needs a reason here (and at its line).
_LAZY_IMPORTS = {
    ("__init__.py", "megatron_reshard"):
        "the engine's names on first use: the package root imports no torch (the CLI's "
        "--help, vLLM's plugin loader)",
    ("megatron/__init__.py", "megatron_reshard.megatron"): "its names on use: importing the "
                                                           "package must not import megatron.core",
    ("megatron/__init__.py", "megatron_reshard.wire"): "(same)",
    ("megatron/gen_split.py", "megatron_reshard.vllm_layout.dense"): "torch only when a size is "
                                                                     "checked (the demo's parser)",
    ("megatron/gen_split.py", "megatron_reshard.megatron.model_info"): "(same)",
    ("vllm_layout/kernel_order.py", "megatron_reshard.engine.kernel_copies"):
        "the engine package (~1.5 s) only where a CUDA storage is written; wire and "
        "vllm_layout load without it",
    ("vllm_api/backend.py", "megatron_reshard.wire.codec"): "msgspec only where bytes arrive",
}


def test_every_function_local_import_of_the_library_has_its_reason():
    found = _function_local_imports()
    assert found == set(_LAZY_IMPORTS), (f"new: {sorted(found - set(_LAZY_IMPORTS))}; "
                                         f"gone: {sorted(set(_LAZY_IMPORTS) - found)}")
