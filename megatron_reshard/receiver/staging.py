"""Staged refits: receive version N+1 beside generation, verify it, flip it in (issue 53).

Torch + stdlib only. A worker prepared with ``staged=True`` maps the payload onto staging
tensors (one per vLLM param: same shape, dtype and strides; on the param's device, or in
pinned host memory, or none: ``staging_tiers``) instead of vLLM's storage, so the whole refit (plans, engine, deltas, checksums, commit vote) runs unchanged
while vLLM keeps generating from the live params. ``StagedRefits`` owns those tensors and
the refit's thread:

- ``start(session)``: fill the staging tensors from the live params (the mirror: a delta
  applies into it exactly as into the storage), then ``session.refit()``, all on a daemon
  thread (and, on a GPU, its own CUDA stream); returns at once.
- ``wait()``: until the version is staged (committed everywhere, not yet live), or the
  refit waits for the pause to write the params that did not fit the budget.
- ``flip()``: lets those in-place params through, waits for the commit, copies staging
  into the live params in place (addresses kept: CUDA graphs), advances the live version.
  After a delta refit it applies the recorded payloads into the live params instead
  (``staged_deltas``): the pause writes the changed elements, not every staged byte;
  first it checks that the params it would not copy whole still hold the base N
  (``flip_base``), and copies whole those written since the start.
- ``discard()``: drops a staged version, or stops a running refit at its next batch.

vLLM may re-allocate a param between the staged receive and the flip (``param.data =``, a
new ``Parameter``, ``model.to()``). ``start`` and ``flip`` read vLLM's params again first
(``receiver.live_targets``, the session's cheap check): a staged param moved in the same
shape, dtype and device is re-bound (the flip copies staging whole into the new storage);
at the flip anything else (another shape, dtype or device, a param gone, an in-place param
moved while its bytes waited for the pause) refuses the flip before any byte of it is
written: the staged version is discarded, the live weights stay at N.

A failure before the flip leaves the live weights consistent at N: only in-place params
(those beyond the staging budgets) are ever written before it, and only after the
pause began (``StagedWeights.writing`` gates them). docs/DESIGN.md, "Staged refits".
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from megatron_reshard.errors import BadInputError, CallOrderError, kept_without_frames
from megatron_reshard.groups.faults import RefitError
from megatron_reshard.receiver.flip_base import check_flip_base
from megatron_reshard.receiver.live_targets import LiveTargets
from megatron_reshard.receiver.staged_deltas import StagedDeltas, full_path_targets
from megatron_reshard.receiver.staging_tiers import (allocate, bounce_host_specs, check_budget,
                                                     plan_tiers, tensor_bytes)
from megatron_reshard.receiver.state import WeightState

PHASES = ("idle", "receiving", "waiting_for_pause", "staged", "failed")
DENSE_DELTA_FRACTION = 4  # the flip copies a param whose delta payloads pass 1/4 of its bytes
DELTA_FLIPS = ("apply", "copy")


def check_delta_flip(value: Any) -> str:
    """``staged_delta_flip`` checked: one of ``DELTA_FLIPS``."""
    if value not in DELTA_FLIPS:
        raise BadInputError(f"prepare_refit option staged_delta_flip: expected one of "
                            f"{list(DELTA_FLIPS)}, found {value!r}")
    return value
_POLL_S = 0.05
_log = logging.getLogger(__name__)


class StagedRefitError(RefitError):
    """A staged refit failed or was discarded; the message says what the live weights hold."""


class StagedRefitTimeout(StagedRefitError, TimeoutError):
    """A caller's wait for the staged refit ran out; the refit goes on."""


def plan_staging(params: Mapping[str, torch.Tensor],
                 budget_bytes: Optional[int]) -> tuple[list[str], list[str]]:
    """``(staged, in_place)`` param names with one tier of staging: the longest prefix in
    model order that fits ``budget_bytes`` is staged, the rest is in place (None: every
    param is staged). ``staging_tiers.plan_tiers`` with no host tier."""
    plan = plan_tiers(params, budget_bytes, 0)
    return plan.device, plan.in_place


