"""Staged refits in a running vLLM ``LLM`` on one GPU (issue 53): vLLM generates while the
next version is received into staging, then one short pause flips it in.

    source /tmp/vsite.env     # vLLM 0.25.1 on the GPU machine (../shared/gpu_vllm)
    python scripts/gpu_engine_staged.py --model moe --graphs on [--size large] [--staged 5]
    bash scripts/gpu_engine_loop.sh OUT staged_moe   # through the case runner

The engine and trainer are those of ``gpu_engine_loop.py`` (one process, the engine core
in-process, driven only through ``LLM``'s methods), with the backend prepared for staged
refits (``prepare_options={"staged": True}``). In order:

1. a first update without ``staged`` (on a staged session: staged and flipped at once),
   checked against vLLM's own ``reload_weights`` (as the loop checks);
2. ``--staged N`` staged refits, each: an optimizer step; ``start_weight_update``,
   ``update_weights({"staged": True, "version": v})`` (returns at once), the trainer sends
   while this process keeps calling ``generate`` (the transfer runs on the worker's thread
   and CUDA stream); then the pause: ``finish_weight_update`` (the flip). Each staged
   version is checked like an in-place one (every param and buffer bit-equal to vLLM's
   reload of the trainer's full tensors, no tensor moved, tokens and logprobs equal,
   state consistent);
3. ``N`` updates without ``staged`` on the same engine: on a staged session they receive into
   staging and flip at once, so their pause is the whole transfer plus the flip (the
   in-place path's pause, an engine prepared without ``staged``, comes from the loop's
   ``--speed`` report of the same model and GPU: ``--compare``);
4. in-flight requests across a flip: requests added to ``llm.llm_engine`` and stepped;
   the flip runs between two scheduler steps; the tokens they made before it must equal
   those of the same requests run wholly at the old version (their KV is kept: vLLM's
   ``pause_generation(mode="keep", clear_cache=False)`` behaviour), and they finish;
5. a failed staged refit: the trainer process is killed after ``update_weights``; the
   flip must raise, the engine keep the old version, consistent, bit-equal to its last
   reference, and generate as before; the retried ``finish_weight_update`` closes vLLM's
   update (its worker keeps it open after a finish that raised) and a new one starts.

Figures (median): the staged pause against the in-place refit's pause (target <= 10%; the
in-place figure from ``--compare``, else this engine's unstaged updates), the
flip's copies against a device memcpy of the same bytes (target >= 90%), the staging
memory, and a generation round's time while a transfer runs against one without.
Prints one line per check and ``ENGINE_STAGED {json}`` last; exit 0 when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine_loop import (MODELS, Loop, differences, rpc_engine_state, rpc_memcpy,  # noqa: E402
                             rpc_shutdown_engine, rpc_snapshot, run_and_report)

ROUND_PROMPTS = 8       # a generation round: this many requests ...
ROUND_TOKENS = 64       # ... of this many greedy tokens each
INFLIGHT_TOKENS = 48    # the in-flight requests' length; the flip comes once each has
FLIP_AFTER = 12         # this many tokens


def rpc_staged_state(worker) -> dict:
    """The stager's state (phase, versions, staging bytes, timings), plain data."""
    return worker.weight_transfer_engine.refit_weights_state().get("staged") or {}


