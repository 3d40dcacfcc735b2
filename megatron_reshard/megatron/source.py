"""The train-side refit source: HF metadata, payload, live local views, full "other" tensors.

``MegatronRefitSource(model, ...)`` runs on every train rank. Construction does the local
checks (no collective), then exactly one ``all_gather_object`` over the default (train)
world carrying each rank's coordinates, global layer numbers, HF metadata of the params it
holds and any problem it found; after that every rank knows the whole model and layout.

Decisions:

- Bad input (parallel_state not initialised, expert-TP > 1 in a model with experts (a
  dense model takes Megatron's default expert TP = TP: it has no expert layout), VPP,
  unknown family, vocab larger than the model's) raises one ``ValueError`` listing everything, on every rank,
  before any collective. Unknown parameter names can differ between PP stages, so they
  travel in the one gather and every rank raises the same error listing all of them with
  their ranks (no rank is left waiting in a collective).
- Metadata holds GLOBAL HF shapes. Bulk params (``is_nccl_reshard_param``) go to
  ``build_nccl_reshard_refit_info``; per-expert names are grouped there. Its train meshes
  are then replaced by the meshes built from the reported coordinates (identical under the
  default rank order; the real rank tensor otherwise).
- Vocab: Megatron pads the vocab to a multiple of ``make_vocab_size_divisible_by · TP``; HF
  tensors have the ``vocab_size`` real rows. Full tensors strip the padding rows;
  ``vocab_size=None`` means "no padding" (the model's vocab is the real one).
- Layer keys (``model.layers.N``, N = ``layer_number - 1``) come from the live layers, so
  uneven first/last stages need nothing special. Non-layer keys: ``model.embed_tokens`` on
  the stage holding the embedding, ``model.norm`` and ``lm_head`` on the stage holding the
  final norm / output layer. Tied embeddings: no ``lm_head.weight`` (HF ties it).
- Every param takes the exact path (bulk set, vocab padded shards, q/k/v weights and
  biases per KV group, direct params of ``vllm_layout.dense.TP_DIM_RULES``: o_proj, norms,
  router, shared experts and their gate); ``packed_params`` (a regex) sends the params it
  matches by packed broadcast instead.
- Views: dense ``gate_proj``/``up_proj`` are the two row halves of the rank's ``linear_fc1``
  (views); ``down_proj`` is ``linear_fc2`` itself. Grouped experts: the rank's experts are
  given to the engine as a list, one tensor per expert (SequentialMLP / TE grouped; the
  engine reads each box from the expert tensors where they are, no stacking copy); legacy
  grouped GEMM weights are already one tensor, so the grouped view is a strided view.

``hf_config`` keys (plain data; the receiver builds vLLM-layout targets from them):
``family, hidden_size, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, moe_intermediate_size, num_experts, num_hidden_layers, vocab_size,
tie_word_embeddings, gated, qk_norm`` and also ``num_experts_per_tok,
shared_expert_intermediate_size, moe_layers`` (global indexes of MoE layers),
``attention_bias, rms_norm_eps, torch_dtype``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputError
from megatron_reshard.fp8.plan import GEN_QUANT_FORMATS, plan_block_fp8, plan_mxfp8
from megatron_reshard.layout.placements import build_mesh_info
from megatron_reshard.wire.placement_rules import is_expert_param, is_nccl_reshard_param
from megatron_reshard.megatron import mla, nemotron_h, qwen3_next, unsupported_families
from megatron_reshard.megatron.converters import (
    Converted,
    ModelDims,
    NameConverter,
    full_from_tp_chunks,
    hf_global_shapes,
)
from megatron_reshard.megatron.exact_path import VOCAB_PARAMS, add_exact_extras
from megatron_reshard.megatron.expert_others import share_expert_tensors
from megatron_reshard.megatron.families import FAMILIES
from megatron_reshard.megatron.fp8_source import fp8_sender_specs, grouped_name, train_fp8_views
from megatron_reshard.megatron.local_specs import local_hf_views, local_param_specs, stacked_spec
from megatron_reshard.megatron.model_info import (
    HF_CONFIG_KEYS,
    hf_config,
    infer_family,
    named_tensors,
    unwrap_model,
)
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
from megatron_reshard.megatron.payload import build_payload, encode_payload
from megatron_reshard.megatron.qkv import qkv_groups_fit
from megatron_reshard.megatron.rank_reports import merge_reports
from megatron_reshard.wire.metadata import build_nccl_reshard_refit_info, extract_layer_name
from megatron_reshard.wire.spec import HFToLocalParamMap
from megatron_reshard.vllm_layout.dense import NOT_LISTED, QKV_PARAM_RE, tp_dim_of
from megatron_reshard.wire.records import MiscRecord, ParamRecord, RefitPayload


class MegatronRefitSource:
    """Train-side refit backend for one Megatron GPT model chunk (implements ``RefitBuilderInterface``)."""

    def __init__(self, model: Any, *, gen_parallelism: dict, gen_world_size: int,
                 family: Optional[str] = None, vocab_size: Optional[int] = None,
                 packed_params: Optional[str] = None, gen_quant: Optional[str] = None):
        """``packed_params``: a regex; the HF params it matches (``re.search``) travel in the
        packed broadcast instead of shard to shard (every param has an exact path; this is
        the explicit way back to the broadcast, e.g. to compare the two).
        ``gen_quant="block_fp8"``: the generation model holds its linear weights in block
        FP8 (``megatron_reshard.fp8.plan``); None: the same dtype as training.

        The steps, in order: check the inputs (no collective), convert this rank's params,
        the one gather of every rank's report, sort the params by path, build the refit
        records (FP8 planned), build the payload."""
        self.gen_quant = gen_quant
        self.gen_parallelism = dict(gen_parallelism)
        self.gen_world_size = gen_world_size
        self._check_inputs(model, family, vocab_size, packed_params)
        report = self._convert_local_params()
        reports = self._gather_reports(report)
        self._sort_params(reports, packed_params)
        self._build_records(frozenset(n for r in reports for n in r["fp8"]))
        self._build_payload()

    # ------------------------------------------------------------------ construction steps
    def _check_inputs(self, model: Any, family: Optional[str], vocab_size: Optional[int],
                      packed_params: Optional[str]) -> None:
        """Parallel state, model, family, vocab and options: one ValueError listing every
        problem, on every rank, before any collective. Sets what the later steps read."""
        bare, model_problems = unwrap_model(model)
        config = getattr(bare, "config", None)
        # expert TP (Megatron's default: the TP size) is refused only where experts exist
        par, coords, problems = read_parallel_state(
            has_experts=config is None or bool(getattr(config, "num_moe_experts", None)))
        problems += model_problems
        if self.gen_quant not in (None, *GEN_QUANT_FORMATS):
            problems.append(f"gen_quant={self.gen_quant!r}: expected None or one of "
                            f"{list(GEN_QUANT_FORMATS)}")
        if bare is not None:
            chosen = family if family is not None else infer_family(config)
            refused = unsupported_families.family_problem(chosen)
            if refused is not None:
                problems.append(refused)
            elif chosen is None:
                problems.append("cannot infer the model family of a MoE model with shared experts: pass "
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
        if problems:
            raise BadInputError("cannot build the Megatron refit source:\n  - " + "\n  - ".join(problems))
        assert par is not None and coords is not None and bare is not None

        self.model = bare
        self.config = config
        self.family: str = family  # type: ignore[assignment]
        self.layout: TrainParallelism = par  # the training world's parallel sizes
        self.coords: RankCoords = coords
        self.vocab_size: int = int(vocab_size)  # type: ignore[arg-type]
        n_experts = int(getattr(config, "num_moe_experts", None) or 0)
        self.num_local_experts = n_experts // par.ep if n_experts else 0
        self._mla_down_is_replicated = mla.down_projections_replicated(bare)
        self.dims = ModelDims(
            tp_size=par.tp,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels,
            vocab_size=self.vocab_size,
            gated=bool(config.gated_linear_unit),
            num_local_experts=self.num_local_experts,
            linear=qwen3_next.LinearAttentionDims.from_config(config),
        )

    def _convert_local_params(self) -> dict:
        """This rank's Megatron params as HF params (no collective): the conversions and
        live tensors the source keeps, and this rank's report for the gather
        (``rank_reports``)."""
        bare, coords = self.model, self.coords
        global_layer = {i: int(layer.layer_number) - 1 for i, layer in enumerate(bare.decoder.layers)}
        converter = NameConverter(
            family=self.family, global_layer=global_layer,
            expert_offset=coords.ep * self.num_local_experts, num_local_experts=self.num_local_experts,
            gated=self.dims.gated, tied_embeddings=bool(getattr(bare, "share_embeddings_and_output_weights", False)),
            mla_down_replicated=self._mla_down_is_replicated,
        )
        tensors = named_tensors(bare)
        by_name = dict(tensors)
        converted, unknown = converter.convert_all([n for n, _ in tensors])
        self._converted: list[tuple[Converted, torch.Tensor]] = [(c, by_name[c.megatron_name]) for c in converted]
        local_meta: dict[str, dict] = {}
        rank_problems = [f"rank {coords.rank}: unknown Megatron parameter {n!r} for family {self.family!r}"
                         for n in unknown]
        for conv, tensor in self._converted:
            try:
                shapes = hf_global_shapes(conv, tensor.shape, self.dims)
            except ValueError as err:
                rank_problems.append(f"rank {coords.rank}: {err}")
                continue
            for hf_name, shape in shapes.items():
                local_meta[hf_name] = {"shape": shape, "dtype": str(tensor.dtype)}

        # weights held in blockwise FP8 for training (fp8_param): their bytes and scales travel
        self._fp8_views, fp8_problems = (train_fp8_views(self._converted, self.dims, tp_rank=coords.tp)
                                         if self.gen_quant is not None else ({}, []))
        rank_problems += [f"rank {coords.rank}: {p}" for p in fp8_problems]
        return {
            "coords": coords_to_plain(coords),
            "layers": sorted(global_layer.values()),
            "meta": local_meta,
            "problems": rank_problems,
            "fp8": sorted({grouped_name(n) for n in self._fp8_views}),
        }

    def _gather_reports(self, report: dict) -> list:
        """The one collective: every rank's report, on every rank. Any rank's problem
        raises on all of them; then the stages' meshes from the reported coordinates."""
        par, coords = self.layout, self.coords
        reports: list = [None] * par.world_size
        dist.all_gather_object(reports, report)

        all_problems = [p for r in reports for p in r["problems"]]
        if all_problems:
            raise BadInputError("cannot build the Megatron refit source:\n  - " + "\n  - ".join(all_problems))
        self._all_coords = [coords_from_plain(r["coords"]) for r in reports]
        self.rank_order = describe_rank_order(self._all_coords, par)
        try:
            self.stages: list[StageMeshes] = build_stage_meshes(self._all_coords, par)
        except ValueError as err:
            raise BadInputError(f"unsupported Megatron rank order (found: {self.rank_order}): {err}") from None
        self.stage = coords.pp
        self.stage_local_rank = self.stages[self.stage].local_rank(coords.rank)
        return reports

    def _sort_params(self, reports: list, packed_params: Optional[str]) -> None:
        """The whole model's HF metadata, sorted by path: bulk, exact extras (vocab padded
        shards, q/k/v per KV group, direct and MLA params), packed others."""
        metadata, stage_of_key = merge_reports(reports, self._all_coords, int(self.config.num_layers))
        self.layer_to_pp_stage: dict[str, int] = stage_of_key
        self.state_dict_metadata = {n: m for n, m in metadata.items() if is_nccl_reshard_param(n)}
        # Vocab matrices are the largest params outside the FFN: they take the exact path too,
        # as padded shards (Megatron's and vLLM's paddings differ; padding never travels).
        self.vocab_metadata = {n: m for n, m in metadata.items() if n in VOCAB_PARAMS}
        # Attention output, norms and router have plain layouts on both sides: exact path too.
        # gated attention's q/k/v (Qwen3-Next) are not in the per-group form: packed
        grouped_qkv = qkv_groups_fit(self.dims, self.layout.tp, int(self.gen_parallelism.get("tp_size", 1))) \
            and not getattr(self.config, "attention_output_gate", False)
        forced = re.compile(packed_params) if packed_params else None
        self.exact_extra_metadata = {n: m for n, m in metadata.items()
                                     if not is_nccl_reshard_param(n)
                                     and not (forced and forced.search(n))
                                     and (n in VOCAB_PARAMS or tp_dim_of(n) != NOT_LISTED
                                          or (grouped_qkv and QKV_PARAM_RE.search(n))
                                          or self._mla_tp_dims(n) is not None)}
        self.other_params_metadata = {n: m for n, m in metadata.items()
                                      if not is_nccl_reshard_param(n) and n not in self.exact_extra_metadata}
        self.hf_config = hf_config(self.model, self.family, self.vocab_size, metadata)

    def _build_records(self, train_fp8: frozenset) -> None:
        """The refit records: the train side's view (``records``, its seed dict form
        ``refit_info``) and the generation side's (``gen_records``: FP8 planned)."""
        par = self.layout
        # the seed's dict form, parsed once into records; every step after makes new records
        info = RefitPayload.of(build_nccl_reshard_refit_info(
            self.state_dict_metadata,
            {"tp_size": par.tp, "ep_size": par.ep, "pp_size": par.pp},
            self.gen_parallelism, par.world_size, self.gen_world_size,
            self.layer_to_pp_stage if par.pp > 1 else None,
        ))
        info = self._add_exact_extras(self._use_live_meshes(info), self.layer_to_pp_stage)
        self.records: RefitPayload = info  # bulk refit info, train side's view (no FP8 plan)
        # the seed's dict form of it, for callers (NeMo-RL-compatible; the library reads records)
        self.refit_info = info.to_refit_info()
        if self.gen_quant is not None:  # the payload's entries say where each weight is quantized
            if self.gen_quant == "mxfp8":  # quantized on the receiver (NeMo-RL's is_mx path)
                if train_fp8:
                    raise BadInputError(f"gen_quant='mxfp8' with weights held in blockwise FP8 for "
                                     f"training ({len(train_fp8)}, e.g. {min(train_fp8)}): MXFP8 "
                                     f"generation is quantized from BF16 training weights only")
                info, self.fp8_counts = plan_mxfp8(info, par.world_size // par.pp)
            else:
                info, self.fp8_counts = plan_block_fp8(info, par.world_size // par.pp,
                                                       train_fp8=train_fp8)
            planned = {p.name for p in info.params()}
            packed = sorted(train_fp8 - planned)
            if packed:  # the packed path sends full BF16 tensors: the FP8 bytes would be lost
                raise BadInputError(f"weights held in blockwise FP8 for training must take the exact "
                                 f"path, but these would go packed: {packed}")
        self.gen_records: RefitPayload = info  # what the generation side gets (FP8 planned)

    def _build_payload(self) -> None:
        """The payload: the generation records plus the extras, as plain data (``payload``,
        what goes on the wire) and as the records the library reads (``wire``)."""
        gen = self.gen_parallelism
        other = [MiscRecord(n, tuple(m["shape"]), m["dtype"],
                            self.layer_to_pp_stage[extract_layer_name(n)])
                 for n, m in self.other_params_metadata.items()]
        other.sort(key=lambda p: p.pp_stage)  # stable: model order inside a stage
        self.payload = build_payload(
            self.gen_records,
            train_layout=self.layout.as_plain(),
            gen_layout={"tp": int(gen.get("tp_size", 1)), "ep": int(gen.get("ep_size", 1)),
                        "pp": int(gen.get("pp_size", 1)), "world_size": int(self.gen_world_size)},
            hf_config=self.hf_config,
            other_params=[m.to_plain() for m in other],
            train_stage_ranks=[list(s.ranks) for s in self.stages],
            rank_order=self.rank_order,
        )
        # ``payload`` stays plain data for callers (it is what goes on the wire); the
        # library reads this typed view of it
        self.wire: RefitPayload = RefitPayload.of(self.payload)

    # ------------------------------------------------------------------ construction helpers
    def _use_live_meshes(self, info: RefitPayload) -> RefitPayload:
        """The refit info with the formula-built train meshes replaced by the ones built
        from reported coordinates."""
        def live_mesh(p: ParamRecord) -> ParamRecord:
            stage = self.stages[p.stage]
            live = stage.expert if is_expert_param(p.name) else stage.dense
            if live.shape != p.src_mesh_info.shape:
                raise BadInputError(f"{p.name}: live train mesh {live} does not have the shape of the "
                                 f"refit info's {p.src_mesh_info} (rank order {self.rank_order})")
            return dataclasses.replace(p, src_mesh_info=live)

        return info.map_params(live_mesh)

    def _add_exact_extras(self, info: RefitPayload, stage_of_key: dict) -> RefitPayload:
        """The refit info with the exact extras appended (``exact_path.add_exact_extras``)."""
        gen_tp = int(self.gen_parallelism.get("tp_size", 1))
        stage_world = self.layout.world_size // self.layout.pp
        gen = build_mesh_info(self.gen_world_size, stage_world, tp_size=gen_tp)
        return add_exact_extras(info, self.exact_extra_metadata, stage_of_key, self.stages, gen,
                         padded_train_vocab=int(self.model.vocab_size), dims=self.dims,
                         pp=self.layout.pp, mla_tp_dims=self._mla_tp_dims)

    def _mla_tp_dims(self, name: str) -> Optional[tuple[Optional[int], Optional[int]]]:
        """(train, gen) TP dims of an MLA / DeepSeek MoE param on the exact path, else None."""
        return mla.exact_path_tp_dims(name, mla.is_mla(self.config), self._mla_down_is_replicated)

    # ------------------------------------------------------------------ outputs
    def payload_bytes(self) -> bytes:
        """The msgpack payload (same bytes on every train rank)."""
        return encode_payload(self.payload)

    def build_hf_to_local_param_map(self, refit_info: Optional[Any] = None) -> HFToLocalParamMap:
        """``hf_name → LocalParamSpec`` for every bulk param of this rank's PP stage, checked
        against the region the refit info's src mesh/placements assign to this rank
        (``refit_info``: records or a dict in wire or seed form; default: this source's)."""
        info = RefitPayload.of(refit_info) if refit_info is not None else self.records
        views = local_hf_views(self._converted, self.exact_extra_metadata, self.dims, self.coords.tp)
        me = f"rank {self.coords.rank} (PP stage {self.stage}, stage-local rank {self.stage_local_rank})"
        specs = local_param_specs(info, views, self.stage, self.stage_local_rank, me)
        if self.gen_quant is not None and refit_info is None:
            return fp8_sender_specs(HFToLocalParamMap(specs), self.gen_records, self.stage,
                                    self._fp8_views)
        return HFToLocalParamMap(specs)

    @torch.no_grad()
    def gather_other_params(self, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        """Full HF tensors of this stage's non-bulk params (collective over this rank's TP group).

        Every rank of the TP group must call it, with the same ``names`` (None: all of them;
        the sender asks chunk by chunk to bound memory). Replicated params are returned as the
        live tensors (no copy); TP-sharded ones are gathered and converted (QKV
        de-interleaved, fc1 halves split, vocab padding stripped).
        """
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        tp = self.layout.tp
        out: dict[str, torch.Tensor] = {}
        wanted = None if names is None else set(names)
        for conv, tensor in self._converted:
            if all(is_nccl_reshard_param(n) for n in conv.hf_names):
                continue
            if wanted is not None and wanted.isdisjoint(conv.hf_names):
                continue  # same skip on every TP rank: the conversions are identical there
            local = tensor.detach()
            if conv.tp_dim is not None and tp > 1:
                chunks = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(chunks, local.contiguous(), group=group)
            else:
                chunks = [local]
            for name, full in full_from_tp_chunks(conv, chunks, self.dims).items():
                if name in self.other_params_metadata and (wanted is None or name in wanted):
                    out[name] = full
        # per-expert params of the packed path (gpt-oss): the other EP ranks' experts too
        experts = [n for n in (names if names is not None else self.other_params_metadata)
                   if n in self.other_params_metadata and is_expert_param(n)
                   and self.layer_to_pp_stage[extract_layer_name(n)] == self.stage]
        share_expert_tensors(out, experts, self.other_params_metadata, self.num_local_experts,
                             next(self.model.parameters()).device)
        return out


# HF_CONFIG_KEYS and stacked_spec live in model_info / local_specs; importable from here too
__all__ = ["HF_CONFIG_KEYS", "MegatronRefitSource", "stacked_spec"]
