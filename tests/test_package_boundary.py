"""The library (what a training job or a vLLM worker imports) never imports the tooling
(``megatron_reshard.tools``: CLI, demo, benches, plan presets) or the test fixtures
(``megatron_reshard.testing``), not even lazily inside a function."""

import ast
import pathlib

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


VLLM_MODULES = {"vllm_plugin.py", "vllm_backend.py"}  # the backend; nothing else imports vLLM


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
