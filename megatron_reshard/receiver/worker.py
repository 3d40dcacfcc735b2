"""vLLM worker extension: the methods a trainer calls through ``collective_rpc``.

Torch + stdlib only. Phases, each with plain-data arguments and results:

1. ``init_refit_groups(host, ports_by_stage, group_rank, group_sizes, backend, timeout_s)``
   joins one refit group per training PP stage (``megatron_reshard.groups.comm.create_refit_group``);
   ``group_rank=None`` derives it from the worker's own rank (same arguments for all).
2. ``prepare_refit(payload, options=None)`` validates the whole payload and maps every HF
   name onto this rank's vLLM storage; a param the payload leaves unwritten is refused
   unless ``options["keep_as_loaded"]`` lists it (``receiver.coverage``). Local work; an error is raised here and posted on
   the groups' fault boards, so the training ranks raise it too within a second.
3. ``refit()`` receives the weights and commits (first call also compares plan
   fingerprints); the weights' version advances only when every rank got every param,
   and only upwards (``refit.version``: a lower one is refused before bytes move).
4. ``report()`` returns what was received, how long it took and the weights' state;
   ``refit_weights_state()`` / ``check_refit_weights_consistent()`` tell whether a failed
   refit left mixed weights (see ``receiver.state``).

vLLM mixes this class into its worker class (``worker_extension_cls``), so no ``__init__``
of ours runs: state lives in one attribute created on first use. The model comes from
``get_refit_model()`` (``self.model_runner.model`` in vLLM); override it to refit any
module whose ``named_parameters()`` have vLLM's per-rank names and shapes.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron_reshard.errors import BadInputError, BadInputTypeError, CallOrderError
from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.groups.faults import fault_scope
from megatron_reshard.receiver.derived import (
    DerivedWeightsError,
    derived_param_names,
    refresh_derived_weights,
)
from megatron_reshard.receiver.kernel_layouts import storage_orders
from megatron_reshard.receiver.misc_transport import receive_misc_packed
from megatron_reshard.receiver.session import ReceiverSession
from megatron_reshard.receiver.staged_conversion import (
    StagedConversionError,
    StagedConversions,
    staged_layers,
)
from megatron_reshard.receiver.state import WeightState

_PREPARE_OPTIONS = ("num_streams", "batch_bytes", "staging_bytes", "strided_in_place",
                    "verify_checksums", "keep_as_loaded")


def _per_stage(value: Union[Sequence, Mapping, int], what: str) -> dict[int, Any]:
    if isinstance(value, Mapping):
        return {int(k): v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return dict(enumerate(value))
    raise BadInputTypeError(f"{what} must be a list (index = PP stage) or a dict stage -> value, "
                    f"got {type(value).__name__}")


class MegatronReshardWorkerExtension:
    """Receiver side of megatron_reshard, callable through vLLM's ``collective_rpc``."""

    # -- overridable -------------------------------------------------------------------

    def get_refit_model(self) -> torch.nn.Module:
        """The module to refit; vLLM keeps it at ``self.model_runner.model``."""
        return self.model_runner.model

    def receive_misc(self, stage: int, group: Optional[Any], items: list) -> Mapping[str, torch.Tensor]:
        """Full HF tensors of the stage's params outside the bulk path.

        Default: the packed broadcast from the stage's group rank 0 (the first train rank
        of the stage) of all ``items`` ``(name, shape, dtype)`` in payload order.
        """
        return receive_misc_packed(stage, group, items, self._refit_device())

    def get_refit_tp_coords(self) -> Optional[tuple[int, int]]:
        """``(tp_rank, tp_size)`` as vLLM reports it, to cross-check the payload; None if unknown.

        Looks vLLM's parallel state up only if vLLM already loaded it (no import here).
        """
        ps = sys.modules.get("vllm.distributed.parallel_state")
        if ps is None:
            return None
        try:
            return int(ps.get_tensor_model_parallel_rank()), int(ps.get_tensor_model_parallel_world_size())
        except Exception:
            return None

    def get_refit_act_dtype(self) -> Optional[torch.dtype]:
        """vLLM's model dtype (what vLLM passes to the post-load step of its attention
        layers), from the worker's ``model_config`` where it has one; None lets
        ``receiver.derived`` read it off the derived tensors."""
        return getattr(getattr(self, "model_config", None), "dtype", None)

    # -- state ---------------------------------------------------------------------------

    def _refit_state(self) -> dict:
        state = self.__dict__.get("_megatron_reshard_state")
        if state is None:
            # the weights' state belongs to the model: it outlives groups and sessions
            state = {"groups": None, "group_rank": None, "session": None,
                     "weights": WeightState()}
            self.__dict__["_megatron_reshard_state"] = state
        return state

    def _refit_device(self) -> torch.device:
        for p in self.get_refit_model().parameters():
            return p.device
        return torch.device("cpu")

    def _refit_session(self) -> ReceiverSession:
        session = self._refit_state()["session"]
        if session is None:
            raise CallOrderError("refit called before prepare_refit(payload)")
        return session

    # -- phases --------------------------------------------------------------------------

    def get_refit_gen_coords(self) -> tuple[int, int]:
        """``(gen_rank, gen_world)``: this worker's rank among the generation workers.

        vLLM's world group where vLLM is loaded, else the default torch.distributed world
        (one generation world per launch). Override it for other launchers."""
        ps = sys.modules.get("vllm.distributed.parallel_state")
        if ps is not None:
            world = ps.get_world_group()
            return int(world.rank_in_group), int(world.world_size)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CallOrderError("init_refit_groups(group_rank=None) needs vLLM's or the default "
                               "torch.distributed world to derive this worker's rank; pass "
                               "group_rank or override get_refit_gen_coords()")
        return dist.get_rank(), dist.get_world_size()

    def init_refit_groups(self, host: str, ports_by_stage: Union[Sequence[int], Mapping],
                          group_rank: Optional[int], group_sizes: Union[int, Sequence[int], Mapping],
                          backend: str = "nccl", timeout_s: float = 600.0) -> dict:
        """Join one refit group per PP stage (stage -> TCPStore port); same rank in each.

        ``group_rank=None`` (what ``collective_rpc`` can send to every worker alike): each
        worker takes ``group_size - gen_world + gen_rank`` from ``get_refit_gen_coords()``,
        the training ranks of a stage coming first in its group."""
        ports = _per_stage(ports_by_stage, "ports_by_stage")
        sizes = ({s: int(group_sizes) for s in ports} if isinstance(group_sizes, int)
                 else _per_stage(group_sizes, "group_sizes"))
        if set(sizes) != set(ports):
            raise BadInputError(f"ports_by_stage has stages {sorted(ports)}, group_sizes has {sorted(sizes)}")
        if group_rank is None:
            gen_rank, gen_world = self.get_refit_gen_coords()
            derived = {s: n - gen_world + gen_rank for s, n in sizes.items()}
            if len(set(derived.values())) != 1:
                raise BadInputError(f"group_sizes {sizes} give this worker (gen rank {gen_rank} of "
                                 f"{gen_world}) different ranks per stage {derived}; every stage "
                                 f"group needs the same number of training ranks")
            group_rank = next(iter(derived.values()))
        groups = {}
        for stage in sorted(ports):
            groups[stage] = create_refit_group(
                host, int(ports[stage]), int(group_rank), int(sizes[stage]), backend,
                float(timeout_s), who=f"generation worker at refit group rank {group_rank}",
                label=f"refit group of PP stage {stage}")
        state = self._refit_state()
        state.update(groups=groups, group_rank=int(group_rank), session=None)
        return {"stages": sorted(groups), "group_rank": int(group_rank)}

    def prepare_refit(self, payload: dict, options: Optional[dict] = None) -> dict:
        """Map the payload onto this rank's storage (no communication). Returns a summary.

        ``options``: ``num_streams``, ``batch_bytes``, ``staging_bytes``,
        ``strided_in_place``, ``verify_checksums`` (must match the sender's) and
        ``keep_as_loaded``: vLLM param names or fnmatch patterns that the payload does not
        write and may keep what was loaded (any other such param is refused here, on every
        rank; see ``receiver.coverage``). Params vLLM derives itself (MLA's absorbed
        weights) are never refit targets and need no listing."""
        state = self._refit_state()
        if state["groups"] is None:
            raise CallOrderError("prepare_refit called before init_refit_groups")
        options = dict(options or {})
        unknown = sorted(set(options) - set(_PREPARE_OPTIONS))
        if unknown:
            raise BadInputError(f"unknown prepare_refit options {unknown}; known: {list(_PREPARE_OPTIONS)}")
        state["session"] = None
        model = self.get_refit_model()
        derived = derived_param_names(model)  # recomputed after each refit, never received
        with fault_scope(state["groups"].values()):  # a refusal reaches the training ranks too
            # layers vLLM's post-load converts by computing (block FP8): received in
            # checkpoint order, converted by vLLM's code after each refit
            staged = staged_layers(model, skip=derived)
            orders = storage_orders(model, skip=derived,  # how vLLM's post-load stored them
                                    staged={layer.name for layer in staged})
        # a staged param vLLM re-allocated in a kernel's shape is received through a
        # checkpoint-shaped view of its storage
        views = {n: v for layer in staged for n, v in layer.receive_views().items()}
        targets = [(n, views.get(n, p)) for n, p in model.named_parameters() if n not in derived]
        session = ReceiverSession(payload, targets, state["groups"],
                                  receive_misc=self.receive_misc, vllm_tp=self.get_refit_tp_coords(),
                                  weights=state["weights"], storage_orders=orders, **options)
        state["session"] = session
        state["staged"] = StagedConversions(staged)
        report = session.report()
        return {k: report[k] for k in ("rank_in_group", "gen_rank", "tp_rank", "tp_size", "ep_rank",
                                       "ep_size", "params", "misc_params", "plan_fingerprints",
                                       "uncovered_targets", "kept_as_loaded")}

    def refit(self) -> dict:
        """Receive all weights once (bulk + other params) and commit; returns this refit's
        numbers, ``version`` included. On failure it raises, and ``refit_weights_state()``
        says what the storage holds. Weights vLLM derives from the refitted params (MLA's
        absorbed ``kv_b_proj`` copies) are recomputed after the commit, in their storage, by
        vLLM's own layer method (``receiver.derived``; listed under ``derived_refreshed``);
        if that is impossible the weights are marked inconsistent."""
        session = self._refit_session()
        stats = session.refit()
        model = self.get_refit_model()
        self._convert_staged(session, stats)  # before MLA's refresh, as vLLM's loader orders them
        try:
            stats["derived_staging"] = {}
            stats["derived_refreshed"] = refresh_derived_weights(
                model, session.targets.params.values(), self.get_refit_act_dtype(),
                stats=stats["derived_staging"])
        except DerivedWeightsError as err:
            weights = self._refit_state()["weights"]
            weights.writing(n for n, _ in model.named_parameters() if "kv_b_proj" in n)
            weights.failed(str(err))
            raise
        return stats

    def _convert_staged(self, session: ReceiverSession, stats: dict) -> None:
        """vLLM's own conversion of the layers the refit wrote in checkpoint order
        (``receiver.staged_conversion``), layer by layer into the same storage."""
        staged = self._refit_state().get("staged")
        if staged is None or not staged.layers:
            return
        try:
            staged.received(session.targets.params.values())
            stats["staged_converted"] = staged.convert()
        except StagedConversionError as err:
            weights = self._refit_state()["weights"]
            weights.writing(sorted(staged.param_names))
            weights.failed(str(err))
            raise
        finally:
            session.forget_delta_base()  # converted bytes are no base for a delta
        stats["staged_conversion"] = staged.report()

    def refit_weights_state(self) -> dict:
        """The weights' version and consistency (``receiver.state.WeightState.as_dict``):
        ``{"state": "consistent" | "inconsistent", "version", "started_from",
        "overwritten": [names], "not_refitted": [names kept as loaded], "refits",
        "failed_refits", "last_error"}``."""
        return self._refit_state()["weights"].as_dict()

    def check_refit_weights_consistent(self) -> None:
        """Raise ``InconsistentWeightsError`` while a failed refit left mixed weights: call
        it before generating to refuse generation from a half-updated policy."""
        self._refit_state()["weights"].require_consistent()

    def release_refit_staging(self) -> None:
        """Give back the CUDA staging memory the refit keeps between refits (two slots of
        half the staging budget per stage stream), e.g. before vLLM sleeps; the next
        refit allocates it again."""
        session = self._refit_state()["session"]
        if session is not None:
            session.release_staging()

    def destroy_refit_groups(self, timeout_s: float = 60.0) -> None:
        """Shut the refit groups down at the end of the job (``groups.destroy_refit_group``;
        every rank of each group, the training ranks too, does the same) and drop the
        session: a later refit needs ``init_refit_groups`` and ``prepare_refit`` again."""
        state = self._refit_state()
        groups, state["groups"], state["session"] = state["groups"] or {}, None, None
        for stage in sorted(groups):
            destroy_refit_group(groups[stage], timeout_s)

    def report(self) -> dict:
        """Plain-data summary: params, bytes received, timings, target params left unwritten."""
        state = self._refit_state()
        if state["session"] is None:
            return {"prepared": False, "weights": state["weights"].as_dict()}
        staged = state.get("staged")
        return {"prepared": True, **state["session"].report(),
                **({"staged_conversion": staged.report()} if staged and staged.layers else {})}
