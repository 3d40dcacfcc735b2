"""The soak (issue 52): one long-lived training world and one generation world refitting in
a loop, with faults from a seeded schedule at random points, every invariant checked after
every refit and every fault, leaks sampled as it goes.

    megatron-reshard soak --refits 1000 --faults 100 --seed 0 --report soak.json
    python scripts/soak.py ...   (the same)

Layout: a training world of one rank (a real megatron-core model, dense or MoE, TP1 PP1,
Adam steps between refits, a checkpoint every few refits) and ``--gen`` generation ranks
(vLLM layout, TP ``--gen``, the worker extension), one refit group of gloo over loopback;
on a GPU every rank sits on cuda:0 and the group moves bytes with the colocated
transport; on CPU each rebuild picks p2p or colocated (shared memory). Full and delta
refits (delta on for most group builds; the library picks the mode), checksums on or off
per build (``--checksums``), the model switched between dense and MoE every
``--switch-every`` refits.

Faults (``FAULTS``): SIGKILL or SIGSTOP of a rank on either side at a phase of the refit
(version vote, plan check, bytes, delta cut/apply, commit; the training rank hosts the
group's store: ``*_store_host`` hits it at the commit vote), a generation tensor written
behind the library's back, the training world restarted from an older checkpoint (it first
replays the checkpoint's version: refused), a truncated or foreign payload, a generation
rank whose weights were reloaded (the delta base gone), the training params moved to new
memory. After each the survivors rebuild what the README says (new groups, a new sender,
``init_refit_groups`` + ``prepare_refit``), dead ranks restart, and the loop goes on.
Checks and counters: ``tools.soak_checks``. The report: counters, violations with
examples, faults by kind, leak slopes per 1,000 refits; exit status 1 on any violation.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_reshard.groups.faults import RETIRE_MARGIN_S
from megatron_reshard.tools.soak_checks import (MARGIN_S, Tally, check_delta_base, check_survivor,
                                                check_version, check_weights)
from megatron_reshard.tools.soak_leaks import Leftovers, leak_slopes, orphan_segments
from megatron_reshard.tools.soak_options import FAULT_KINDS
from megatron_reshard.tools.soak_procs import Procs, error_of
from megatron_reshard.tools.soak_rank import PHASES, TRACE_ENV
from megatron_reshard.tools.soak_summary import summary_lines
from megatron_reshard.tools.worlds import free_ports
from megatron_reshard.wire.codec import decode_payload

FAULTS = FAULT_KINDS
SIGNAL_FAULTS = FAULTS[:6]  # kill_/stop_ of train, gen, store host
# issue 50's two silent outcomes: counted as silent here until trust-core's fix lands
ISSUE_50 = ("params_moved", "tamper_gen")
HANG_SLACK_S = 60.0  # past timeout + 5 s: a rank that still has not answered is hung
CALL_S = 600.0       # the longest any ordinary command may take on a loaded machine


@dataclass
class SoakConfig:
    refits: int = 1000
    faults: int = 100
    seed: int = 0
    gen: int = 2
    device: str = "cpu"
    timeout_s: float = 5.0
    models: tuple = ("dense", "moe")
    switch_every: int = 100
    sample_every: int = 10
    settle_samples: bool = True  # wait for failed groups to be let go before a sample
    ckpt_every: int = 5
    kinds: tuple = FAULTS
    transports: tuple = ("p2p", "colocated")  # on CPU, picked per group build (GPU: colocated)
    checksums: str = "mixed"  # "on", "off" or "mixed" (seeded, per group build)
    delta: float = 0.8        # the chance a group build asks for delta refits
    lr: float = 1e-6
    max_minutes: Optional[float] = None
    progress_s: float = 10.0
    report: Optional[str] = None
    workdir: Optional[str] = None
    quiet: bool = False
    trace_python_memory: bool = False  # tracemalloc in every rank: the sites that grew
    rebuild_models: bool = False  # a switch builds its model again (the old way: its cost)


class Soak:
    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.tally = Tally()
        if cfg.trace_python_memory:  # read by each rank as it starts (spawned: inherited)
            os.environ[TRACE_ENV] = "1"
        self.procs = Procs()
        self.gens = [f"gen{g}" for g in range(cfg.gen)]
        self.workdir = cfg.workdir or tempfile.mkdtemp(prefix="soak_")
        self.refs: dict[int, dict] = {}          # version -> gen rank -> digests
        self.payloads: dict[str, dict] = {}      # model -> payload (plain dict)
        self.checkpoints: dict[str, int] = {}    # model -> version of its saved checkpoint
        self.model = cfg.models[0]
        self.sent = 0                            # the highest version sent so far
        self.sender_base: Optional[int] = None   # the current sender's last committed version
        self.plan_checked = False                # the current groups ran a refit
        self.build: dict = {}                    # the current groups' options
        self.gen_version: dict[str, Optional[int]] = {}
        self.written: dict[str, set] = {g: set() for g in self.gens}
        self.cause: Optional[str] = None         # the fault since the last clean refit
        self.expect_full = True
        self.refits = self.committed = 0
        self.modes: Counter = Counter()
        self.full_reasons: Counter = Counter()
        self.builds: Counter = Counter()  # group builds by transport and options
        self.faults: Counter = Counter()         # injected (fired) per kind
        self.not_fired: Counter = Counter()
        self.t0 = time.time()
        self._last_progress = 0.0
        self._switched = -1
        self.aborted: Optional[str] = None
        self.repaired = False
        self.repairing = False
        self.last_failure = 0.0   # when a refit group last failed
        self.settle_s = 0.0       # time spent waiting for failed groups before samples
        self.leftovers = Leftovers()  # what failed groups left on their survivors
        self.memory_sites: Optional[dict] = None  # rank -> Python allocation sites that grew
        self.host_samples: list = []  # (refits, dead ranks' shared memory left on the host)

    # ------------------------------------------------------------------ worlds and groups

    def start_train(self, checkpoint: bool = False) -> dict:
        """The training world: a fresh process for a restart (from the model's last
        checkpoint when ``checkpoint``), the same one for a model switch."""
        if checkpoint or "train" not in self.procs.by_name or not self.procs["train"].alive():
            self.procs.start("train")
        path = os.path.join(self.workdir, f"ckpt_{self.model}.pt")
        reply = self._one("train", "become", dict(
            role="train", model=self.model, gen=self.cfg.gen, device=self.cfg.device,
            rebuild=self.cfg.rebuild_models,
            seed=self.cfg.seed, checkpoint=path if checkpoint else None))
        self.payloads[self.model] = decode_payload(reply["payload"])
        return reply

    def start_gen(self, name: str, fresh: bool) -> None:
        if fresh or name not in self.procs.by_name or not self.procs[name].alive():
            self.procs.start(name)
        self._one(name, "become", dict(role="gen", gen_rank=self.gens.index(name), gen=self.cfg.gen,
                                       device=self.cfg.device, model=self.model,
                                       rebuild=self.cfg.rebuild_models,
                                       payload=self.payloads[self.model]))
        self.gen_version[name] = None  # a new worker: a new weight state
        self.written[name] = set()

    def _one(self, name: str, cmd: str, kwargs: dict) -> dict:
        replies, _ = self.procs.call({name: (cmd, kwargs)}, CALL_S)
        reply = replies[name]
        if reply["status"] != "ok":
            raise RuntimeError(f"soak: {name} {cmd} failed: {reply.get('error', reply['status'])}"
                               f"\n{reply.get('trace', '')}")
        return reply["result"]

    def rebuild(self, bad: Optional[str] = None) -> None:
        """New refit groups on every rank, a new sender, ``init_refit_groups`` +
        ``prepare_refit``; with ``bad`` ("truncated" or "foreign") one generation rank is
        given that payload instead, which it must refuse, and every rank must then fail."""
        cfg = self.cfg
        build = {"port": free_ports(1)[0], "timeout_s": cfg.timeout_s, "seed": self.rng.randrange(1 << 30),
                 "transport": "colocated" if cfg.device == "cuda" else self.rng.choice(cfg.transports),
                 "verify": {"on": True, "off": False}.get(cfg.checksums, self.rng.random() < 0.5),
                 "delta": self.rng.random() < cfg.delta}
        payload = self.payloads[self.model]
        victim = self.rng.choice(self.gens) if bad else None
        cmds = {"train": ("groups", {k: build[k] for k in ("port", "transport", "timeout_s",
                                                             "verify", "delta", "seed")})}
        for g in self.gens:
            given = self._bad_payload(bad) if g == victim else payload
            cmds[g] = ("groups", dict(port=build["port"], timeout_s=cfg.timeout_s,
                                      verify=build["verify"], payload=given, seed=build["seed"]))
        replies, _ = self.procs.call(cmds, CALL_S)
        self.build, self.sender_base, self.plan_checked = build, None, False
        self.builds[f"{build['transport']}{'+delta' if build['delta'] else ''}"
                    f"{'+checksums' if build['verify'] else ''}"] += 1
        self.expect_full = True
        failed = {n: r for n, r in replies.items() if r["status"] != "ok"}
        if bad is None:
            if failed:
                raise RuntimeError(f"soak: a group build failed: {json.dumps(failed)[:2000]}")
            return
        self._check_bad_payload(bad, victim, replies)
        self.rebuild()

    def _bad_payload(self, bad: str) -> dict:
        payload = self.payloads[self.model]
        if bad == "truncated":  # the last layer's records cut off
            cut = dict(payload, layer_names=payload["layer_names"][:-1])
            cut["per_layer_params"] = {k: v for k, v in payload["per_layer_params"].items()
                                       if k in cut["layer_names"]}
            return cut
        other = [m for m in self.payloads if m != self.model]
        if other:  # another model's payload
            return self.payloads[other[0]]
        return dict(payload, gen_tp_size=self.cfg.gen + 1)  # built for another TP

    def _check_bad_payload(self, bad: str, victim: str, replies: dict) -> None:
        """The rank given a bad payload refuses it in prepare_refit; the next refit then
        fails on every other rank within the timeout, naming it (the fault board)."""
        where = f"{bad}_payload"
        self.faults[where] += 1
        if replies[victim]["status"] == "ok":
            self.tally.bad("bad_payload_accepted", {"where": where, "rank": victim})
            return
        self.tally.ok("bad_payload_refused")
        t0 = time.time()
        others = ["train"] + [g for g in self.gens if g != victim]
        self.sent += 1
        refits, _ = self.procs.call({n: ("refit", {"version": self.sent} if n == "train" else {})
                                     for n in others}, self.cfg.timeout_s + MARGIN_S + HANG_SLACK_S)
        for n in others:
            err = error_of(refits[n])
            if refits[n]["status"] == "missing":
                self.tally.bad("hangs", {"where": where, "rank": n})
            check_survivor(self.tally, n, err, t0, self.cfg.timeout_s, where)
        self._recover(refits, where)

    # --------------------------------------------------------------------------- refits

    def refit(self, arm: Optional[tuple[str, dict]] = None, version: Optional[int] = None,
              where: str = "refit") -> dict:
        """One refit on every rank (``arm``: (victim, {"phase", "signal", "after"})); checks
        every invariant on what the ranks report; returns the replies."""
        replay = version is not None  # a restarted trainer's own version, as it is
        if not replay:
            reference = self._one("train", "step", {"lr": self.cfg.lr})
            self.sent += 1
            version = self.sent
            self.refs[version] = {int(g): d for g, d in reference.items()}
        cmds = {"train": ("refit", {"version": version})}
        cmds.update({g: ("refit", {}) for g in self.gens})
        if arm is not None:
            cmds[arm[0]][1]["arm"] = arm[1]
        bound = self.cfg.timeout_s + MARGIN_S + HANG_SLACK_S
        replies, fault = self.procs.call(cmds, CALL_S, after_fault_s=bound)
        self.refits += 1
        if fault is not None:
            self._after_fault(fault, replies, where)
            return replies
        if arm is not None:
            self.not_fired[arm[1]["phase"]] += 1
        errors = {n: error_of(r) for n, r in replies.items()}
        if replay:
            self._check_replay(replies, errors, version)
            return replies
        if any(e is not None for e in errors.values()) or \
                any(r["status"] != "ok" for r in replies.values()):
            for n, r in replies.items():
                if r["status"] == "missing":
                    self.tally.bad("hangs", {"where": where, "rank": n, "no_fault": True})
            # not a violation (a tampered base under checksums fails loudly), but say why
            self.tally.bad("refits_failed_without_signal", {
                "where": where, "cause": self.cause,
                "errors": {n: e["error"][:200] for n, e in errors.items() if e}})
            self._check_gens(replies, where)
            self._recover(replies, where)
            return replies
        self._committed(replies, version, where)
        return replies

    def _committed(self, replies: dict, version: int, where: str) -> None:
        train = replies["train"]["result"]
        self.committed += 1
        self.modes[train["mode"]] += 1
        if train["mode"] == "full":  # why, in the words of the library (its first clause)
            self.full_reasons[str(train["full_reason"]).split(";")[0].split(":")[0][:80]] += 1
        if train["version"] != version:
            self.tally.bad("version_mismatch", {"where": where, "sent": version, "train": train})
        if train["mode"] == "delta" and self.expect_full:
            self.tally.bad("full_expected_got_delta", {"where": where, "cause": self.cause})
        for g in self.gens:
            res = replies[g]["result"]
            if res["state"]["version"] != version or res["state"]["state"] != "consistent":
                self.tally.bad("version_mismatch", {"where": where, "rank": g, "sent": version,
                                                    "state": res["state"]})
            check_delta_base(self.tally, self.gens.index(g), res, self.refs, self.sender_base, where)
        silent = not self._check_gens(replies, where)
        for g in self.gens:
            if replies[g]["result"]["mode"] == "full":
                self.written[g] = set()
        self.sender_base, self.plan_checked, self.expect_full = version, True, False
        self.cause = None
        if self.committed % self.cfg.ckpt_every == 0:
            self._one("train", "save", {"path": os.path.join(self.workdir, f"ckpt_{self.model}.pt"),
                                        "version": version})
            self.checkpoints[self.model] = version
        if silent:  # repair, so that one silent fault is counted once
            self.tally.ok("silent_refits")
            self._repair()

    def _repair(self) -> None:
        """A new source over the training params as they are now, new groups, and a full
        refit over them: the wrong bytes a silent outcome left are overwritten before the
        next fault (else its checks would count them again, under that fault's name)."""
        self._one("train", "rebind", {})
        self.rebuild()
        self.repaired = True
        if not self.repairing:  # once: a repair refit that is silent again is counted, not retried
            self.repairing = True
            try:
                self.refit(where="repair")
            finally:
                self.repairing = False

    def _check_gens(self, replies: dict, where: str) -> bool:
        exact = True
        for g in self.gens:
            r = replies.get(g)
            if r is None or r["status"] != "ok":
                continue
            res = r["result"]
            exact &= check_weights(self.tally, self.gens.index(g), res, self.refs,
                                   self.written[g], self.cause, where)
            self.gen_version[g] = check_version(self.tally, self.gen_version.get(g), res["state"],
                                                f"{where} {g}")
        return exact

    def _check_replay(self, replies: dict, errors: dict, version: int) -> None:
        """A restarted trainer's old version: refused on every rank, nothing written."""
        held = [v for v in self.gen_version.values() if v is not None]
        refused = all(e is not None and e.get("error_type") == "VersionRefused"
                      for e in errors.values())
        if refused:
            self.tally.ok("old_version_refused")
        elif held and max(held) >= version:
            self.tally.bad("old_version_accepted", {"version": version, "held": held,
                                                    "errors": {n: (e or {}).get("error", "")[:200]
                                                               for n, e in errors.items()}})
        self._check_gens(replies, "replay")
        if not refused:
            self._recover(replies, "replay")

    def _after_fault(self, fault: dict, replies: dict, where: str) -> None:
        """A victim fired: every survivor failed in time naming the cause; the generation
        ranks' weights are what their state says; the world is rebuilt."""
        victim = fault["victim"]
        kind = f"{fault['signal']}_{'train' if victim == 'train' else 'gen'}@{fault['phase']}"
        self.faults[kind] += 1
        self.cause = kind
        for name, reply in replies.items():
            if name == victim:
                continue
            if reply["status"] == "missing":
                self.tally.bad("hangs", {"where": where, "rank": name, "fault": kind})
            check_survivor(self.tally, name, error_of(reply), fault["at"], self.cfg.timeout_s,
                           f"{where} {kind}")
        self._check_gens(replies, f"{where} {kind}")
        self._recover(replies, kind)

    def _recover(self, replies: dict, where: str) -> None:
        """Restart what died (a dead or stopped training rank from its last checkpoint, a
        generation rank fresh), then rebuild the groups everywhere."""
        self.last_failure = time.time()
        dead = [n for n, r in replies.items() if r["status"] in ("died", "missing")]
        dead += [n for n, p in self.procs.by_name.items() if not p.alive() and n not in dead]
        for name in dead:
            self.procs[name].kill()
        if "train" in dead:
            self.start_train(checkpoint=self.model in self.checkpoints)
        for name in dead:
            if name != "train":
                self.start_gen(name, fresh=True)
        self.rebuild()

    # ---------------------------------------------------------------------------- faults

    def inject(self) -> None:
        """One fault from the seeded schedule, then the refit it hits."""
        kind = self.rng.choice(self.cfg.kinds)
        if kind == "restart_old_checkpoint" and self.model not in self.checkpoints:
            kind = "kill_train"
        self.cause = kind
        if kind in SIGNAL_FAULTS:
            self.refit(arm=self._arm(kind), where=kind)
        elif kind == "tamper_gen":
            g = self.rng.choice(self.gens)
            out = self._one(g, "tamper", {"seed": self.rng.randrange(1 << 30)})
            self.written[g].add(out["param"])
            self.faults[kind] += 1
            self.refit(where=kind)
        elif kind == "params_moved":
            self._one("train", "move_params", {})
            self.faults[kind] += 1
            self.repaired = False
            self.refit(where=kind)
            if not self.repaired and self.procs["train"].alive():
                self._repair()  # the sender may still read the storage the params left
        elif kind == "gen_reload":
            g = self.rng.choice(self.gens)
            self._one(g, "reload", {"payload": self.payloads[self.model],
                                    "seed": self.rng.randrange(1 << 30)})
            # every param rewritten behind the library's back: no longer any version's
            self.written[g] = set(self.refs.get(self.sent, {}).get(self.gens.index(g), {}))
            self.expect_full = True
            self.faults[kind] += 1
            self.refit(where=kind)
        elif kind == "restart_old_checkpoint":
            self.faults[kind] += 1
            self.procs["train"].kill()
            reply = self.start_train(checkpoint=True)
            self.rebuild()
            self.refit(version=reply["checkpoint_version"], where=kind)
        else:
            self.rebuild(bad=kind.split("_")[0])

    def _arm(self, kind: str) -> tuple[str, dict]:
        signal_name, side = kind.split("_", 1)
        if side == "store_host":
            return "train", {"phase": "commit", "signal": signal_name, "after": 0}
        victim = "train" if side == "train" else self.rng.choice(self.gens)
        phases = ["version_vote", "bytes", "commit"]
        if not self.plan_checked:
            phases.append("plan_check")
        if self.build.get("delta") and self.build.get("transport") == "p2p" and \
                self.sender_base is not None and not self.expect_full:
            phases.append("delta")
        phase = self.rng.choice(phases)
        assert phase in PHASES
        return victim, {"phase": phase, "signal": signal_name,
                        "after": self.rng.randrange(2) if phase == "delta" else 0}

    # ------------------------------------------------------------------------- the loop

    def run(self) -> dict:
        cfg = self.cfg
        try:
            self.start_train()
            for g in self.gens:
                self.start_gen(g, fresh=True)
            self.rebuild()
            self.sample()
            while self.refits < cfg.refits or sum(self.faults.values()) < cfg.faults:
                if cfg.max_minutes is not None and time.time() - self.t0 > 60 * cfg.max_minutes:
                    break
                if cfg.switch_every and self.refits and self.refits % cfg.switch_every == 0 \
                        and len(cfg.models) > 1 and self._switched != self.refits:
                    self._switch()
                faults_left = cfg.faults - sum(self.faults.values())
                refits_left = max(1, cfg.refits - self.refits)
                if faults_left > 0 and self.rng.random() < min(1.0, faults_left / refits_left):
                    self.inject()
                else:
                    self.refit()
                if self.refits % cfg.sample_every == 0:
                    self.sample()
                self.progress()
        except Exception:  # noqa: BLE001 - the soak's own failure ends it with its report
            self.aborted = traceback.format_exc()[-4000:]
        finally:
            if cfg.trace_python_memory:
                self.python_memory_sites()
            report = self.report()
            self.procs.close()
            if self.cfg.workdir is None:  # the checkpoints' temporary folder
                shutil.rmtree(self.workdir, ignore_errors=True)
        self.progress(final=True)
        return report

    def _switch(self) -> None:
        self._switched = self.refits
        self.model = self.cfg.models[(self.cfg.models.index(self.model) + 1) % len(self.cfg.models)]
        self.start_train()
        for g in self.gens:
            self.start_gen(g, fresh=False)
        self.rebuild()

    def sample(self) -> None:
        """Leak figures of every rank, taken once the groups that failed last have been let
        go: a failed gloo group is held until its abandoned operations end (the group's
        timeout + ``faults.RETIRE_MARGIN_S``), so a sample taken sooner counts its threads
        and sockets, which are not leaked."""
        settle = self.last_failure + self.cfg.timeout_s + RETIRE_MARGIN_S + 1.0 - time.time()
        if settle > 0 and self.cfg.settle_samples:
            time.sleep(settle)
            self.settle_s += settle
        by_pid = self.procs.sample(self.refits)
        self.leftovers.settled(self.refits, self.faults, by_pid)
        self.host_samples.append((self.refits, orphan_segments(p["pid"] for p in self.procs.lives)))

    def python_memory_sites(self) -> None:
        """The allocation sites that grew most in each live rank (``--trace-python-memory``)."""
        replies, _ = self.procs.call({n: ("memory_sites", {}) for n, p in
                                      self.procs.by_name.items() if p.alive()}, 120.0)
        self.memory_sites = {n: r.get("result") for n, r in replies.items()}

    # --------------------------------------------------------------------------- report

    def report(self) -> dict:
        out = {"config": asdict(self.cfg),
               "elapsed_s": round(time.time() - self.t0, 1), "refits": self.refits,
               "committed": self.committed, "modes": dict(self.modes),
               "full_reasons": dict(self.full_reasons), "builds": self.builds,
               "faults": sum(self.faults.values()), "faults_by_kind": dict(self.faults),
               "armed_not_fired": dict(self.not_fired),
               "silent_outcomes": self.tally.counts["silent_refits"],
               "hangs": self.tally.counts["hangs"],
               **self.tally.as_dict(),
               "leaks": leak_slopes([*self.procs.lives,
                                     {"role": "host", "samples": self.host_samples}]),
               "failed_group_leftovers": self.leftovers.report(),
               "python_memory_sites": self.memory_sites,
               "processes_started": len(self.procs.lives),
               "sample_settle_s": round(self.settle_s, 1), "aborted": self.aborted}
        if self.cfg.report:
            with open(self.cfg.report + ".tmp", "w") as f:
                json.dump(out, f, indent=1, default=str)
            os.replace(self.cfg.report + ".tmp", self.cfg.report)
        return out

    def progress(self, final: bool = False) -> None:
        now = time.time()
        if not final and now - self._last_progress < self.cfg.progress_s:
            return
        self._last_progress = now
        if self.cfg.report and not final:
            self.report()  # a soak cut short still leaves its figures
        if self.cfg.quiet:
            return
        v = self.tally.violations()
        print(f"soak: {self.refits}/{self.cfg.refits} refits ({self.committed} committed, "
              f"{self.modes['delta']} delta), {sum(self.faults.values())}/{self.cfg.faults} faults, "
              f"silent {self.tally.counts['silent_refits']}, hangs "
              f"{self.tally.counts['hangs']}, violations {sum(v.values())} {v or ''}, "
              f"{self.model}, {now - self.t0:.0f} s", file=sys.stderr, flush=True)


def run_soak(cfg: SoakConfig) -> dict:
    return Soak(cfg).run()


def run(args) -> int:
    """``megatron-reshard soak`` and ``scripts/soak.py``: run, print the summary, exit 1 on
    any violation."""
    from megatron_reshard.tools.launch_env import apply_launch_defaults

    apply_launch_defaults()
    kinds = tuple(args.kinds.split(",")) if args.kinds else FAULTS
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        print(f"soak: unknown fault kinds {unknown}; known: {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    cfg = SoakConfig(refits=args.refits, faults=args.faults, seed=args.seed, gen=args.gen,
                     device=args.device, timeout_s=args.timeout_s,
                     models=tuple(args.models.split(",")), switch_every=args.switch_every,
                     sample_every=args.sample_every, kinds=kinds, checksums=args.checksums,
                     transports=tuple(args.transports.split(",")),
                     max_minutes=args.max_minutes, report=args.report, progress_s=args.progress_s,
                     trace_python_memory=args.trace_python_memory,
                     rebuild_models=args.rebuild_models)
    report = run_soak(cfg)
    for line in summary_lines(report):
        print(line, flush=True)
    if report["aborted"]:
        print(f"soak aborted:\n{report['aborted']}", file=sys.stderr)
    return 1 if report["violations"] or report["aborted"] else 0


__all__ = ["FAULTS", "ISSUE_50", "SIGNAL_FAULTS", "Soak", "SoakConfig", "run", "run_soak",
           "summary_lines"]
