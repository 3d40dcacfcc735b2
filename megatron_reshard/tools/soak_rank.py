"""One process of the soak (``tools.soak``): a training rank or a generation rank that lives
across refits, faults and rebuilds, driven by its parent's commands over a pipe.

The process starts bare (torch and the library imported, so that a spare replaces a dead
rank at once), then takes a role (``become``). Each command is one call of the library as a
user's loop makes it: the training rank builds a real megatron-core model and its source,
joins refit groups, takes Adam steps, computes the independent reference of its weights
(full HF tensors sliced by the generation layout, ``testing``), saves and loads
checkpoints and refits; a generation rank holds a vLLM-layout model behind the worker
extension. Faults are armed per refit: at a phase of the refit protocol the victim tells
its parent the time, then kills (SIGKILL) or stops (SIGSTOP) itself.

Megatron and the testing references are imported inside the roles, not here: the soak's
parent imports this module (the spawn target) and never builds a model.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import signal
import sys
import threading
import time
import traceback
import tracemalloc
import warnings
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist

import megatron_reshard.delta.encoding as delta_encoding
import megatron_reshard.refit.protocol as protocol
from megatron_reshard.groups.comm import create_refit_group, destroy_refit_group
from megatron_reshard.receiver import MegatronReshardWorkerExtension
from megatron_reshard.refit.loop import RefitLoop
from megatron_reshard.tools.e2e import tensor_digest
from megatron_reshard.tools.launch_env import apply_launch_defaults
from megatron_reshard.wire.spec import RefitCtx

HOST = "127.0.0.1"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
# the protocol's phases a fault can hit (refit.protocol's steps) and which side has each
PHASES = ("version_vote", "plan_check", "bytes", "delta", "commit")
TRACE_ENV = "MEGATRON_RESHARD_SOAK_TRACEMALLOC"  # set by the soak's --trace-python-memory


# ------------------------------------------------------------------------- fault arming


class Armed:
    """The fault armed in this process for the current refit (one at a time)."""

    conn: Any = None
    phase: Optional[str] = None
    sig: Optional[str] = None
    after: int = 0   # calls of the phase to let through first
    seen: int = 0

    @classmethod
    def arm(cls, arm: Optional[dict]) -> None:
        cls.phase = arm["phase"] if arm else None
        cls.sig = arm["signal"] if arm else None
        cls.after = arm.get("after", 0) if arm else 0
        cls.seen = 0

    @classmethod
    def hit(cls, phase: str) -> None:
        """Called at each phase: the armed fault fires at its phase's ``after``-th call."""
        if cls.phase != phase:
            return
        cls.seen += 1
        if cls.seen <= cls.after:
            return
        cls.conn.send(("fault", {"at": time.time(), "phase": phase, "signal": cls.sig}))
        sig = SIGNALS[cls.sig]
        cls.phase = None
        os.kill(os.getpid(), sig)


def _wrap(module: Any, attr: str, phase: str) -> None:
    inner = getattr(module, attr)

    def hooked(*args, **kwargs):
        Armed.hit(phase)
        return inner(*args, **kwargs)

    setattr(module, attr, hooked)


def install_phase_hooks() -> None:
    """Every phase but ``bytes`` is a function of the protocol the process patches once;
    ``bytes`` is a param's pre hook (``arm_bytes``), so it fires between two params."""
    _wrap(protocol, "agree_version", "version_vote")
    _wrap(protocol, "commit_refit", "commit")
    _wrap(RefitLoop, "verify_plan", "plan_check")
    _wrap(delta_encoding, "encode", "delta")   # a training rank: cutting the regions
    _wrap(delta_encoding, "apply", "delta")    # a generation rank: applying them


def arm_bytes(loop: RefitLoop, seed: int) -> None:
    """A seeded param's pre hook of ``loop`` calls the ``bytes`` phase (once per loop)."""
    if getattr(loop, "_soak_hooked", False):
        return
    loop._soak_hooked = True
    names = sorted(loop.local_map.specs)
    spec = loop.local_map.specs[random.Random(seed).choice(names)]
    inner = spec.pre

    def pre(base):
        Armed.hit("bytes")
        return inner(base) if inner is not None else RefitCtx(buf=base)

    spec.pre = pre