class StagedWeights:
    """The weight state a staged session sees (duck-types ``WeightState`` for it).

    Its version and consistency are the live weights' (the version check and the delta
    vote see what vLLM serves); ``writing`` forwards only in-place params to the live
    state, after ``gate()`` (the pause); ``committed`` records the staged version, the flip
    applies it to the live state; ``failed`` touches the live state only if an in-place
    param was written."""

    def __init__(self, live: WeightState, in_place: Iterable[str],
                 gate: Callable[[], None], check_abort: Callable[[], None]):
        self.live = live
        self.in_place = frozenset(in_place)
        self._gate = gate
        self._check_abort = check_abort
        self.reset()

    def reset(self) -> None:
        self.written_in_place: set = set()
        self.commit: Optional[tuple[Optional[int], list, tuple]] = None
        self.error: Optional[str] = None

    @property
    def version(self) -> Optional[int]:
        return self.live.version

    @property
    def consistent(self) -> bool:
        return self.live.consistent

    def writing(self, names: Iterable[str]) -> None:
        self._check_abort()
        in_place = [n for n in names if n in self.in_place]
        if in_place:
            self._gate()
            self.written_in_place.update(in_place)
            self.live.writing(in_place)

    def committed(self, version: Optional[int], names: Iterable[str],
                  not_refitted: Iterable[str] = ()) -> None:
        self.commit = (version, list(names), tuple(not_refitted))

    def failed(self, error: str) -> None:
        self.error = error
        if self.written_in_place:
            self.live.failed(error)

    def as_dict(self) -> dict:
        return self.live.as_dict()

    def require_consistent(self) -> None:
        self.live.require_consistent()


