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
4. staged refits (``prepare_refit(payload, {"staged": True})``, ``receiver.staging``):
   ``start_staged_refit()`` starts the receive into staging tensors on the worker's own
   thread and returns; vLLM keeps generating from the live weights; ``wait_staged_refit()``
   until staged; ``flip_staged_refit()`` inside vLLM's pause makes it live (local copies);
   ``discard_staged_refit()`` drops it. A failure before the flip leaves the live weights
   consistent at their version.
5. ``report()`` returns what was received, how long it took and the weights' state;
   ``refit_weights_state()`` / ``check_refit_weights_consistent()`` tell whether a failed
   refit left mixed weights (see ``receiver.state``).

vLLM mixes this class into its worker class (``worker_extension_cls``), so no ``__init__``
of ours runs: the state is one ``receiver.worker_state.RefitWorkerState`` (groups, session,
options, weights), created on first use (``refit_worker_state``). Each method is the RPC
edge over it: the state's typed results become plain dicts here. The model comes from
``get_refit_model()`` (``self.model_runner.model`` in vLLM); override it to refit any
module whose ``named_parameters()`` have vLLM's per-rank names and shapes.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron_reshard.receiver.misc_transport import receive_misc_packed
from megatron_reshard.receiver.worker_state import (
    RefitWorkerState,
    model_device,
    vllm_gen_coords,
    vllm_tp_coords,
)