# ------------------------------------------------------------------------------ samples


def _children(pid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        count += 1
            except (OSError, IndexError, ValueError):
                pass
    return count


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _malloc_trim() -> bool:
    """Give the C allocator's free memory back to the system (glibc); False elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def sample() -> dict:
    """What this process holds now: resident memory (as it is, and once the C allocator has
    given back its free memory: ``rss_trimmed_mib``; what only the first has is the
    allocator's, not a leak), Python's allocated blocks and objects, the bytes of the CPU
    tensors alive, fds (sockets, shared memory), threads (native ones included), child
    processes, CUDA memory where there is a GPU."""
    out = {"rss_mib": _rss_mib()}
    if _malloc_trim():
        out["rss_trimmed_mib"] = _rss_mib()
    kinds = {"sockets": 0, "shm": 0}
    fds = os.listdir("/proc/self/fd")
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            kinds["sockets"] += 1
        elif target.startswith("/dev/shm/") or "(deleted)" in target:
            kinds["shm"] += 1
    out.update(fds=len(fds), **kinds, threads=len(os.listdir("/proc/self/task")),
               children=_children(os.getpid()))
    # refit groups still alive (a group let go of is collected; one held past its failure's
    # retirement is a leak), and the CPU tensors' storages (each counted once)
    alive: Counter = Counter()
    storages: dict[int, int] = {}
    objects = gc.get_objects()
    for o in objects:
        name = type(o).__name__
        if name in ("RefitGroup", "FaultBoard"):
            alive[name] += 1
        elif issubclass(type(o), torch.Tensor) and o.device.type == "cpu":  # (type(): no
            # deprecated module's __class__ is read, which warns)
            try:
                st = o.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                pass
    out.update(groups_alive=alive["RefitGroup"], boards_alive=alive["FaultBoard"],
               gc_objects=len(objects), py_blocks=sys.getallocatedblocks(),
               cpu_tensor_mib=sum(storages.values()) / 2**20)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_alloc_mib"] = torch.cuda.memory_allocated() / 2**20
        out["gpu_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
    return out


class PyMemory:
    """Python allocations by site (``tracemalloc``), when the soak asks for them
    (``--trace-python-memory``; it slows every allocation): the second sample's snapshot
    is the baseline; ``sites`` the allocation sites that grew most since, and the object
    types whose count grew most."""

    first = None
    types: Counter = Counter()
    samples = 0

    @classmethod
    def sample(cls) -> dict:
        if not tracemalloc.is_tracing():
            return {}
        cls.samples += 1
        if cls.samples == 2:  # not the first (before any refit): past the warm-up
            cls.first = tracemalloc.take_snapshot()
            cls.types = _object_types()
        return {"py_traced_mib": tracemalloc.get_traced_memory()[0] / 2**20}

    @classmethod
    def sites(cls, top: int = 12) -> list:
        if cls.first is None:
            return []
        now = _object_types()  # (before the comparison's own objects exist)
        diff = tracemalloc.take_snapshot().compare_to(cls.first, "lineno")
        grew = sorted(((n - cls.types.get(t, 0), t) for t, n in now.items()), reverse=True)
        return {"sites": [{"site": str(d.traceback), "grew_kib": round(d.size_diff / 1024, 1),
                           "blocks": d.count_diff} for d in diff[:top]],
                "types": [{"type": t, "grew": k} for k, t in grew[:top] if k > 0]}


def _object_types() -> Counter:
    """How many objects the cyclic collector tracks, per type name."""
    return Counter(type(o).__qualname__ for o in gc.get_objects())


# ------------------------------------------------------------------------------- roles


class Turn:
    """A model this process built, with what its turns keep: on a training rank, its step
    count and its refit source."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.steps, self.turns = model, 0, 0
        self.source: Any = None


class Shelf:
    """The models this process has built, one per (role, model preset), taken again at the
    model's later turns. The soak switches models every ``--switch-every`` refits; a job
    builds its model once, so a soak rank does too, and the growth the soak measures is the
    library's, not a harness's rebuilds (``--rebuild-models``, the old way, measures what
    those cost: docs/MEASUREMENTS.md, "the soak's memory slope by event")."""

    turns: dict[tuple, Turn] = {}

    @classmethod
    def take(cls, key: tuple, build, rebuild: bool = False) -> Turn:
        """The model of ``key``, built by ``build`` on its first turn (and on every turn
        with ``rebuild``: the soak's old way, kept to measure what it costs)."""
        if rebuild:  # the old way kept no model past its turn
            cls.turns.clear()
        turn = cls.turns.get(key)
        if turn is None:
            turn = cls.turns[key] = Turn(build())
        turn.turns += 1
        return turn


def _digests(named) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in named}


class TrainRank:
    """A training world of one rank (TP1 PP1; experts EP1): model, source, sender."""

    def __init__(self, conn, *, model: str, gen: int, device: str, seed: int,
                 checkpoint: Optional[str] = None, rebuild: bool = False, **_):
        from megatron.core import parallel_state as ps

        from megatron_reshard.megatron import MegatronRefitSource
        from megatron_reshard.testing.megatron_models import TinyGPTSpec, build_gpt_model
        from megatron_reshard.tools.e2e import keep_expert_bias_fp32_
        from megatron_reshard.tools.run_config import MODEL_PRESETS

        self.conn, self.gen, self.device = conn, gen, torch.device(device)
        if not dist.is_initialized():  # the training world: this process alone
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        # once per process: every model (re)built here runs TP1 PP1 EP1, and each
        # initialize_model_parallel leaves ~50 threads and ~70 fds of gloo groups behind that
        # destroy_model_parallel does not end (megatron-core 0.16; a job does it once)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                         pipeline_model_parallel_size=1)
        preset = dict(MODEL_PRESETS[model])
        self.family = preset.pop("family")
        spec = TinyGPTSpec(dtype="bfloat16", **preset)

        def build() -> torch.nn.Module:
            torch.manual_seed(seed)
            built = build_gpt_model(spec).to(dtype=torch.bfloat16)
            keep_expert_bias_fp32_(built)
            return built.to(self.device)

        # a later turn of the model goes on from where its last turn left it: its weights,
        # Adam state, step count and source (the reference is computed from the weights as
        # they are; a new source is the repair after params moved: ``rebind``)
        self.turn = Shelf.take(("train", model), build, rebuild)
        self.model = self.turn.model
        self.checkpoint_version = None
        if checkpoint is not None:  # a restart: the weights of an older checkpoint
            saved = torch.load(checkpoint, weights_only=True)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(saved["params"][name])
            self.checkpoint_version = saved["version"]
        self.vocab_size = spec.vocab_size
        self._source_args = dict(gen_parallelism={"tp_size": gen, "ep_size": 1, "pp_size": 1},
                                 gen_world_size=gen, family=self.family, vocab_size=spec.vocab_size)
        if self.turn.source is None:
            self.turn.source = MegatronRefitSource(self.model, **self._source_args)
        self.source = self.turn.source
        self.group = self.sender = None

    def describe(self) -> dict:
        return {"payload": self.source.payload_bytes(), "pid": os.getpid(),
                "checkpoint_version": self.checkpoint_version}

    def groups(self, *, port: int, transport: str, timeout_s: float, verify: bool,
               delta: bool, seed: int) -> dict:
        from megatron_reshard.megatron.sender import RefitSender

        self.drop_groups()
        self.group = create_refit_group(HOST, port, 0, 1 + self.gen, "gloo", timeout_s,
                                        who="train rank 0", label="refit group of PP stage 0",
                                        transport=transport)
        self.sender = RefitSender(self.source, self.group, device=self.device,
                                  verify_checksums=verify, delta=delta)
        self.seed = seed
        return {}

    def drop_groups(self) -> None:
        if self.group is not None:
            try:
                destroy_refit_group(self.group, timeout_s=2.0)
            except Exception:  # noqa: BLE001 - a failed group: nothing left to shut down
                pass
        self.group = self.sender = None

    def step(self, *, lr: float) -> dict:
        """One Adam step; returns the reference of the weights it leaves (``reference``)."""
        from megatron_reshard.testing.optimizer_steps import adam_step_

        self.turn.steps += 1
        adam_step_(self.model, self.turn.steps, lr=lr)
        return self.reference()

    def reference(self) -> dict:
        """Per generation rank, the digest of every vLLM param as the independent reference
        computes it from this model's weights now."""
        from megatron_reshard.testing.megatron_reference import gather_full_hf_state_dict
        from megatron_reshard.testing.vllm_like import expected_vllm_shard, vllm_param_shapes

        full = gather_full_hf_state_dict(self.model, family=self.family, vocab_size=self.vocab_size)
        full = {k: v.to("cpu") for k, v in full.items()}
        cfg = self.source.hf_config
        return {g: {n: tensor_digest(expected_vllm_shard(cfg, n, full, g, self.gen, 1))
                    for n in vllm_param_shapes(cfg, g, self.gen, 1)} for g in range(self.gen)}

    def refit(self, *, version: int, arm: Optional[dict] = None,
              allow_version_reuse: bool = False) -> dict:
        Armed.arm(arm)
        if arm and arm["phase"] == "bytes":
            arm_bytes(self.sender.loop, self.seed)
        try:
            out = self.sender.refit(version=version, allow_version_reuse=allow_version_reuse)
        finally:
            Armed.arm(None)
        return {"version": out["version"], "mode": out["mode"], "full_reason": out["full_reason"]}

    def save(self, *, path: str, version: int) -> dict:
        params = {n: p.detach().to("cpu").clone() for n, p in self.model.named_parameters()}
        torch.save({"params": params, "version": version}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return {}

    def rebind(self) -> dict:
        """A new source over the model's params as they are now (the repair after params
        moved: the old source keeps views of the storage it was built on)."""
        from megatron_reshard.megatron import MegatronRefitSource

        self.drop_groups()
        self.source = self.turn.source = MegatronRefitSource(self.model, **self._source_args)
        return {}

    def move_params(self) -> dict:
        """What ``Module.to()`` / an offload and onload does: every param in new storage
        (issue 50, the first silent outcome)."""
        self.model._apply(lambda t: t.clone())
        return {}


class _Worker(MegatronReshardWorkerExtension):
    def __init__(self, model, gen_rank: int, gen: int):
        self._model, self._coords = model, (gen_rank, gen)

    def get_refit_model(self):
        return self._model

    def get_refit_gen_coords(self):
        return self._coords


class GenRank:
    """A generation rank: a vLLM-layout model of TP ``gen`` behind the worker extension."""

    def __init__(self, conn, *, gen_rank: int, gen: int, device: str, payload: dict,
                 model: str, rebuild: bool = False, **_):
        from megatron_reshard.testing.vllm_like import build_vllm_like_model

        self.conn, self.gen_rank, self.gen = conn, gen_rank, gen
        self.device = torch.device(device)
        turn = Shelf.take(("gen", model, gen_rank, gen), lambda: build_vllm_like_model(
            payload["hf_config"], gen_rank, gen, 1, torch.bfloat16, device=self.device), rebuild)
        self.model = turn.model
        if turn.turns > 1:  # what a fresh build holds: NaN (-1 in integer params)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan") if p.dtype.is_floating_point else -1)
        # a new worker each turn: a new engine over the model's memory, no weight state yet
        self.worker = _Worker(self.model, gen_rank, gen)
        self.has_groups = False

    def describe(self) -> dict:
        return {"pid": os.getpid()}

    def groups(self, *, port: int, timeout_s: float, verify: bool, payload: dict,
               seed: int, **_) -> dict:
        self.drop_groups()
        self.worker.init_refit_groups(HOST, [port], 1 + self.gen_rank, 1 + self.gen, "gloo",
                                      timeout_s)
        self.has_groups = True
        self.seed, self.verify = seed, verify
        self.worker.prepare_refit(payload, {"verify_checksums": verify})
        return {}

    def drop_groups(self) -> None:
        if self.has_groups:
            try:
                self.worker.destroy_refit_groups(timeout_s=2.0)
            except Exception:  # noqa: BLE001 - a failed group: nothing left to shut down
                pass
        self.has_groups = False

    def refit(self, *, arm: Optional[dict] = None, **_) -> dict:
        before = _digests(self.model.named_parameters())
        Armed.arm(arm)
        if arm and arm["phase"] == "bytes":
            arm_bytes(self.worker.refit_worker_state.require_session().loop, self.seed)
        error: dict = {}
        try:
            out = self.worker.refit()
        except Exception as exc:  # noqa: BLE001 - the error is part of the result
            # its text only: the exception kept in a local of this frame, which its
            # traceback holds, is a cycle keeping the failed group alive (issue 52)
            out, error = {}, {"error": f"{type(exc).__name__}: {exc}",
                              "error_type": type(exc).__name__, "at": time.time()}
        finally:
            Armed.arm(None)
        return {"before": before, "after": _digests(self.model.named_parameters()),
                "state": self.worker.refit_weights_state(), "mode": out.get("mode"),
                "version": out.get("version"), **error}

    def state(self) -> dict:
        return {"state": self.worker.refit_weights_state(),
                "after": _digests(self.model.named_parameters())}

    def tamper(self, *, seed: int) -> dict:
        """Write two elements of one param behind the library's back (a user, a post-load
        step, a bug; issue 50, the second silent outcome)."""
        rng = random.Random(seed)
        names = sorted(n for n, p in self.model.named_parameters() if p.dtype == torch.bfloat16)
        name = rng.choice(names)
        with torch.no_grad():
            bits = dict(self.model.named_parameters())[name].data.view(-1).view(torch.int16)
            for _ in range(2):
                bits[rng.randrange(bits.numel())] += 1
        return {"param": name}

    def reload(self, *, payload: dict, seed: int) -> dict:
        """The weights replaced wholesale (a reload from disk) and the session prepared again:
        the receiver no longer holds the base a sender's next delta would be cut against."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
        self.worker.prepare_refit(payload, {"verify_checksums": self.verify})
        return {}


# ---------------------------------------------------------------------------- main loop


def rank_main(conn) -> None:
    """A soak process: answer the parent's commands until told to exit. Each reply is
    ``("ok", result)`` or ``("error", {"error", "error_type", "at", "trace"})``; a fault
    fired by this process sends ``("fault", {...})`` first."""
    apply_launch_defaults()
    torch.set_num_threads(1)
    if os.environ.get(TRACE_ENV) == "1":
        tracemalloc.start()
    # a rebuild after a fault destroys failed groups by design, and megatron-core warns of
    # missing fused kernels on every model build: neither is news in a soak's log
    warnings.filterwarnings("ignore", message="destroy_refit_group")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    import megatron.core  # noqa: F401 - warm: a spare takes a role without importing
    from megatron_reshard.megatron import MegatronRefitSource  # noqa: F401

    Armed.conn = conn
    install_phase_hooks()
    conn.send(("ready", {"pid": os.getpid()}))
    role: Any = None
    turns = 0  # roles taken by this process: past the first, each one is a model switch
    while True:
        try:
            cmd, kwargs = conn.recv()
        except EOFError:  # the parent is gone
            os._exit(0)
        if cmd == "exit":
            os._exit(0)
        try:
            if cmd == "become":
                if role is not None:
                    role.drop_groups()
                role = (TrainRank if kwargs["role"] == "train" else GenRank)(conn, **kwargs)
                turns += 1
                result = role.describe()
            elif cmd == "sample":
                result = dict(sample(), py_threads=threading.active_count(), model_turns=turns,
                              **PyMemory.sample())
            elif cmd == "memory_sites":
                result = PyMemory.sites(**kwargs)
            else:
                result = getattr(role, cmd)(**kwargs)
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - every error goes back to the parent
            conn.send(("error", {"error": f"{type(exc).__name__}: {exc}",
                                 "error_type": type(exc).__name__, "at": time.time(),
                                 "trace": traceback.format_exc()[-3000:]}))


__all__ = ["PHASES", "TRACE_ENV", "PyMemory", "rank_main", "sample"]
