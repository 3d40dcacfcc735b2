"""The train-side plan of a refit: a chain of plain functions that ends in one frozen record.

``build_train_side_plan(model, ...)`` runs on every train rank; each step takes the records
of the steps before it and returns a new frozen one, so what a step reads is in its
signature (``MegatronRefitSource`` is a thin face over the result):

1. ``check_inputs`` → ``ModelFacts``: parallel state, family, vocab, options; one
   ``BadInputError`` listing every problem, before any collective.
2. ``convert_local_params`` → ``LocalParams``: this rank's Megatron params as HF params
   (live tensors, FP8 views) and this rank's report for the gather. No collective.
3. ``gather_reports`` → ``RankPlacement``: the one ``all_gather_object`` over the train
   world; any rank's problem raises on every rank; the stages' meshes from the reported
   coordinates.
4. ``sort_params`` → ``ParamSets``: the whole model's HF metadata sorted by path (bulk,
   exact extras, packed others) and ``hf_config``.
5. ``build_records``: the refit records as the train side reads its own shards, and as the
   generation side gets them (FP8 planned when ``gen_quant`` is set).
6. ``build_wire_payload``: the payload, held once as frozen records (``wire.RefitPayload``)
   beside its msgpack bytes, encoded once.

The step docstrings of ``megatron.source`` (module doc) state the decisions each applies.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputError, BadInputTypeError
from megatron_reshard.fp8.plan import (GEN_QUANT_FORMATS, plan_block_fp8, plan_block_fp8_online,
                                       plan_mxfp8)
from megatron_reshard.layout.placements import build_mesh_info
from megatron_reshard.megatron import gpt_oss, mamba, mla, nemotron_h, qwen3_next, unsupported_families
from megatron_reshard.megatron.converters import Converted, ModelDims, NameConverter, hf_global_shapes
from megatron_reshard.megatron.exact_path import VOCAB_PARAMS, add_exact_extras
from megatron_reshard.megatron.families import FAMILIES
from megatron_reshard.megatron.fp8_source import grouped_name, train_fp8_views
from megatron_reshard.megatron.model_info import (hf_config, infer_family, named_tensors, unwrap_model,
                                                  why_no_family)
from megatron_reshard.megatron.parallel import (
    RankCoords,
    StageMeshes,
    TrainParallelism,
    build_stage_meshes,
    coords_from_plain,
    coords_to_plain,
    describe_rank_order,
    read_parallel_state,
)
from megatron_reshard.wire.codec import build_payload, encode_payload
from megatron_reshard.megatron.qkv import qkv_groups_fit
from megatron_reshard.megatron.rank_reports import merge_reports
from megatron_reshard.vllm_layout import gpt_oss as gpt_oss_wire
from megatron_reshard.vllm_layout.dense import NOT_LISTED, QKV_PARAM_RE, tp_dim_of
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info, extract_layer_name
from megatron_reshard.wire.placement_rules import is_expert_param, is_nccl_reshard_param
from megatron_reshard.wire.records import MiscRecord, ParamRecord, RefitPayload


def _frozen_map(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class GenTarget:
    """What the generation side looks like: its parallel sizes and world size, and the
    format its linear weights are held in (None: the training dtype)."""

    tp: int
    ep: int
    pp: int
    world_size: int
    quant: Optional[str] = None

    @classmethod
    def of(cls, gen_parallelism: Mapping, gen_world_size: int, quant: Optional[str]) -> "GenTarget":
        """Checked here, before any collective (sizes: positive ints)."""
        if not isinstance(gen_parallelism, Mapping):
            raise BadInputTypeError(f"gen_parallelism: expected a dict with tp_size / ep_size / "
                                    f"pp_size, found {type(gen_parallelism).__name__}")
        sizes = []  # tp, ep, pp, gen world
        for key, value in (*((k, gen_parallelism.get(k, 1)) for k in ("tp_size", "ep_size", "pp_size")),
                           ("gen_world_size", gen_world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                where = key if key == "gen_world_size" else f"gen_parallelism[{key!r}]"
                raise BadInputError(f"{where} must be a positive int, got {value!r}")
            sizes.append(value)
        return cls(*sizes, quant)

    def as_parallelism(self) -> dict[str, int]:
        """The seed's ``gen_parallelism`` dict form."""
        return {"tp_size": self.tp, "ep_size": self.ep, "pp_size": self.pp}

    def as_layout(self) -> dict[str, int]:
        """The payload's ``gen_layout``."""
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "world_size": self.world_size}


