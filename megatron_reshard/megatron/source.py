"""The train-side refit source: HF metadata, payload, live local views, full "other" tensors.

``MegatronRefitSource(model, ...)`` runs on every train rank. Construction does the local
checks (no collective), then exactly one ``all_gather_object`` over the default (train)
world carrying each rank's coordinates, global layer numbers, HF metadata of the params it
holds and any problem it found; after that every rank knows the whole model and layout.

Decisions:

- Bad input (parallel_state not initialised, expert-TP > 1 in a model with experts (a
  dense model takes Megatron's default expert TP = TP: it has no expert layout), VPP,
  unknown family, vocab larger than the model's) raises one ``BadInputError`` listing everything, on every rank,
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

Construction is ``train_plan.build_train_side_plan`` (a chain of plain functions ending in
one frozen ``TrainSidePlan``); this class is a thin face over it: the attributes callers
read are properties of the plan, ``sender.RefitSender`` takes the plan.

``hf_config`` keys (plain data; the receiver builds vLLM-layout targets from them):
``family, hidden_size, num_attention_heads, num_key_value_heads, head_dim,
intermediate_size, moe_intermediate_size, num_experts, num_hidden_layers, vocab_size,
tie_word_embeddings, gated, qk_norm`` and also ``num_experts_per_tok,
shared_expert_intermediate_size, moe_layers`` (global indexes of MoE layers),
``attention_bias, rms_norm_eps, torch_dtype``.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_reshard.errors import BadInputTypeError
from megatron_reshard.megatron.converters import full_from_tp_chunks
from megatron_reshard.megatron.expert_others import share_expert_tensors
from megatron_reshard.megatron.fp8_source import fp8_sender_specs
from megatron_reshard.megatron.gen_split import check_gen_attention_split
from megatron_reshard.megatron.local_specs import local_hf_views, local_param_specs, stacked_spec
from megatron_reshard.megatron.model_info import HF_CONFIG_KEYS
from megatron_reshard.megatron.parallel import StageMeshes, TrainParallelism
from megatron_reshard.megatron.train_plan import TrainSidePlan, build_train_side_plan
from megatron_reshard.wire.metadata import extract_layer_name
from megatron_reshard.wire.placement_rules import is_expert_param, is_nccl_reshard_param
from megatron_reshard.wire.records import RefitPayload
from megatron_reshard.wire.spec import HFToLocalParamMap


class MegatronRefitSource:
    """Train-side refit backend for one Megatron GPT model chunk (implements
    ``RefitBuilderInterface``): a thin face over its frozen ``TrainSidePlan`` (``plan``)."""

    def __init__(self, model: Any, *, gen_parallelism: dict, gen_world_size: int,
                 family: Optional[str] = None, vocab_size: Optional[int] = None,
                 packed_params: Optional[str] = None, gen_quant: Optional[str] = None):
        """``packed_params``: a regex; the HF params it matches (``re.search``) travel in the
        packed broadcast instead of shard to shard (every param has an exact path; this is
        the explicit way back to the broadcast, e.g. to compare the two).
        ``gen_quant="block_fp8"`` / ``"mxfp8"``: the generation model holds its linear
        weights in that FP8 format (``megatron_reshard.fp8.plan``); ``"block_fp8_online"``:
        vLLM quantizes a BF16 checkpoint into block FP8 itself (``--quantization
        fp8_per_block``): BF16 is sent and the generation ranks quantize with vLLM's own
        function (``receiver.online_quant``); None: the same dtype as training. Collective over the train world (``train_plan.build_train_side_plan``)."""
        check_gen_attention_split(model, gen_parallelism)  # before any collective
        self.plan: TrainSidePlan = build_train_side_plan(
            model, gen_parallelism=gen_parallelism, gen_world_size=gen_world_size, family=family,
            vocab_size=vocab_size, packed_params=packed_params, gen_quant=gen_quant)

    # ------------------------------------------------------------------ what callers read
    # (mappings are returned as plain dict copies: picklable, and the plan stays frozen)
    @property
    def stage(self) -> int:
        """This rank's PP stage."""
        return self.plan.stage

    @property
    def stage_local_rank(self) -> int:
        """This rank's rank among its stage's train ranks (its refit group rank)."""
        return self.plan.stage_local_rank

    @property
    def layout(self) -> TrainParallelism:
        """The training world's parallel sizes."""
        return self.plan.facts.layout

    @property
    def family(self) -> str:
        return self.plan.facts.family

    @property
    def vocab_size(self) -> int:
        """The real (HF) vocab size."""
        return self.plan.facts.vocab_size

    @property
    def gen_parallelism(self) -> dict:
        return self.plan.gen.as_parallelism()

    @property
    def gen_world_size(self) -> int:
        return self.plan.gen.world_size

    @property
    def gen_quant(self) -> Optional[str]:
        return self.plan.gen.quant

    @property
    def stages(self) -> tuple[StageMeshes, ...]:
        """Each PP stage's live train meshes (from the reported coordinates)."""
        return self.plan.placement.stages

    @property
    def rank_order(self) -> str:
        return self.plan.placement.rank_order

    @property
    def layer_to_pp_stage(self) -> dict[str, int]:
        return dict(self.plan.params.layer_to_pp_stage)

    @property
    def state_dict_metadata(self) -> dict[str, dict]:
        """HF metadata (global shapes) of the bulk params."""
        return dict(self.plan.params.bulk)

    @property
    def vocab_metadata(self) -> dict[str, dict]:
        return dict(self.plan.params.vocab)

    @property
    def exact_extra_metadata(self) -> dict[str, dict]:
        return dict(self.plan.params.exact_extra)

    @property
    def other_params_metadata(self) -> dict[str, dict]:
        return dict(self.plan.params.other)

    @property
    def hf_config(self) -> dict:
        """Plain dict, keys in ``HF_CONFIG_KEYS`` (a copy: the plan stays frozen)."""
        return dict(self.plan.params.hf_config)

    @property
    def wire(self) -> RefitPayload:
        """The payload as the frozen records the library reads."""
        return self.plan.payload

    @property
    def payload(self) -> dict:
        """The payload as plain data (a fresh copy of what ``payload_bytes()`` encodes)."""
        return self.plan.payload.to_plain()

    @functools.cached_property
    def refit_info(self) -> dict:
        """The seed's dict form of the train side's bulk records (NeMo-RL-compatible; the
        library reads ``plan.train_records``)."""
        return self.plan.train_records.to_refit_info()

    # ------------------------------------------------------------------ outputs
    def payload_bytes(self) -> bytes:
        """The msgpack payload (same bytes on every train rank; encoded once)."""
        return self.plan.payload_bytes

    def build_hf_to_local_param_map(self, refit_info: Optional[Any] = None) -> HFToLocalParamMap:
        """``hf_name → LocalParamSpec`` for every bulk param of this rank's PP stage, checked
        against the region the refit info's src mesh/placements assign to this rank
        (``refit_info``: records or a dict in wire or seed form; default: this source's)."""
        return local_param_map(self.plan, refit_info)

    def gather_other_params(self, names: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
        """Full HF tensors of this stage's non-bulk params (see ``gather_other_params``)."""
        return gather_other_params(self.plan, names)


def plan_of(source: Any, who: str) -> TrainSidePlan:
    """The ``TrainSidePlan`` of ``source`` (a plan, or a ``MegatronRefitSource``)."""
    if isinstance(source, TrainSidePlan):
        return source
    if isinstance(source, MegatronRefitSource):
        return source.plan
    raise BadInputTypeError(f"{who}: expected a MegatronRefitSource or its TrainSidePlan "
                            f"(megatron_reshard.megatron.train_plan), found "
                            f"{type(source).__module__}.{type(source).__name__}")


def local_param_map(plan: TrainSidePlan, refit_info: Optional[Any] = None) -> HFToLocalParamMap:
    """The live local views of this rank's bulk params (``MegatronRefitSource.build_hf_to_local_param_map``);
    sender-quantized and FP8-held weights wrapped when the generation side is FP8."""
    info = RefitPayload.of(refit_info) if refit_info is not None else plan.train_records
    facts = plan.facts
    views = local_hf_views(list(plan.local.converted), plan.params.exact_extra, facts.dims,
                           facts.coords.tp)
    specs = HFToLocalParamMap(local_param_specs(info, views, plan.stage, plan.stage_local_rank,
                                                plan.where()))
    if plan.gen.quant is not None and refit_info is None:
        return fp8_sender_specs(specs, plan.payload, plan.stage, dict(plan.local.fp8_views))
    return specs


@torch.no_grad()
def gather_other_params(plan: TrainSidePlan, names: Optional[Iterable[str]] = None
                        ) -> dict[str, torch.Tensor]:
    """Full HF tensors of this stage's non-bulk params (collective over this rank's TP group).

    Every rank of the TP group must call it, with the same ``names`` (None: all of them;
    the sender asks chunk by chunk to bound memory). Replicated params are returned as the
    live tensors (no copy); TP-sharded ones are gathered and converted (QKV
    de-interleaved, fc1 halves split, vocab padding stripped).
    """
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    facts, other = plan.facts, plan.params.other
    tp = facts.layout.tp
    out: dict[str, torch.Tensor] = {}
    wanted = None if names is None else set(names)
    for conv, tensor in plan.local.converted:
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
        for name, full in full_from_tp_chunks(conv, chunks, facts.dims).items():
            if name in other and (wanted is None or name in wanted):
                out[name] = full
    # per-expert params of the packed path (gpt-oss): the other EP ranks' experts too
    experts = [n for n in (names if names is not None else other)
               if n in other and is_expert_param(n)
               and plan.params.layer_to_pp_stage[extract_layer_name(n)] == plan.stage]
    share_expert_tensors(out, experts, dict(other), facts.num_local_experts,
                         next(facts.model.parameters()).device)
    return out


# HF_CONFIG_KEYS and stacked_spec live in model_info / local_specs; importable from here too
__all__ = ["HF_CONFIG_KEYS", "MegatronRefitSource", "TrainSidePlan", "gather_other_params",
           "local_param_map", "plan_of", "stacked_spec"]