class StagedLoop(Loop):
    def __init__(self, args):
        super().__init__(args)
        self.prepare_options = {"staged": True, "staging_budget_bytes": args.staging_budget}

    def round_prompts(self) -> list:
        return [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(16)]}
                for i in range(ROUND_PROMPTS)]

    def generation_round(self) -> float:
        """Seconds of one ``generate`` of ROUND_PROMPTS x ROUND_TOKENS greedy tokens."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=ROUND_TOKENS, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate(self.round_prompts(), sp, use_tqdm=False)
        return time.perf_counter() - t0

    def staged_refit(self) -> dict:
        """One staged refit, generation rounds running during its transfer; the flip."""
        rpc = self.llm.collective_rpc
        self.version += 1
        t0 = time.perf_counter()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"staged": True, "version": self.version}})
        t1 = time.perf_counter()
        self.send("refit", self.version)
        rounds, phases = [], []
        while True:  # at least one round beside the transfer, until the version is staged
            rounds.append(self.generation_round())
            phases.append(rpc(rpc_staged_state)[0].get("phase"))
            if phases[-1] != "receiving" or len(rounds) >= 20:
                break
        sent = self.expect("refitted")  # the trainer's refit returns after the commit vote
        t2 = time.perf_counter()
        self.llm.finish_weight_update()  # the pause: the flip
        t3 = time.perf_counter()
        self.llm.reset_prefix_cache()
        state = rpc(rpc_staged_state)[0]
        return {"version": self.version, "pause_s": t3 - t2, "start_update_calls_s": t1 - t0,
                "rounds_during_transfer_s": rounds, "phases_after_rounds": phases,
                "sender_refit_s": max(s.get("refit_s", 0.0) for s in sent),
                "worker": {k: state.get(k) for k in (
                    "transfer_s", "mirror_s", "flip_s", "flip_wait_s", "flip_copy_s",
                    "flip_bytes", "staging_bytes", "in_place_params", "tiers")}}

    def inflight_flip(self) -> None:
        """Requests in flight across a flip keep their KV and their tokens from before it."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        prompts = self.round_prompts()[:4]

        def params() -> SamplingParams:  # a fresh one each: LLM.generate sets FINAL_ONLY on its
            return SamplingParams(max_tokens=INFLIGHT_TOKENS, temperature=0.0, ignore_eos=True,
                                  output_kind=RequestOutputKind.CUMULATIVE)

        reference = [list(o.outputs[0].token_ids)
                     for o in self.llm.generate(prompts, params(), use_tqdm=False)]  # wholly at N
        self.step()
        self.version += 1
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"staged": True, "version": self.version}})
        self.send("refit", self.version)
        for i, p in enumerate(prompts):
            engine.add_request(f"inflight-{self.version}-{i}", p, params())
        latest: dict = {}  # request index -> its tokens so far (vLLM may suffix the id)
        trace: list = []  # the first steps: (outputs, tokens per request), for the report

        def advance() -> None:  # one scheduler step
            outs = engine.step()
            for out in outs:
                latest[int(re.search(r"inflight-\d+-(\d+)", out.request_id).group(1))] = \
                    list(out.outputs[0].token_ids)
            if len(trace) < 24:
                trace.append((len(outs), [len(latest.get(i, [])) for i in range(len(prompts))]))

        steps = 0  # until every request has FLIP_AFTER tokens (or none is left in flight)
        while (engine.has_unfinished_requests() and steps < 50 * INFLIGHT_TOKENS
               and min(len(latest.get(i, [])) for i in range(len(prompts))) < FLIP_AFTER):
            advance()
            steps += 1
        before_flip = {i: len(latest.get(i, [])) for i in range(len(prompts))}
        in_flight = engine.has_unfinished_requests()
        self.expect("refitted")
        t0 = time.perf_counter()
        self.llm.finish_weight_update()  # between two scheduler steps, requests in flight
        pause = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            advance()
        got = [latest.get(i, []) for i in range(len(prompts))]
        kept = all(g[:before_flip[i]] == r[:before_flip[i]]
                   for i, (g, r) in enumerate(zip(got, reference)))
        self.report["inflight"] = {"tokens_before_flip": before_flip, "pause_s": pause,
                                   "steps_before_flip": steps, "first_steps": trace,
                                   "changed_after_flip": sum(g != r for g, r in zip(got, reference))}
        self.check(f"{len(prompts)} requests in flight across the flip (after {steps} scheduler "
                   f"steps, pause {pause * 1e3:.2f} ms) finished with {INFLIGHT_TOKENS} tokens",
                   in_flight and len(got) == len(prompts)
                   and all(len(g) == INFLIGHT_TOKENS for g in got), {"tokens at the flip":
                   before_flip, "first steps (outputs, tokens)": trace[:6]})
        self.check("their tokens before the flip equal those of a run wholly at the old version",
                   kept and min(before_flip.values(), default=0) > 0, before_flip)
        self.verify(f"staged refit {self.version} (flipped with requests in flight)")

    def killed_trainer(self) -> None:
        """A staged refit whose trainer dies: the flip raises, the old version stays live."""
        rpc = self.llm.collective_rpc
        live_before = self.gather(rpc_snapshot)
        self.step()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"staged": True, "version": self.version + 1}})
        # killed before it sends: the worker's thread waits in the version vote for a dead
        # peer (a deterministic point before the flip; a kill during the copies could come
        # after a tiny model's transfer ended)
        os.kill(self.trainers[0].pid, signal.SIGKILL)
        self.trainers[0].join(timeout=10)
        t0 = time.perf_counter()
        error = None
        try:
            self.llm.finish_weight_update()
        except Exception as exc:  # noqa: BLE001 - the failure is what is checked
            error = f"{type(exc).__name__}: {exc}"
        took = time.perf_counter() - t0
        self.check(f"the flip raised after the trainer died ({took:.2f} s)", error is not None,
                   (error or "no error")[:300])
        states = rpc(rpc_engine_state)
        self.check(f"the old version {self.version} stays live and consistent",
                   all(s["state"] == "consistent" and s["version"] == self.version for s in states),
                   [(s["state"], s["version"]) for s in states])
        after = self.gather(rpc_snapshot)
        bad = differences(live_before, after)
        self.check(f"every param and buffer unchanged ({len(after)})", not bad, bad[:6])
        tokens, logprobs = self.generate()
        self.check("greedy tokens and logprobs as before the failed refit",
                   (tokens, logprobs) == self.last_gen, f"first {tokens[0][:8]}")
        # vLLM's worker keeps its update session open when finish raises (a retry is how it
        # closes): the retry must close it, and a new update must start
        for what, call in (("a retried finish_weight_update closes vLLM's update session",
                            self.llm.finish_weight_update),
                           ("start_weight_update works again after it", self.llm.start_weight_update)):
            try:
                call()
                problem = None
            except Exception as exc:  # noqa: BLE001 - reported by the check
                problem = f"{type(exc).__name__}: {exc}"[:300]
            self.check(what, problem is None, problem or "")

    def run(self) -> None:
        self.start()
        n = self.args.staged
        self.step()
        r = self.refit()
        r.update(self.verify(f"refit {r['version']} (update without staged: stage and flip at once)"))
        self.generation_round()  # warm-up
        idle = [self.generation_round() for _ in range(5)]
        staged = []
        for _ in range(n):
            self.step()
            s = self.staged_refit()
            s.update(self.verify(f"staged refit {s['version']}"))
            staged.append(s)
            self.say(f"staged refit {s['version']}: pause {s['pause_s'] * 1e3:.2f} ms, "
                     f"rounds beside the transfer {[round(x * 1e3, 1) for x in s['rounds_during_transfer_s']]} ms, "
                     f"worker {s['worker']}")
        at_once = []
        for _ in range(n):
            self.step()
            at_once.append(self.refit())
        self.verify(f"unstaged update {self.version} on the staged session, after the timed ones")
        self.inflight_flip()
        copy_s = self.llm.collective_rpc(rpc_memcpy, args=(self.model_bytes, 20))[0]
        self.figures(staged[1:] or staged, at_once[1:] or at_once, idle, copy_s)
        if self.args.kill:
            self.killed_trainer()
            return  # the refit group lost its trainer: nothing to shut down together
        self.send("stop")
        self.llm.collective_rpc(rpc_shutdown_engine)
        for t in self.trainers:
            t.join(timeout=60)

    def in_place_pause_ms(self) -> tuple:
        """The in-place refit's pause (ms) and where it comes from: ``--compare``'s loop
        report of the same model (an engine prepared without ``staged``), else None."""
        if not self.args.compare or not os.path.exists(self.args.compare):
            return None, None
        with open(self.args.compare) as f:
            speed = json.load(f).get("speed") or {}
        return speed.get("ours_pause_ms"), self.args.compare

    def figures(self, staged: list, at_once: list, idle: list, copy_s: float) -> None:
        med = statistics.median
        first_rounds = [s["rounds_during_transfer_s"][0] for s in staged]
        flip_bytes = med(s["worker"]["flip_bytes"] or 0 for s in staged)
        flip_copy = med(s["worker"]["flip_copy_s"] or 0.0 for s in staged)
        table = {"model_bytes": self.model_bytes, "memcpy_ms": copy_s * 1e3,
                 "staged_pause_ms": med(s["pause_s"] for s in staged) * 1e3,
                 "at_once_pause_ms": med(r["pause_s"] for r in at_once) * 1e3,
                 "flip_ms": med(s["worker"]["flip_s"] or 0.0 for s in staged) * 1e3,
                 "flip_copy_ms": flip_copy * 1e3, "flip_bytes": flip_bytes,
                 "transfer_ms": med(s["worker"]["transfer_s"] or 0.0 for s in staged) * 1e3,
                 "staging_bytes": staged[-1]["worker"]["staging_bytes"],
                 "round_idle_ms": med(idle) * 1e3, "round_beside_transfer_ms": med(first_rounds) * 1e3,
                 "staged_pauses_ms": [s["pause_s"] * 1e3 for s in staged],
                 "at_once_pauses_ms": [r["pause_s"] * 1e3 for r in at_once]}
        table["in_place_pause_ms"], table["in_place_from"] = self.in_place_pause_ms()
        base = table["in_place_pause_ms"] or table["at_once_pause_ms"]
        table["pause_ratio"] = table["staged_pause_ms"] / base
        # the flip's copies against a memcpy of the same bytes, scaled from the model's memcpy
        memcpy_of_flip = copy_s * flip_bytes / max(self.model_bytes, 1)
        table["flip_vs_memcpy"] = memcpy_of_flip / flip_copy if flip_copy else None
        table["generation_slowdown"] = table["round_beside_transfer_ms"] / table["round_idle_ms"]
        self.report["figures"] = table
        self.say(f"figures: {json.dumps(table)}")
        print("| what | median |\n|---|---|")
        for label, value in (
                ("generation pause, staged (finish_weight_update: the flip)", f"{table['staged_pause_ms']:.2f} ms"),
                ("generation pause, in place (the whole refit; --compare)",
                 f"{table['in_place_pause_ms']:.2f} ms" if table["in_place_pause_ms"] else "not given"),
                ("generation pause, staged session updated without staged (stage + flip)",
                 f"{table['at_once_pause_ms']:.2f} ms"),
                ("staged / " + ("in place" if table["in_place_pause_ms"] else "stage + flip"),
                 f"{table['pause_ratio']:.1%} (target <= 10% of in place)"),
                ("flip copies vs device memcpy of the same bytes",
                 f"{table['flip_vs_memcpy']:.0%} (target >= 90%)" if table["flip_vs_memcpy"] else "n/a"),
                ("transfer into staging (worker thread)", f"{table['transfer_ms']:.2f} ms"),
                ("staging memory", f"{table['staging_bytes'] / 2**20:.1f} MiB"),
                ("generation round idle / beside a transfer",
                 f"{table['round_idle_ms']:.1f} / {table['round_beside_transfer_ms']:.1f} ms "
                 f"({table['generation_slowdown']:.2f}x)")):
            print(f"| {label} | {value} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="moe")
    p.add_argument("--graphs", choices=["off", "on"], default="on")
    p.add_argument("--size", choices=["tiny", "large"], default="tiny")
    p.add_argument("--staged", type=int, default=4,
                   help="staged refits (and as many updates without staged)")
    p.add_argument("--compare", default=None,
                   help="gpu_engine_loop.py's --json report (with --speed) of the same model: "
                        "its in-place pause is the figure's baseline")
    p.add_argument("--staging-budget", type=int, default=None,
                   help="staging_budget_bytes (default: every param staged on the GPU)")
    p.add_argument("--no-kill", dest="kill", action="store_false",
                   help="skip the last check (a staged refit whose trainer is killed)")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.quant, args.tp, args.refits, args.speed, args.plan = "none", 1, 0, 0, False
    loop = StagedLoop(args)
    return run_and_report(loop, loop.run, args.json, "ENGINE_STAGED")

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # vLLM's in-process engine leaves threads behind; the report is out