@dataclass(frozen=True)
class ModelFacts:
    """Step 1: the checked model and this rank's place in the training world."""

    model: Any                # the bare GPTModel (wrappers removed)
    config: Any               # its TransformerConfig
    family: str
    layout: TrainParallelism  # the training world's parallel sizes
    coords: RankCoords        # this rank's coordinates
    vocab_size: int           # real (HF) vocab rows
    dims: ModelDims
    num_local_experts: int
    mla_down_replicated: bool

    def mla_tp_dims(self, name: str) -> Optional[tuple[Optional[int], Optional[int]]]:
        """(train, gen) TP dims of an MLA / DeepSeek MoE param on the exact path, else None."""
        return mla.exact_path_tp_dims(name, mla.is_mla(self.config), self.mla_down_replicated)


@dataclass(frozen=True)
class LocalParams:
    """Step 2: this rank's conversions with their live tensors, and its FP8 views."""

    converted: tuple[tuple[Converted, torch.Tensor], ...]
    fp8_views: Mapping[str, Any]
    report: Mapping[str, Any]  # what this rank contributes to the one gather (plain data)


@dataclass(frozen=True)
class RankPlacement:
    """Step 3: every train rank's coordinates and the meshes of each PP stage."""

    all_coords: tuple[RankCoords, ...]
    rank_order: str
    stages: tuple[StageMeshes, ...]
    stage: int               # this rank's PP stage
    stage_local_rank: int    # its rank among the stage's train ranks (its refit group rank)


@dataclass(frozen=True)
class ParamSets:
    """Step 4: the whole model's HF metadata (``{name: {"shape", "dtype"}}``) by path."""

    layer_to_pp_stage: Mapping[str, int]
    bulk: Mapping[str, dict]          # ``is_nccl_reshard_param``: the seed's bulk set
    vocab: Mapping[str, dict]         # vocab matrices (exact path, padded shards)
    exact_extra: Mapping[str, dict]   # every exact-path param outside the bulk set
    other: Mapping[str, dict]         # the packed broadcast
    hf_config: Mapping[str, Any]
    train_fp8: frozenset              # grouped names of weights held in FP8 for training


@dataclass(frozen=True)
class TrainSidePlan:
    """Everything a train rank knows after construction; nothing changes it afterwards.

    ``train_records``: the bulk records as this rank reads its own shards (no FP8 plan;
    the same object as ``payload`` when ``gen.quant`` is None). ``payload``: what the
    generation side gets, as frozen records; ``payload_bytes``: its msgpack encoding."""

    facts: ModelFacts
    gen: GenTarget
    local: LocalParams
    placement: RankPlacement
    params: ParamSets
    train_records: RefitPayload
    payload: RefitPayload
    payload_bytes: bytes
    fp8_counts: Optional[Mapping[str, int]] = None

    @property
    def stage(self) -> int:
        return self.placement.stage

    @property
    def stage_local_rank(self) -> int:
        return self.placement.stage_local_rank

    def where(self) -> str:
        """This rank, for error messages."""
        return (f"rank {self.facts.coords.rank} (PP stage {self.stage}, stage-local rank "
                f"{self.stage_local_rank})")