class StagedRefits:
    """One worker's staging tensors and its staged refit in progress (see module doc)."""

    def __init__(self, live: Mapping[str, torch.Tensor], weights: WeightState,
                 budget_bytes: Optional[int] = None, where: str = "this rank",
                 host_budget_bytes: Optional[int] = 0, delta_flip: str = "apply",
                 model: Optional[torch.nn.Module] = None):
        """``delta_flip``: how the flip writes a delta refit: ``"apply"`` its payloads, or
        ``"copy"`` the staged params whole, as after a full refit (the same bytes; which is
        faster depends on the device and the regions: docs/MEASUREMENTS.md). ``model``:
        vLLM's model, whose params ``start`` and ``flip`` read again (else the objects in
        ``live``)."""
        self.live = dict(live)
        # vLLM's params as ``live`` was bound to them: read again at start and at the flip
        self._watch = LiveTargets(self.live, self.live, model, where)
        self.rebound: list[str] = []  # params re-bound since this refit started
        self.delta_flip = check_delta_flip(delta_flip)
        self.where = where
        self.budget_bytes = check_budget(budget_bytes)
        self.host_budget_bytes = check_budget(host_budget_bytes, "host_staging_budget_bytes")
        self.tiers = plan_tiers(self.live, self.budget_bytes, self.host_budget_bytes)
        self.tier_of = self.tiers.tier_of()
        staged = self.tiers.device + self.tiers.host
        self.staging = {n: allocate(self.live[n], self.tier_of[n]) for n in staged}
        _copy_all(list(self.staging.values()), [self.live[n] for n in staged])
        _synchronize(self.live.values())
        self.in_place = self.tiers.in_place
        self.deltas = StagedDeltas(self.staging, self.live)
        self.bounce = {"bounced_bytes": 0}  # host tier: bytes received through a device bounce
        self.bounced_params: list[str] = []
        self.weights = StagedWeights(weights, self.in_place, self._gate, self._check_abort)
        self.phase = "idle"
        self.result: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self.stats: dict[str, Any] = {}
        self._session: Any = None
        self._base: Any = None  # the session's delta base at the start (delta.base_digest)
        self._thread: Optional[threading.Thread] = None
        self._paused = threading.Event()  # the flip began: in-place params may be written
        self._ready = threading.Event()   # staged, failed, or waiting at the gate
        self._abort = threading.Event()
        self._stream = None

    # -- what the session maps and what the state reports ---------------------------------

    def targets(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The session's targets: the staging tensor of a staged param, else the param."""
        return [(n, self.staging.get(n, t)) for n, t in named]

    def session_prepared(self, session: Any = None) -> None:
        """After the session's construction: it zeroed the vocab padding rows of its targets
        once (``receiver.param_map``; they never travel), here the staging tensors; give
        the live params the same bytes, as an in-place session's preparation does (the
        other bytes are the live ones: the staging tensors were copied from them). The
        receive recipes into host-staged params get their device bounce
        (``staging_tiers.bounce_host_specs``)."""
        _copy_all([self.live[n] for n in self.staging], list(self.staging.values()))
        _synchronize(self.live.values())
        host = {n: self.staging[n] for n in self.tiers.host}
        if session is not None and host:
            device = self.live[self.tiers.host[0]].device
            self.bounced_params = bounce_host_specs(session.local_map, host, device, self.bounce)

    @property
    def staged_bytes(self) -> int:
        return sum(tensor_bytes(t) for t in self.staging.values())

    @property
    def in_place_bytes(self) -> int:
        return sum(tensor_bytes(self.live[n]) for n in self.in_place)

    def tier_report(self) -> dict:
        """Per tier: its params, their bytes, and the budget that bounds it."""
        budgets = {"device": self.budget_bytes, "host": self.host_budget_bytes,
                   "in_place": None}
        out = {}
        for tier, budget in budgets.items():
            names = getattr(self.tiers, tier)
            out[tier] = {"params": len(names), "budget_bytes": budget,
                         "bytes": sum(tensor_bytes(self.live[n]) for n in names)}
        out["host"]["pinned"] = any(t.is_pinned() for n, t in self.staging.items()
                                    if self.tier_of[n] == "host")
        out["host"]["bounced_params"] = len(self.bounced_params)
        return out

    def state(self) -> dict:
        """Plain data: the phase, the live and staged versions, staging memory per tier,
        timings."""
        commit = self.weights.commit
        devices = sorted({str(t.device) for t in self.staging.values()})
        error = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return {"phase": self.phase, "live_version": self.weights.live.version,
                "staged_version": commit[0] if commit and self.phase == "staged" else None,
                "staging_bytes": self.staged_bytes, "staging_devices": devices,
                "budget_bytes": self.budget_bytes, "host_budget_bytes": self.host_budget_bytes,
                "delta_flip": self.delta_flip,
                "tiers": self.tier_report(),
                "in_place_params": list(self.in_place),
                "in_place_bytes": self.in_place_bytes,
                "staged_delta_regions": len(self.deltas.regions),
                "staged_delta_payload_bytes": self.deltas.payload_bytes,
                "error": error,
                **self.stats}

    # -- the transfer, on its own thread ----------------------------------------------------

    def start(self, session: Any) -> dict:
        """Start ``session.refit()`` into the staging tensors on a daemon thread; returns at
        once (the state). Refused while one runs or a staged version waits for its flip."""
        if self.phase in ("receiving", "waiting_for_pause"):
            raise CallOrderError(f"{self.where}: a staged refit is running; wait for it and "
                                 f"flip (or discard) it before starting another")
        if self.phase == "staged":
            raise CallOrderError(f"{self.where}: version {self.weights.commit[0]} is staged and "
                                 f"not live yet; flip or discard it before starting another")
        self.weights.reset()
        self.deltas.clear()
        self.result = self.error = None
        self.stats = {}
        self._session = session
        # what a delta refit's vote compares the mirror with; its own commit replaces it
        self._base = getattr(session, "delta_base", None)
        self.rebound = sorted(self._follow_live(at_flip=False))
        if getattr(session, "loop", None) is not None:  # a delta refit's payloads, for the flip
            session.loop.on_delta_apply = self.deltas.record
        self._paused.clear()
        self._ready.clear()
        self._abort.clear()
        on_cuda = any(t.is_cuda for t in self.live.values())
        if on_cuda and self._stream is None:
            device = next(t.device for t in self.live.values() if t.is_cuda)
            self._stream = torch.cuda.Stream(device=device)
        if self._stream is not None:  # the last flip's copies out of staging come first
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        self.phase = "receiving"
        self.stats["started_at"] = time.time()
        self._thread = threading.Thread(target=self._run, args=(session,), daemon=True,
                                        name="megatron_reshard staged refit")
        self._thread.start()
        return self.state()

    def _run(self, session: Any) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._stream.device)
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                t0 = time.perf_counter()
                _copy_all(list(self.staging.values()),
                          [self.live[n] for n in self.staging])  # the mirror: base N
                self.stats["mirror_s"] = time.perf_counter() - t0
                result = session.refit()
                if self._stream is not None:  # the loop's streams too (host tier: D2H copies)
                    torch.cuda.synchronize(self._stream.device)
            self.stats["transfer_s"] = time.perf_counter() - t0
            self.result = result
            self.phase = "staged"
        except BaseException as exc:  # noqa: BLE001 - handed to wait/flip, which raise it
            self.deltas.clear()  # never applied: their payloads' memory goes now
            self.error = kept_without_frames(exc)  # its frames would hold this stager's groups
            self.phase = "failed"
        finally:
            self._ready.set()

    def _gate(self) -> None:
        """Called (on the transfer thread) before a batch holding an in-place param: wait for
        the flip, since the live storage may only change inside the pause."""
        if self._paused.is_set():
            return
        self.phase = "waiting_for_pause"
        self._ready.set()
        while not self._paused.wait(_POLL_S):
            self._check_abort()
        self._check_abort()
        self.phase = "receiving"

    def _check_abort(self) -> None:
        if self._abort.is_set():
            raise StagedRefitError(f"{self.where}: the staged refit was discarded before it "
                                   f"finished; the live weights are untouched")

    def wait(self, timeout_s: Optional[float] = None) -> dict:
        """Until staged (or waiting for the pause to write the in-place params); raises
        ``StagedRefitError`` if it failed. The state."""
        if self.phase == "idle":
            raise CallOrderError(f"{self.where}: no staged refit started (start_staged_refit)")
        if not self._ready.wait(timeout_s):
            raise StagedRefitTimeout(f"{self.where}: the staged refit is still receiving after "
                               f"{timeout_s} s")
        self._raise_if_failed()
        return self.state()

    def _raise_if_failed(self) -> None:
        if self.phase == "failed":
            raise StagedRefitError(f"{self.where}: the staged refit failed before its flip "
                                   f"({type(self.error).__name__}: {self.error}); the live "
                                   f"weights are {self._live_held()}") from self.error

    # -- the pause --------------------------------------------------------------------------

    def flip(self) -> dict:
        """Inside the pause: let the in-place params through, wait for the commit, write the
        staged version into the live params in place (a full refit: copies of the staged
        params; a delta refit: its payloads applied, ``receiver.staged_deltas``, and copies
        of what went full and of what was written since the start, ``receiver.flip_base``,
        named in ``flip_base_changed``), advance the live version. Returns the session's refit numbers
        with ``staged`` (this flip's)."""
        if self.phase == "idle":
            raise CallOrderError(f"{self.where}: no staged refit to flip (start_staged_refit)")
        t0 = time.perf_counter()
        moved = self._follow_live(at_flip=True)  # before the gate opens: nothing written yet
        self.rebound = sorted(set(self.rebound) | moved)
        self._paused.set()
        self._thread.join()
        t1 = time.perf_counter()
        self._raise_if_failed()
        copy, deltas = self._flip_plan()
        # re-bound: their recorded delta views are of the old storage; staging holds N+1 whole
        copy += [n for n in sorted(moved) if n not in copy]
        deltas -= moved
        tb = time.perf_counter()
        changed = self._base_changed(copy)  # written since the start: copied whole too
        copy += changed
        deltas -= set(changed)
        tc = time.perf_counter()
        try:
            _copy_all([self.live[n] for n in copy], [self.staging[n] for n in copy])
            t2 = time.perf_counter()
            applied = self.deltas.apply(skip=copy) if deltas else 0
            if any(t.is_cuda for t in self.live.values()):
                torch.cuda.current_stream(self._stream.device).synchronize()
        except BaseException as exc:
            self.weights.live.writing(copy + sorted(deltas))
            self.weights.live.failed(f"the flip failed: {type(exc).__name__}: {exc}")
            self.phase = "idle"
            raise StagedRefitError(f"{self.where}: the flip failed while writing the live "
                                   f"params ({type(exc).__name__}: {exc}); the live weights "
                                   f"are inconsistent") from exc
        t3 = time.perf_counter()
        version, written, not_refitted = self.weights.commit
        self.weights.live.committed(version, written, not_refitted=not_refitted)
        t4 = time.perf_counter()
        self.phase = "idle"
        copy_bytes = sum(tensor_bytes(self.staging[n]) for n in copy)
        by_target = self.deltas.payload_bytes_by_target()
        applied_bytes = sum(by_target[n] for n in deltas)
        self.stats.update(flip_wait_s=t1 - t0, flip_plan_s=tb - t1, flip_base_check_s=tc - tb,
                          flip_copy_s=t3 - tc, flip_s=t4 - t0,
                          flip_whole_copy_s=t2 - tc, flip_delta_apply_s=t3 - t2,
                          flip_commit_s=t4 - t3,
                          flip_bytes=copy_bytes + applied_bytes,
                          flip_copy_bytes=copy_bytes, flip_delta_regions=applied,
                          flip_delta_targets=len(deltas), flip_rebound=list(self.rebound))
        out = dict(self.result)
        out["staged"] = {**self.state(), "version": version}
        self.deltas.clear()  # applied: their payloads' memory goes now
        return out

    def _flip_plan(self) -> tuple[list[str], set]:
        """What the flip writes: staged params copied whole, and the params that take their
        recorded deltas instead. A full refit copies every staged param; a delta refit
        copies those it also wrote through the full path and applies the deltas of the
        others (a staged param it did not write holds the live bytes already)."""
        if (self.result or {}).get("mode") != "delta" or self.delta_flip == "copy":
            return list(self.staging), set()
        full = full_path_targets(self._session)
        # a param whose payloads come near its size is copied whole (the same bytes: staging
        # holds the deltas applied), a scatter would cost more than the copy
        dense = {n for n, b in self.deltas.payload_bytes_by_target().items()
                 if b * DENSE_DELTA_FRACTION >= tensor_bytes(self.staging[n])}
        # (a host-staged param went full: the bounce is a hook, the delta vote says so)
        # (a live param re-bound in other strides: a delta's offsets are staging's, not its)
        copy = [n for n in self.staging
                if n in full or n in dense or self.tier_of[n] == "host"
                or self.live[n].stride() != self.staging[n].stride()]
        return copy, self.deltas.targets() - set(copy)

    def _base_changed(self, copy: list[str]) -> list[str]:
        """The staged params the flip would not copy whole (a delta refit's: those taking
        their deltas, those no delta touches) whose live bytes are not the base N any more
        (``receiver.flip_base``); warned about and in the stats (``flip_base_changed``)."""
        copied = set(copy)
        rest = [n for n in self.staging if n not in copied]
        found = check_flip_base(self._base, self._session.loop.held_in_place() if rest else (),
                                self.staging, self.live, rest)
        self.stats.update(flip_base_changed=found.changed, flip_base_checked=found.checked,
                          flip_base_check_bytes=found.checked_bytes)
        if found.changed:
            _log.warning("%s: the live bytes of %d staged params changed since the staged "
                         "refit started (something wrote vLLM's storage before the flip: "
                         "sleep(level=2) and wake_up, load_weights, a post-load step), so "
                         "their deltas would land on other bytes than the base; copied whole "
                         "from staging instead: %s", self.where, len(found.changed),
                         ", ".join(found.changed))
        return found.changed

    def _follow_live(self, at_flip: bool) -> set:
        """vLLM's params read again (``receiver.live_targets``). A staged param moved in the
        same shape, dtype and device is re-bound here and in the session's check (its
        target, the staging tensor, stays). At ``start`` the session's own check (voted to
        every rank) re-binds the moved in-place params and refuses the rest; at the flip
        anything but a staged param moved discards the staged version and raises, before
        any byte of the flip is written. The names re-bound."""
        changed = self._watch.check()
        if changed is None:
            return set()
        moved = {n: t for n, t in changed.moved.items() if n in self.staging}
        late = [n for n in changed.moved if n not in self.staging]
        if at_flip and (changed.refused or late):
            problems = list(changed.refusals) + [
                f"{n} on {self.where}: vLLM re-allocated it while the staged refit waited for "
                f"the pause to write it in place (into the storage bound when it started)"
                for n in late]
            self.discard()
            raise StagedRefitError(f"{self.where}: the flip is refused before writing any "
                                   f"byte: vLLM's params changed since the staged refit "
                                   f"started: {'; '.join(problems)}. The staged version is "
                                   f"discarded; the live weights are {self._live_held()}. "
                                   f"Call prepare_refit again for the model as it is now")
        self.live.update(changed.moved)  # the same dict as ``self.deltas.live``
        self._watch.followed(changed.moved)
        session_live = getattr(self._session, "live", None)
        if session_live is not None:
            session_live.followed(moved)
        return set(changed.moved)

    def _live_held(self) -> str:
        live = self.weights.live.as_dict()
        return (f"consistent at version {live['version']}" if live["state"] == "consistent"
                else f"inconsistent (in-place params {live['overwritten']} were written)")

    def discard(self, timeout_s: Optional[float] = None) -> dict:
        """Drop the staged version (the live weights stay as they are), stopping a running
        refit at its next batch (a failure posted on the fault boards: the peers fail too).
        The state."""
        if self._thread is not None and self._thread.is_alive():
            self._abort.set()
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise StagedRefitTimeout(f"{self.where}: the staged refit did not stop within "
                                   f"{timeout_s} s")
        self.phase = "idle"
        self.weights.reset()
        self.deltas.clear()
        return self.state()


