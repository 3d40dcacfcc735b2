"""The source's one collective: what every train rank reports, and the merge of all reports.

Torch-free. Each rank reports, as plain data, its coordinates, the global layer numbers it
holds, the HF metadata (global shape, dtype) of the params it holds, the problems it found
and the weights it holds in FP8; one ``all_gather_object`` gives every rank every report
(``MegatronRefitSource``), and ``merge_reports`` turns them into the whole model's HF
metadata and the PP stage of every layer key.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_reshard.errors import BadInputError
from megatron_reshard.megatron.model_info import HF_LAYER
from megatron_reshard.megatron.parallel import RankCoords
from megatron_reshard.wire.metadata import extract_layer_name


def _layer_sort_key(name: str) -> tuple[int, int]:
    m = HF_LAYER.match(name)
    if m is not None:
        return (1, int(m.group(1)))
    if name.startswith(("model.embed_tokens", "backbone.embeddings")):
        return (0, 0)
    if name.startswith("lm_head"):
        return (3, 0)
    return (2, 0)


def merge_reports(reports: Sequence[dict[str, Any]], all_coords: Sequence[RankCoords],
                  num_layers: int) -> tuple[dict[str, dict], dict[str, int]]:
    """Union of every rank's HF metadata (ordered: embeddings, layers, norm, lm_head) and
    layer key → PP stage. ValueError listing every inconsistency between the ranks."""
    problems: list[str] = []
    merged: dict[str, dict] = {}
    stage_of_key: dict[str, int] = {}
    layer_stage: dict[int, int] = {}
    for report, c in zip(reports, all_coords):
        for layer in report["layers"]:
            if layer_stage.setdefault(layer, c.pp) != c.pp:
                problems.append(f"layer {layer} is on PP stages {layer_stage[layer]} and {c.pp}")
        for name, meta in report["meta"].items():
            seen = merged.setdefault(name, meta)
            if seen["shape"] != meta["shape"] or seen["dtype"] != meta["dtype"]:
                problems.append(f"{name}: rank {c.rank} reports {meta} but another rank {seen}")
            key = extract_layer_name(name)
            if stage_of_key.setdefault(key, c.pp) != c.pp:
                problems.append(f"{key} is held by PP stages {stage_of_key[key]} and {c.pp}")
    if sorted(layer_stage) != list(range(num_layers)):
        problems.append(f"global layers found {sorted(layer_stage)}, expected 0..{num_layers - 1}")
    for layer, stage in layer_stage.items():
        stage_of_key.setdefault(f"model.layers.{layer}", stage)
    if problems:
        raise BadInputError("inconsistent model across train ranks:\n  - " + "\n  - ".join(problems))
    order = {name: i for i, name in enumerate(merged)}
    ordered = dict(sorted(merged.items(), key=lambda kv: (_layer_sort_key(kv[0]), order[kv[0]])))
    return ordered, stage_of_key
