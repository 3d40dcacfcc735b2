"""The typed payload boundary (docs/DESIGN.md, "The payload, typed end to end"), checked on
the source: payload keys are read by string only in ``wire/`` (and the seed-compatible
module); msgspec is imported by one module, ``wire/codec.py``; the schema version is
compared in one place; the per-expert HF name regex is written once; ``testing`` never
imports ``tools``."""

import ast
import pathlib
import re

import megatron_reshard
from megatron_reshard.wire import records
from megatron_reshard.wire.check import EXTRA_KEYS
from megatron_reshard.wire.extras import GenLayout, HFConfig, TrainLayout

PACKAGE = pathlib.Path(megatron_reshard.__file__).parent

# keys that name the payload, its params or its maps, and nothing else in the library
# (short generic keys such as "name", "dtype", "tp", "pp_size" are other dicts' keys too)
PAYLOAD_KEYS = (set(EXTRA_KEYS) | set(records._PAYLOAD_KEYS) | set(records._PARAM_KEYS)
                | set(HFConfig.field_names())) - {"name", "dtype", "pp_size", "pp_stage"}


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _library_files() -> list[pathlib.Path]:
    """What a training job or a vLLM worker imports: not the tooling, not the fixtures
    (the fixtures' oracle reads its own plain configs, independently of the receiver;
    the tooling reads HF ``config.json`` files)."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if _rel(p).split("/")[0] not in ("tools", "testing")]


def string_reads(source: str, keys: set) -> list[tuple[int, str]]:
    """(line, code) of every ``x["key"]`` / ``x.get("key", ...)`` / ``x.pop`` /
    ``x.setdefault`` with ``key`` in ``keys``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args
              and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        if isinstance(key, str) and key in keys:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_key_scan_sees_subscripts_and_gets():
    source = "a = p['hf_config']['vocab_size']\nb = cfg.get('num_experts') or 0\nc = d['tp']\n"
    assert [line for line, _ in string_reads(source, PAYLOAD_KEYS)] == [1, 1, 2]
    assert {"hf_config", "gen_layout", "train_layout", "per_layer_params", "num_experts",
            "kv_lora_rank", "src_placements"} <= PAYLOAD_KEYS
    assert set(GenLayout.field_names()) | set(TrainLayout.field_names()) >= {"tp", "ep", "world_size"}


def test_no_payload_key_is_read_by_string_outside_wire():
    offenders = {}
    for path in _library_files():
        rel = _rel(path)
        if rel.startswith("wire/") or rel == "nccl_reshard_utils.py":
            continue  # the payload's parser, and the seed's dict API
        hits = string_reads(path.read_text(), PAYLOAD_KEYS)
        if hits:
            offenders[rel] = hits
    assert offenders == {}, ("payload keys read by string outside wire/ (parse once with "
                             f"wire.RefitPayload and read fields): {offenders}")


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_one_codec_imports_msgspec():
    users = sorted(_rel(p) for p in PACKAGE.rglob("*.py")
                   if any(m.split(".")[0] == "msgspec" for m in _imports(p.read_text())))
    assert users == ["wire/codec.py"]


def test_the_codec_loads_msgspec_only_when_used():
    tree = ast.parse((PACKAGE / "wire" / "codec.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("msgspec" in ast.unparse(n) for n in top)


def test_the_schema_version_is_compared_in_one_place():
    places = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, (ast.Name, ast.Attribute))
                    and (getattr(x, "id", None) or getattr(x, "attr", None))
                    in ("SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS")
                    for x in [node.left, *node.comparators]):
                places.append(_rel(path))
    assert places == ["wire/check.py"]


def test_the_per_expert_hf_name_regex_is_written_once():
    # any string literal that compiles to a regex matching a per-expert HF weight name whole
    sample = "model.layers.3.mlp.experts.12.down_proj.weight"
    places = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and "experts" in node.value:
                try:
                    pattern = re.compile(node.value)
                except re.error:
                    continue
                if pattern.fullmatch(sample):
                    places.add(_rel(path))
    assert places == {"wire/expert_names.py"}
    from megatron_reshard.wire.expert_names import EXPERT_WEIGHT_RE, PER_EXPERT_RE

    m = PER_EXPERT_RE.match(sample)
    assert (m["prefix"], m["index"], m["proj"]) == ("model.layers.3.mlp.experts", "12", "down_proj")
    assert PER_EXPERT_RE.match("model.layers.3.mlp.experts.down_proj.weight") is None
    assert PER_EXPERT_RE.match(sample + "_scale_inv") is None
    assert EXPERT_WEIGHT_RE.match("model.layers.3.mlp.experts.down_proj.weight")["index"] is None


def test_testing_never_imports_tools():
    # tools (the demo, the launches) build on the fixtures; never the other way round
    offenders = {_rel(p): sorted(m for m in _imports(p.read_text())
                                 if m.startswith("megatron_reshard.tools"))
                 for p in sorted((PACKAGE / "testing").rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}