_STATE_ATTR = "_megatron_reshard_state"


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
        return receive_misc_packed(stage, group, items, model_device(self.get_refit_model()))

    def get_refit_tp_coords(self) -> Optional[tuple[int, int]]:
        """``(tp_rank, tp_size)`` as vLLM reports it, to cross-check the payload; None if unknown.

        Looks vLLM's parallel state up only if vLLM already loaded it (no import here).
        """
        return vllm_tp_coords()

    def get_refit_act_dtype(self) -> Optional[torch.dtype]:
        """vLLM's model dtype (what vLLM passes to the post-load step of its attention
        layers), from the worker's ``model_config`` where it has one; None lets
        ``receiver.derived`` read it off the derived tensors."""
        return getattr(getattr(self, "model_config", None), "dtype", None)

    def get_refit_gen_coords(self) -> tuple[int, int]:
        """``(gen_rank, gen_world)``: this worker's rank among the generation workers.

        vLLM's world group where vLLM is loaded, else the default torch.distributed world
        (one generation world per launch). Override it for other launchers."""
        return vllm_gen_coords()

    # -- state ---------------------------------------------------------------------------

    @property
    def refit_worker_state(self) -> RefitWorkerState:
        """This worker's refit groups, session, options and weight state (one object,
        created on first use: vLLM runs no ``__init__`` of a worker extension)."""
        state = self.__dict__.get(_STATE_ATTR)
        if state is None:
            state = self.__dict__[_STATE_ATTR] = RefitWorkerState()
        return state

    # -- phases (the RPC edge: plain data in and out) ---------------------------------------

    def init_refit_groups(self, host: str, ports_by_stage: Union[Sequence[int], Mapping],
                          group_rank: Optional[int], group_sizes: Union[int, Sequence[int], Mapping],
                          backend: str = "nccl", timeout_s: float = 600.0) -> dict:
        """Join one refit group per PP stage (stage -> TCPStore port); same rank in each.

        ``group_rank=None`` (what ``collective_rpc`` can send to every worker alike): each
        worker takes ``group_size - gen_world + gen_rank`` from ``get_refit_gen_coords()``,
        the training ranks of a stage coming first in its group."""
        return self.refit_worker_state.join_groups(
            host, ports_by_stage, group_rank, group_sizes, backend, timeout_s,
            gen_coords=self.get_refit_gen_coords).as_dict()

    def prepare_refit(self, payload: dict, options: Optional[dict] = None) -> dict:
        """Map the payload onto this rank's storage (no communication). Returns a summary.

        ``options`` (``receiver.worker_state.PrepareOptions``'s fields): ``num_streams``,
        ``batch_bytes``, ``staging_bytes``, ``strided_in_place``, ``verify_checksums``
        (must match the sender's), ``planner`` and ``node`` (the planner must match the
        sender's; docs/DESIGN.md, "Which planner a refit uses") and ``keep_as_loaded``: vLLM param names or fnmatch
        patterns that the payload does not write and may keep what was loaded (any other
        such param is refused here, on every rank; see ``receiver.coverage``). Params vLLM
        derives itself (MLA's absorbed weights) are never refit targets and need no listing."""
        state = self.refit_worker_state
        state.require_groups()  # before asking for the model: the call order's error first
        return state.prepare(
            self.get_refit_model(), payload, options, receive_misc=self.receive_misc,
            vllm_tp=self.get_refit_tp_coords()).as_dict()

    def refit(self) -> dict:
        """Receive all weights once (bulk + other params) and commit; returns this refit's
        numbers, ``version`` included. On failure it raises, and ``refit_weights_state()``
        says what the storage holds. Weights vLLM derives from the refitted params (MLA's
        absorbed ``kv_b_proj`` copies) are recomputed after the commit, in their storage, by
        vLLM's own layer method (``receiver.derived``; listed under ``derived_refreshed``);
        if that is impossible the weights are marked inconsistent."""
        return self.refit_worker_state.refit(self.get_refit_model(),
                                             self.get_refit_act_dtype()).as_dict()

    def start_staged_refit(self) -> dict:
        """Start a staged refit (the worker was prepared with ``{"staged": True}``): the
        receive runs on its own thread (and CUDA stream) into staging tensors and this call
        returns at once, so vLLM's engine loop keeps scheduling. Returns the staged state."""
        state = self.refit_worker_state
        return state.require_stager().start(state.require_session())

    def wait_staged_refit(self, timeout_s: Optional[float] = None) -> dict:
        """Block until the started refit is staged (committed everywhere, not live yet), or
        waits for the pause to write the params beyond the staging budget; raises if it
        failed (the live weights are then as ``refit_weights_state()`` says: consistent
        unless an in-place param was written)."""
        return self.refit_worker_state.require_stager().wait(timeout_s)

    def flip_staged_refit(self) -> dict:
        """Inside vLLM's pause: the staged version goes live (copies into vLLM's storage in
        place, then the weights vLLM derives from it); waits for the transfer first if it
        is still running. Returns the refit's numbers, ``staged`` with the flip's."""
        return self.refit_worker_state.flip_staged(self.get_refit_model(),
                                                   self.get_refit_act_dtype()).as_dict()

    def discard_staged_refit(self, timeout_s: Optional[float] = 60.0) -> dict:
        """Drop the staged version (or stop the running staged refit at its next batch: the
        peers fail too); the live weights stay as they are."""
        return self.refit_worker_state.require_stager().discard(timeout_s)

    def refit_weights_state(self) -> dict:
        """The weights' version and consistency (``receiver.state.WeightState.as_dict``):
        ``{"state": "consistent" | "inconsistent", "version", "started_from",
        "overwritten": [names], "not_refitted": [names kept as loaded], "refits",
        "failed_refits", "last_error"}``, and with a staged session ``staged``: its phase
        and staged version (``receiver.staging.StagedRefits.state``)."""
        return self.refit_worker_state.weights_state()

    def check_refit_weights_consistent(self) -> None:
        """Raise ``InconsistentWeightsError`` while a failed refit left mixed weights: call
        it before generating to refuse generation from a half-updated policy."""
        self.refit_worker_state.weights.require_consistent()

    def release_refit_staging(self) -> None:
        """Give back the CUDA staging memory the refit keeps between refits (two slots of
        half the staging budget per stage stream), e.g. before vLLM sleeps; the next
        refit allocates it again."""
        self.refit_worker_state.release_staging()

    def destroy_refit_groups(self, timeout_s: float = 60.0) -> None:
        """Shut the refit groups down at the end of the job (``groups.destroy_refit_group``;
        every rank of each group, the training ranks too, does the same) and drop the
        session: a later refit needs ``init_refit_groups`` and ``prepare_refit`` again."""
        self.refit_worker_state.destroy_groups(timeout_s)

    def report(self) -> dict:
        """Plain-data summary: params, bytes received, timings, target params left unwritten."""
        return self.refit_worker_state.report()


__all__ = ["MegatronReshardWorkerExtension"]