def _refuse(problems: list) -> None:
    if problems:
        raise BadInputError("cannot build the Megatron refit source:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------------------- the steps
def check_inputs(model: Any, gen: GenTarget, family: Optional[str], vocab_size: Optional[int],
                 packed_params: Optional[str]) -> ModelFacts:
    """Step 1 (no collective): one BadInputError listing every problem, on every rank."""
    bare, model_problems = unwrap_model(model)
    config = getattr(bare, "config", None)
    # expert TP (Megatron's default: the TP size) is refused only where experts exist
    par, coords, problems = read_parallel_state(
        has_experts=config is None or bool(getattr(config, "num_moe_experts", None)))
    problems += model_problems
    if gen.quant not in (None, *GEN_QUANT_FORMATS):
        problems.append(f"gen_quant={gen.quant!r}: expected None or one of {list(GEN_QUANT_FORMATS)}")
    if bare is not None:
        chosen = family if family is not None else infer_family(config)
        refused = unsupported_families.family_problem(chosen)
        if refused is not None:
            problems.append(refused)
        elif chosen is None:
            problems.append(f"cannot infer the model family of {why_no_family(config)}: pass "
                            f"family= one of {sorted(FAMILIES)}")
        elif chosen not in FAMILIES:
            problems.append(f"unknown model family {chosen!r}: known families are {sorted(FAMILIES)}")
        family = chosen
        problems += mla.unsupported_features(config)
        problems += nemotron_h.unsupported(bare, family)
        problems += unsupported_families.layer_problems(config, family)
        padded = int(getattr(bare, "vocab_size", 0) or 0)
        if vocab_size is None:
            vocab_size = padded
        elif not 0 < vocab_size <= padded:
            problems.append(f"vocab_size={vocab_size} must be in 1..{padded} (the model's padded vocab)")
    if packed_params is not None:
        try:
            re.compile(packed_params)
        except (re.error, TypeError) as err:
            problems.append(f"packed_params={packed_params!r} is not a regular expression ({err})")
    _refuse(problems)
    assert par is not None and coords is not None and bare is not None

    n_experts = int(getattr(config, "num_moe_experts", None) or 0)
    num_local_experts = n_experts // par.ep if n_experts else 0
    dims = ModelDims(
        tp_size=par.tp,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels,
        vocab_size=int(vocab_size),  # type: ignore[arg-type]
        gated=bool(config.gated_linear_unit),
        num_local_experts=num_local_experts,
        linear=qwen3_next.LinearAttentionDims.from_config(config),
        mamba=mamba.MambaDims.from_config(config),
    )
    return ModelFacts(model=bare, config=config, family=family,  # type: ignore[arg-type]
                      layout=par, coords=coords, vocab_size=int(vocab_size),  # type: ignore[arg-type]
                      dims=dims, num_local_experts=num_local_experts,
                      mla_down_replicated=mla.down_projections_replicated(bare))


def convert_local_params(facts: ModelFacts, gen: GenTarget) -> LocalParams:
    """Step 2 (no collective): this rank's Megatron params as HF params, and its report
    (``rank_reports``): coordinates, global layers, HF metadata, problems, FP8 weights."""
    bare, coords = facts.model, facts.coords
    global_layer = {i: int(layer.layer_number) - 1 for i, layer in enumerate(bare.decoder.layers)}
    converter = NameConverter(
        family=facts.family, global_layer=global_layer,
        expert_offset=coords.ep * facts.num_local_experts, num_local_experts=facts.num_local_experts,
        gated=facts.dims.gated,
        tied_embeddings=bool(getattr(bare, "share_embeddings_and_output_weights", False)),
        mla_down_replicated=facts.mla_down_replicated,
    )
    tensors = named_tensors(bare)
    by_name = dict(tensors)
    names, unknown = converter.convert_all([n for n, _ in tensors])
    converted = tuple((c, by_name[c.megatron_name]) for c in names)
    local_meta: dict[str, dict] = {}
    problems = [f"rank {coords.rank}: unknown Megatron parameter {n!r} for family {facts.family!r}"
                for n in unknown]
    for conv, tensor in converted:
        try:
            shapes = hf_global_shapes(conv, tensor.shape, facts.dims)
        except ValueError as err:
            problems.append(f"rank {coords.rank}: {err}")
            continue
        for hf_name, shape in shapes.items():
            local_meta[hf_name] = {"shape": shape, "dtype": str(tensor.dtype)}
    # weights held in blockwise FP8 for training (fp8_param): their bytes and scales travel
    fp8_views, fp8_problems = (train_fp8_views(list(converted), facts.dims, tp_rank=coords.tp)
                               if gen.quant is not None else ({}, []))
    problems += [f"rank {coords.rank}: {p}" for p in fp8_problems]
    report = {
        "coords": coords_to_plain(coords),
        "layers": sorted(global_layer.values()),
        "meta": local_meta,
        "problems": problems,
        "fp8": sorted({grouped_name(n) for n in fp8_views}),
    }
    return LocalParams(converted=converted, fp8_views=_frozen_map(fp8_views), report=report)


def gather_reports(facts: ModelFacts, local: LocalParams) -> tuple[list, RankPlacement]:
    """Step 3, the one collective: every rank's report on every rank (any rank's problem
    raises on all of them), then the stages' meshes from the reported coordinates."""
    par = facts.layout
    reports: list = [None] * par.world_size
    dist.all_gather_object(reports, dict(local.report))
    _refuse([p for r in reports for p in r["problems"]])
    all_coords = tuple(coords_from_plain(r["coords"]) for r in reports)
    rank_order = describe_rank_order(list(all_coords), par)
    try:
        stages = tuple(build_stage_meshes(list(all_coords), par))
    except ValueError as err:
        raise BadInputError(f"unsupported Megatron rank order (found: {rank_order}): {err}") from None
    stage = facts.coords.pp
    return reports, RankPlacement(all_coords=all_coords, rank_order=rank_order, stages=stages,
                                  stage=stage,
                                  stage_local_rank=stages[stage].local_rank(facts.coords.rank))


def sort_params(facts: ModelFacts, placement: RankPlacement, reports: list, gen: GenTarget,
                packed_params: Optional[str]) -> ParamSets:
    """Step 4: the whole model's HF metadata sorted by path: bulk, exact extras (vocab
    padded shards, q/k/v per KV group, direct and MLA params), packed others."""
    metadata, stage_of_key = merge_reports(reports, list(placement.all_coords),
                                           int(facts.config.num_layers))
    # gated attention's q/k/v (Qwen3-Next, Qwen3.5): per group where each train rank holds
    # whole KV groups (weights; ``qwen3_next.gated_qkv_views``), else packed
    grouped_qkv = qkv_groups_fit(facts.dims, facts.layout.tp, gen.tp)
    if getattr(facts.config, "attention_output_gate", False):
        nkv = facts.dims.num_query_groups
        grouped_qkv = (grouped_qkv and facts.layout.tp <= nkv and nkv % facts.layout.tp == 0
                       and not getattr(facts.config, "add_qkv_bias", False) and gen.quant is None)
    forced = re.compile(packed_params) if packed_params else None
    hf_metadata = metadata
    keep_packed = lambda n: bool(forced and forced.search(n))  # noqa: E731
    # the wire forms of gpt-oss's experts and of the Gated-DeltaNet streams are planned for a
    # generation model in the training dtype: with FP8 generation those params stay packed
    # (quantized on write from full tensors), as before these forms existed
    bf16_forms = gen.quant is None
    if facts.family == "gpt_oss" and bf16_forms:  # experts in vLLM's wire form (megatron.gpt_oss)
        metadata = gpt_oss.wire_metadata(metadata, keep_packed)
    if facts.dims.linear is not None and bf16_forms:  # streams by segment (megatron.qwen3_next)
        metadata = qwen3_next.stream_metadata(metadata, facts.dims.linear, keep_packed)
    if facts.dims.mamba is not None and bf16_forms:  # Mamba in_proj / conv1d streams (megatron.mamba)
        metadata = mamba.stream_metadata(metadata, facts.dims.mamba, gen.tp, keep_packed)
    # Vocab matrices are the largest params outside the FFN; attention output, norms and
    # router have plain layouts on both sides: all take the exact path.
    exact_extra = {n: m for n, m in metadata.items()
                   if not is_nccl_reshard_param(n) and (bf16_forms or ".linear_attn." not in n)
                   and not (forced and forced.search(n))
                   and (n in VOCAB_PARAMS or tp_dim_of(n) != NOT_LISTED
                        or (grouped_qkv and QKV_PARAM_RE.search(n))
                        or facts.mla_tp_dims(n) is not None
                        or gpt_oss_wire.WIRE_RE.match(n) is not None)}
    return ParamSets(
        layer_to_pp_stage=_frozen_map(stage_of_key),
        bulk=_frozen_map({n: m for n, m in metadata.items() if is_nccl_reshard_param(n)}),
        vocab=_frozen_map({n: m for n, m in metadata.items() if n in VOCAB_PARAMS}),
        exact_extra=_frozen_map(exact_extra),
        other=_frozen_map({n: m for n, m in metadata.items()
                           if not is_nccl_reshard_param(n) and n not in exact_extra}),
        hf_config=_frozen_map(hf_config(facts.model, facts.family, facts.vocab_size, hf_metadata)),
        train_fp8=frozenset(n for r in reports for n in r["fp8"]),
    )


def build_records(facts: ModelFacts, placement: RankPlacement, params: ParamSets,
                  gen: GenTarget) -> tuple[RefitPayload, RefitPayload, Optional[dict]]:
    """Step 5: (train-side records, generation-side records, FP8 counts or None). The seed's
    refit info with the live meshes and the exact extras; FP8 planned for the generation
    side when ``gen.quant`` is set (else both are the same object)."""
    par = facts.layout
    stage_of_key = dict(params.layer_to_pp_stage)
    info = RefitPayload.of(build_nccl_reshard_refit_info(
        dict(params.bulk), {"tp_size": par.tp, "ep_size": par.ep, "pp_size": par.pp},
        gen.as_parallelism(), par.world_size, gen.world_size,
        stage_of_key if par.pp > 1 else None,
    ))
    info = _use_live_meshes(info, placement)
    stage_world = par.world_size // par.pp
    info = add_exact_extras(info, dict(params.exact_extra), stage_of_key, list(placement.stages),
                            build_mesh_info(gen.world_size, stage_world, tp_size=gen.tp),
                            gen_expert=(build_mesh_info(gen.world_size, stage_world, ep_size=gen.ep)
                                        if gen.ep > 1 else None),
                            padded_train_vocab=int(facts.model.vocab_size), dims=facts.dims,
                            pp=par.pp, mla_tp_dims=facts.mla_tp_dims)
    if gen.quant is None:
        return info, info, None
    train_fp8 = params.train_fp8
    if gen.quant in ("mxfp8", "block_fp8_online"):  # quantized on the receiver (NeMo-RL's
        if train_fp8:                                 # is_mx path; vLLM's online block FP8)
            raise BadInputError(f"gen_quant={gen.quant!r} with weights held in blockwise FP8 "
                                f"for training ({len(train_fp8)}, e.g. {min(train_fp8)}): "
                                f"this generation format is quantized on the receiver from "
                                f"BF16 training weights only")
        plan = plan_mxfp8 if gen.quant == "mxfp8" else plan_block_fp8_online
        planned, counts = plan(info, stage_world)
    else:
        planned, counts = plan_block_fp8(info, stage_world, train_fp8=train_fp8)
    packed = sorted(train_fp8 - {p.name for p in planned.params()})
    if packed:  # the packed path sends full BF16 tensors: the FP8 bytes would be lost
        raise BadInputError(f"weights held in blockwise FP8 for training must take the exact "
                            f"path, but these would go packed: {packed}")
    return info, planned, counts


def _use_live_meshes(info: RefitPayload, placement: RankPlacement) -> RefitPayload:
    """The refit info with the formula-built train meshes replaced by the ones built from
    reported coordinates (identical under the default rank order)."""
    def live_mesh(p: ParamRecord) -> ParamRecord:
        stage = placement.stages[p.stage]
        live = stage.expert if is_expert_param(p.name) else stage.dense
        if live.shape != p.src_mesh_info.shape:
            raise BadInputError(f"{p.name}: live train mesh {live} does not have the shape of the "
                                f"refit info's {p.src_mesh_info} (rank order {placement.rank_order})")
        return dataclasses.replace(p, src_mesh_info=live)

    return info.map_params(live_mesh)


def build_wire_payload(facts: ModelFacts, placement: RankPlacement, params: ParamSets,
                       gen: GenTarget, gen_records: RefitPayload) -> tuple[RefitPayload, bytes]:
    """Step 6: the payload as frozen records and as msgpack bytes (encoded once; the
    records are parsed from the same plain data, so both say the same)."""
    other = [MiscRecord(n, tuple(m["shape"]), m["dtype"],
                        params.layer_to_pp_stage[extract_layer_name(n)])
             for n, m in params.other.items()]
    other.sort(key=lambda p: p.pp_stage)  # stable: model order inside a stage
    plain = build_payload(
        gen_records,
        train_layout=facts.layout.as_plain(),
        gen_layout=gen.as_layout(),
        hf_config=dict(params.hf_config),
        other_params=[m.to_plain() for m in other],
        train_stage_ranks=[list(s.ranks) for s in placement.stages],
        rank_order=placement.rank_order,
    )
    return RefitPayload.of(plain), encode_payload(plain)


def build_train_side_plan(model: Any, *, gen_parallelism: Mapping, gen_world_size: int,
                          family: Optional[str] = None, vocab_size: Optional[int] = None,
                          packed_params: Optional[str] = None,
                          gen_quant: Optional[str] = None) -> TrainSidePlan:
    """The chain, in order (see the module doc); collective over the train world (one
    ``all_gather_object``), every train rank calls it."""
    gen = GenTarget.of(gen_parallelism, gen_world_size, gen_quant)
    facts = check_inputs(model, gen, family, vocab_size, packed_params)
    local = convert_local_params(facts, gen)
    reports, placement = gather_reports(facts, local)
    params = sort_params(facts, placement, reports, gen, packed_params)
    train_records, gen_records, counts = build_records(facts, placement, params, gen)
    payload, data = build_wire_payload(facts, placement, params, gen, gen_records)
    if gen.quant is None:
        train_records = payload  # the same params: one form
    return TrainSidePlan(facts=facts, gen=gen, local=local, placement=placement, params=params,
                         train_records=train_records, payload=payload, payload_bytes=data,
                         fp8_counts=None if counts is None else _frozen_map(counts))


__all__ = ["GenTarget", "LocalParams", "ModelFacts", "ParamSets", "RankPlacement",
           "TrainSidePlan", "build_records", "build_train_side_plan", "build_wire_payload",
           "check_inputs", "convert_local_params", "gather_reports", "sort_params"]