def _synchronize(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the device of the first CUDA tensor (copies to or from pinned memory)."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    if device is not None:
        torch.cuda.synchronize(device)


# A pair this large is one ``copy_`` each (a device memcpy at full bandwidth, its launch
# cost negligible beside the bytes); smaller pairs go to one fused ``_foreach_copy_``. On one
# H100 the fused kernel alone ran the large bench's flip at 74% of a memcpy of the same bytes
# (docs/MEASUREMENTS.md, twenty-first session). The same threshold as the colocated copies'.
MEMCPY_BYTES = 16 << 20
# Integer views of each element size: CUDA's ``_foreach_copy_`` of a floating dtype goes
# through float arithmetic, which rewrites NaN payloads (seen on an H200: engine.copies);
# integers copy bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_BITS[x.element_size()]) if x.dtype.is_floating_point else x


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, bit for bit: on one device the large pairs one
    memcpy each and the rest one fused call over integer views; pairs across devices (the
    host tier) one by one, asynchronous from and to pinned memory (the caller
    synchronizes)."""
    same = [(d, s) for d, s in zip(dst, src) if d.device == s.device]
    across = [(d, s) for d, s in zip(dst, src) if d.device != s.device]
    fused = [(d, s) for d, s in same
             if d.dtype == s.dtype and tensor_bytes(d) < MEMCPY_BYTES]
    with torch.no_grad():
        for d, s in same:
            if d.dtype != s.dtype or tensor_bytes(d) >= MEMCPY_BYTES:
                d.copy_(s)
        if fused and hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_([_bits(d) for d, _ in fused], [_bits(s) for _, s in fused])
        else:
            for d, s in fused:
                d.copy_(s)
        for d, s in across:
            d.copy_(s, non_blocking=True)


__all__ = ["DELTA_FLIPS", "PHASES", "StagedRefitError", "StagedRefitTimeout", "StagedRefits",
           "StagedWeights", "check_budget", "check_delta_flip", "plan_staging"]
