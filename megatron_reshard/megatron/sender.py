"""Train-side refit session: the sending half of one refit, every step.

``RefitSender`` wraps a ``MegatronRefitSource``'s frozen ``TrainSidePlan`` (either may be
passed) and the rank's refit group (one group per
training PP stage; a train rank belongs to its own stage's group). Per refit it runs the
training side of ``refit.protocol``: the shared ``RefitLoop`` (side ``"src"``: bulk params
straight from the live shards), then the stage's other params as packed broadcasts from
the stage's first train rank, then the commit vote that carries the refit's version.
Options that enter the plan fingerprint (batch and staging bytes, misc items) must match
the receiver's; a mismatch is reported at the first refit on every rank of the group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import functools
import math

import torch

from megatron_reshard.groups.faults import RefitError, fault_scope
from megatron_reshard.engine.refit_transport import transport_of
from megatron_reshard.delta.bases import DeltaConfig, TrainBase
from megatron_reshard.refit.delta_vote import src_vote
from megatron_reshard.refit.finite import all_finite, nonfinite_refusal
from megatron_reshard.refit.packed import broadcast_packed, pack_entries
from megatron_reshard.refit.loop import DEFAULT_BATCH_BYTES, DEFAULT_STAGING_BYTES, RefitLoop
from megatron_reshard.refit.order import misc_items_by_stage
from megatron_reshard.refit.protocol import RefitProtocol
from megatron_reshard.refit.version import Refusal
from megatron_reshard.errors import BadInputError
from megatron_reshard.megatron.live_views import BoundTensors
from megatron_reshard.megatron.source import gather_other_params, local_param_map, plan_of

if TYPE_CHECKING:
    from megatron_reshard.megatron.source import MegatronRefitSource
    from megatron_reshard.megatron.train_plan import TrainSidePlan


class RefitSender:
    """Sends this train rank's shards to the generation ranks of its stage's refit group."""

    def __init__(self, source: "Union[MegatronRefitSource, TrainSidePlan]", group: Any, *,
                 device: Optional[torch.device] = None, num_streams: int = 2, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 verify_checksums: bool = False,
                 delta: Union[bool, DeltaConfig] = False, planner: str = "auto",
                 node: Optional[str] = None, check_finite: bool = False):
        """``verify_checksums`` must match the generation side's choice (plan fingerprint).
        ``delta`` (experimental, off by default): ``True`` (a ``DeltaConfig()``: 1 GiB of
        base per rank, kept beside the weights) or a ``DeltaConfig``: once a refit
        committed, later refits send only the changed elements of the params the plan moves
        in one hop, when every rank can prove the base (``refit.delta_vote``); else full, the
        reason in the result.

        ``planner`` (``"auto"``, ``"link"`` or ``"default"``) must match the generation
        side's; ``node`` names this rank's node (default: the host name): with ``"auto"``
        the link-aware planner plans a group that spans more than one node (docs/DESIGN.md,
        "Which planner a refit uses").

        ``check_finite`` (off by default: a pass over the weights): NaN or Inf in a weight
        (or an FP8 scale not finite and > 0) refuses the refit on every rank before any
        byte moves (``NonFiniteRefused``, naming the param and this rank; the generation
        side keeps its version, consistent); what the transfer computes after that vote
        is checked as it is sent and fails the commit (``refit.finite``).

        ``source``: a ``MegatronRefitSource`` or its ``plan``; anything else raises
        ``BadInputTypeError``. Errors here are posted on the group's fault board, so the
        generation ranks raise them too instead of waiting for their timeout."""
        with fault_scope([group]):
            plan = plan_of(source, "RefitSender(source=...)")
        self.plan: "TrainSidePlan" = plan
        self.group = group
        self.stage = plan.stage
        self.device = device or torch.device("cpu")
        self.version = 0  # of the last refit sent (committed or not); 0: none yet
        self.delta = DeltaConfig.of(delta)
        self._sent_any = False
        with fault_scope([group]):
            info = plan.payload
            self.pp_size = info.pp_size
            misc = misc_items_by_stage(info)
            self.misc_items = misc.get(self.stage, [])
            self.staging_bytes = staging_bytes
            self.loop = RefitLoop(info, local_param_map(plan), "src",
                                  {self.stage: group}, num_streams=num_streams,
                                  batch_bytes=batch_bytes, staging_bytes=staging_bytes,
                                  misc_items=misc, verify_checksums=verify_checksums,
                                  planner=planner, node=node, check_finite=check_finite)
            if self.delta is not None:
                # the config, not self: a closure over the sender, kept by its own loop,
                # is a reference cycle that holds the refit group (its store's thread and
                # sockets) after destroy_refit_group until the cyclic collector runs
                self.loop.enable_delta(functools.partial(TrainBase, self.delta))
            self.protocol = RefitProtocol("src", self.loop, {self.stage: group},
                                          {self.stage: self.misc_items}, staging_bytes,
                                          self.pp_size)
        self.is_misc_root = plan.stage_local_rank == 0
        with fault_scope([group]):
            self._bound = BoundTensors(plan)  # the model tensors the loop's views are cut from
        self.check_finite = check_finite
        self._misc_at = {name: i for i, (name, _, _) in enumerate(self.misc_items)}
        self._misc_nonfinite: dict[int, list[int]] = {}  # this refit's, by misc position

    @property
    def base(self) -> Optional[TrainBase]:
        """The bits last sent (delta refits): the loop's, which plans them again once the
        plan check picked the link-aware planner."""
        bases = self.loop.delta_bases
        return None if bases is None else bases[self.stage]

    def refit(self, version: Optional[int] = None, *, allow_version_reuse: bool = False) -> dict:
        """Send every param once, then commit (``refit.protocol`` states the order).
        Collective over the train world (TP gather of the other params) and over the refit
        group; every train rank calls it.

        ``version`` is the weight version the generation side reports once this refit
        committed; every train rank must pass the same. It must be higher than both this
        sender's last and the version the generation ranks' weights hold (a restarted
        trainer replaying older weights), else ``VersionRefused`` on every rank before any
        byte moves, the groups staying usable; ``allow_version_reuse=True`` sends it anyway.
        Default: one more than the higher of those two. On any other failure the error
        reaches every rank of the group (fault board) and this sender refuses further
        refits: new refit groups are needed.
        """
        self.protocol.check_usable(lambda why: f"the refit group of stage {self.stage} failed in "
                                   f"an earlier refit ({why}); create a new refit group and sender")
        rebound, refusal = self._follow_model()
        if refusal is None and self.check_finite:  # NaN refuses before any byte moves
            refusal = nonfinite_refusal(self.plan.local.converted, self.plan.local.fp8_views,
                                        self.loop.param_names(other=True)[self.stage],
                                        self.plan.where())
        self._misc_nonfinite = {self.stage: []}
        try:
            done = self.protocol.run(
                self._send_chunk, version=None if version is None else int(version),
                allow_version_reuse=allow_version_reuse,
                last_version=self.version if self._sent_any else None, device=self.device,
                delta_vote=self._delta_vote(), refusal=refusal,
                misc_nonfinite=self._misc_nonfinite)
        except RefitError:
            if self.base is not None:
                self.base.dropped()
            raise
        version = self.version = done.version
        self._sent_any = True
        if not done.outcome.ok:
            if self.base is not None:
                self.base.dropped()
            raise RefitError(f"refit version {version} failed its commit: {done.outcome.reason}")
        if self.base is not None:
            self.base.committed(version)
        misc = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.misc_items) \
            if self.is_misc_root else 0
        out = {"bulk_params": done.bulk.params, "bulk_bytes": done.bulk.local_bytes,
               "bulk_s": done.bulk_s, "misc_s": done.misc_s,
               "refit_s": done.bulk_s + done.misc_s, "version": version,
               "version_s": done.version_s, "commit_s": done.commit_s,
               "verify_s": done.verify_s,  # None: no rank of the group needed the plan check
               "mode": done.mode, "full_reason": done.full_reason,
               "bytes_sent": done.bulk_bytes_moved + misc,
               "planner": "default" if self.loop.costs[self.stage] is None else "link",
               "rebound": rebound}  # model tensors that had moved: the views cut again
        if self.base is not None:
            out["delta"] = done.bulk.delta
            out["base"] = self.base.report()
        return out

    def _follow_model(self) -> tuple[int, Optional[Refusal]]:
        """Every refit reads the model's current storage (``megatron.live_views``): the
        views re-cut where the model's tensors moved since the last refit; (how many moved,
        None), or (0, the refusal) where they changed beyond that. Local: the version
        check's vote carries the refusal, and the re-check of the plan a re-bind asks for,
        to every rank of the group."""
        moved = self._bound.check()
        if moved is None:
            return 0, None
        if not moved.refusals:
            try:
                rebound = self._bound.rebound()
                self.loop.rebind(local_param_map(rebound[0]))
                self._bound.accept(rebound)
                self.plan = rebound[0]
                return len(moved.moved), None
            except BadInputError as exc:  # cut as at construction: said the same way
                problems, refused = (str(exc),), set(moved.moved)
        else:
            problems, refused = moved.refusals, set(moved.refused)
        names = self.loop.param_names()[self.stage]
        bad = {n for conv, _ in self.plan.local.converted if conv.megatron_name in refused
               for n in conv.hf_names}
        index = next((i for i, n in enumerate(names) if n in bad), -1)
        return 0, Refusal(f"refit refused before any byte moved: the model's tensors on "
                          f"{self.plan.where()} changed since its MegatronRefitSource was "
                          f"built: " + "; ".join(problems) + ". Build a new MegatronRefitSource "
                          f"and RefitSender for the model as it is now", index)

    def _delta_vote(self) -> list:
        """This rank's columns of the delta/full vote (``refit.delta_vote``)."""
        if self.delta is None:
            return src_vote(False, 0, None)
        if self.base is not None and transport_of(self.group).name != "p2p":
            # the colocated transport reads at memcpy speed: keep no base for it
            self.loop.delta_plans = self.loop.delta_bases = None
        if self.base is None:
            return src_vote(True, 3, None)
        return src_vote(True, self.base.no_base_code(), self.base.version)

    def _send_chunk(self, stage: int, chunk: list) -> None:
        """One packed chunk of the stage's other params: gathered over TP on every train
        rank (chunk by chunk, so no rank holds them all at once), broadcast from the
        stage's first train rank."""
        names = [name for name, _, _ in chunk]
        full = gather_other_params(self.plan, names)
        tensors = ({name: full[name].to(self.device) for name in names}
                   if self.is_misc_root else None)
        if self.check_finite and tensors is not None:
            flags = {name: all_finite(t) for name, t in tensors.items()}
            self._misc_nonfinite[stage] += [self._misc_at[n] for n, f in flags.items()
                                            if f is not None and not bool(f)]
        broadcast_packed(pack_entries(chunk), self.group, 0, self.device, tensors)

    def release_staging(self) -> None:
        """Give back the CUDA staging memory kept between refits (see RefitLoop)."""
        self.loop.release_staging()
