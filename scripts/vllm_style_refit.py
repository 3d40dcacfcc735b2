"""Refit driven the way vLLM drives its workers, from a launcher separate from training.

    python scripts/vllm_style_refit.py                  # both launchers, as two processes
    python scripts/vllm_style_refit.py train --port P   # or each by hand, in two shells
    python scripts/vllm_style_refit.py gen --port P

The **training launcher** starts its own world (real megatron-core model, gloo or NCCL),
publishes the refit payload in its control store (the stand-in for however a job hands
plain data to its vLLM driver: Ray's object store, a file, an HTTP call) and refits.
The **generation launcher** is a vLLM-style driver: it starts one worker process per
generation rank, each holding vLLM-layout parameters (`self.model_runner.model`) and the
`MegatronReshardWorkerExtension` mixed into its class, exactly as vLLM's
`worker_extension_cls` does. The driver then only calls `collective_rpc(method, args)`:
the same method name and the same plain-data arguments to every worker, each result
gathered, any worker's exception raised in the driver, as vLLM does. Every worker derives
its refit-group rank itself (`group_rank=None`). After each refit the driver compares each
worker's parameter digests with the ones the training side published (sliced from the
full HF tensors by an independent reference).

Prints one JSON line `VLLM_STYLE_SUMMARY {...}` per launcher; exit status 0 when every
refit committed and matched bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing import connection as mp_connection
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_reshard.receiver import MegatronReshardWorkerExtension
from megatron_reshard.tools.e2e import run_training_rank, tensor_digest
from megatron_reshard.tools.launch_env import apply_launch_defaults
from megatron_reshard.tools.run_config import add_run_arguments, config_from_args
from megatron_reshard.tools.supervise import write_progress
from megatron_reshard.wire.records import RefitPayload


def _ports(base: int, train_pp: int) -> dict:
    """Control store (training launcher), generation world, one refit group per PP stage."""
    return {"control": base, "gen_world": base + 1, "stages": [base + 2 + s for s in range(train_pp)]}


def _device(backend: str, index: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(index % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


# ---- training launcher ---------------------------------------------------------------------

def _train_process(rank: int, args: argparse.Namespace) -> None:
    ports = _ports(args.port, args.train_pp)
    cfg = config_from_args(args, (ports["control"], *ports["stages"]))
    control = dist.TCPStore(cfg.host, ports["control"], None, rank == 0,
                            timeout=timedelta(seconds=cfg.timeout_s), wait_for_workers=False)
    try:
        out = run_training_rank(rank, cfg, control, _device(cfg.backend, rank))
    except Exception as exc:
        # said now, by the rank: mp.spawn shows the traceback only once every rank has ended
        sys.stderr.write(f"[train rank {rank}] failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        raise
    if rank == 0:
        print("VLLM_STYLE_SUMMARY " + json.dumps({"launcher": "train", "refits": len(out["refits"])}),
              flush=True)
        # the control store lives in this process: keep it until the driver has read the end
        control.wait(["driver/done"], timedelta(seconds=cfg.timeout_s))


def train_launcher(args: argparse.Namespace) -> int:
    ranks = mp.start_processes(_train_process, args=(args,), nprocs=args.train_world,
                               join=False, start_method="spawn")
    # after a rank fails, the others get 5 s to end (a stopped one never does) instead of
    # mp.spawn's 30 s, so this launcher reports the failure soon after it happened
    while not ranks.join(grace_period=5.0):
        pass
    return 0


# ---- generation launcher: a vLLM-style driver and its workers ------------------------------

class EmulatedVllmWorker(MegatronReshardWorkerExtension):
    """What vLLM builds from `worker_extension_cls`: its worker class with the extension
    mixed in. The model sits at `self.model_runner.model`, where the extension looks."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace):
        self.rank, self.world, self.args = rank, world, args
        self.device = _device(args.backend, args.train_world + rank)
        store = dist.TCPStore("127.0.0.1", _ports(args.port, args.train_pp)["gen_world"], world,
                              rank == 0, timeout=timedelta(seconds=args.timeout_s))
        dist.init_process_group(args.backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout_s))
        self.model_runner = SimpleNamespace(model=None)

    # vLLM loads the model from the checkpoint's config at start-up; here, from the payload's
    def load_model(self, hf_config: dict, tp_size: int, ep_size: int, dtype: str) -> int:
        from megatron_reshard.testing.vllm_like import build_vllm_like_model

        self.model_runner.model = build_vllm_like_model(hf_config, self.rank % tp_size, tp_size,
                                                        ep_size, getattr(torch, dtype),
                                                        device=self.device)
        return sum(1 for _ in self.model_runner.model.parameters())

    # the driver's own check (not part of the extension): bits of every live parameter
    def weight_digests(self) -> dict:
        return {n: tensor_digest(p) for n, p in self.model_runner.model.named_parameters()}


def _worker_process(rank: int, world: int, args: argparse.Namespace, conn) -> None:
    """Serve the driver's calls until it says stop: (method, args, kwargs) in, result out."""
    worker = EmulatedVllmWorker(rank, world, args)
    while True:
        call = conn.recv()
        if call is None:
            break
        method, call_args, call_kwargs = call
        try:
            conn.send(("ok", getattr(worker, method)(*call_args, **call_kwargs)))
        except BaseException as exc:  # the driver raises it, naming this worker
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class Driver:
    """The part of vLLM's LLM engine this library meets: worker processes and collective_rpc."""

    def __init__(self, world: int, args: argparse.Namespace):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        self.progress_file, self.calls = args.progress_file, 0
        # once a worker has answered, how long the others get to (a refit ends on every
        # worker at once, or fails on each within the group's timeout; a stopped one never
        # answers: vLLM's driver would wait for it forever)
        self.answer_s = args.timeout_s + ANSWER_S
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_process, args=(rank, world, args, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        for conn in self.conns:
            conn.send((method, tuple(args), dict(kwargs or {})))
        results, pending, deadline = {}, dict(enumerate(self.conns)), None
        while pending and (deadline is None or time.monotonic() < deadline):
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            for conn in mp_connection.wait(list(pending.values()), wait_s):
                rank = self.conns.index(conn)
                results[rank] = conn.recv()
                del pending[rank]
                if deadline is None:  # the others finish the same call about as soon
                    deadline = time.monotonic() + self.answer_s
        self.calls += 1
        write_progress(self.progress_file, self.calls)  # each call a step (tools.supervise)
        failed = [(rank, text) for rank, (status, text) in sorted(results.items())
                  if status == "error"]
        silent = (f"worker(s) {sorted(pending)} did not answer within {self.answer_s:g} s of "
                  f"the first answer (stopped or hung)" if pending else "")
        if failed:
            rank, text = failed[0]
            raise RuntimeError(f"collective_rpc({method!r}) failed on {len(failed)} worker(s)"
                               f"{'; ' + silent if silent else ''}; worker {rank}: {text}")
        if silent:
            raise RuntimeError(f"collective_rpc({method!r}): {silent}")
        return [results[rank][1] for rank in range(len(self.conns))]

    def shutdown(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():  # stopped or hung: it would outlive the driver
                proc.kill()
                proc.join()


def gen_launcher(args: argparse.Namespace) -> int:
    from megatron_reshard.wire.codec import decode_payload  # msgspec: the driver decodes

    ports = _ports(args.port, args.train_pp)
    stage_world = args.train_world // args.train_pp
    timeout = timedelta(seconds=args.timeout_s)
    control = dist.TCPStore("127.0.0.1", ports["control"], None, False, timeout=timeout,
                            wait_for_workers=False)
    payload = decode_payload(control.get("payload"))  # plain dict: what collective_rpc carries
    write_progress(args.progress_file, 0)  # the training side is up
    driver = Driver(args.gen_world, args)
    summary = {"launcher": "gen", "versions": [], "mismatched": [], "worker_pids": []}
    try:
        hf_config = RefitPayload.of(payload).hf_config.to_plain()  # the record's plain form
        driver.collective_rpc("load_model", (hf_config, args.gen_tp, args.gen_ep, args.dtype))
        driver.collective_rpc("init_refit_groups", ("127.0.0.1", ports["stages"], None,
                                                    stage_world + args.gen_world, args.backend,
                                                    args.timeout_s))
        verify = not args.no_verify  # checksums on both sides, or on neither
        driver.collective_rpc("prepare_refit", (payload, {"verify_checksums": verify}))
        for step in range(args.refits):
            results = driver.collective_rpc("refit")
            summary["versions"].append(sorted({r["version"] for r in results}))
            driver.collective_rpc("check_refit_weights_consistent")
            if not verify:
                continue
            control.wait([f"expected/{step}/{g}" for g in range(args.gen_world)], timeout)
            digests = driver.collective_rpc("weight_digests")
            bad = []
            for g, actual in enumerate(digests):
                expected = json.loads(control.get(f"expected/{step}/{g}"))
                bad += [f"gen {g}: {n}" for n in sorted(set(expected) | set(actual))
                        if expected.get(n) != actual.get(n)]
            summary["mismatched"].append(bad)
        reports = driver.collective_rpc("report")
        summary["weights"] = [r["weights"]["state"] for r in reports]
        summary["worker_pids"] = [p.pid for p in driver.procs]
        driver.collective_rpc("destroy_refit_groups", (args.timeout_s,))
    finally:
        driver.shutdown()
        try:
            control.set("driver/done", "1")
        except Exception:  # noqa: BLE001 - the store's host (training rank 0) is gone
            pass
    summary["driver_pid"] = os.getpid()
    ok = (len(summary["mismatched"]) == (args.refits if verify else 0)
          and all(not bad for bad in summary["mismatched"])
          and summary["versions"] == [[k + 1] for k in range(args.refits)])
    summary["verified"] = ok
    print("VLLM_STYLE_SUMMARY " + json.dumps(summary), flush=True)
    return 0 if ok else 1


STARTUP_S = 180.0  # until the driver's first step: imports, spawns, model builds
# after one launcher ended: its peer's ranks fail within the group's timeout + 5 s of the
# fault, the driver waits --timeout-s + ANSWER_S from a first answer for the others, then
# ends its workers
SETTLE_MARGIN_S = 30.0
ANSWER_S = 10.0


def both(args: argparse.Namespace, argv: list) -> int:
    """Start the two launchers as separate processes, as two jobs would be, and supervise
    them (``tools.supervise``): killed only after 3 x --timeout-s without a step of the
    driver's (STARTUP_S before its first), or once one has ended and the other has not
    within --timeout-s + SETTLE_MARGIN_S (its ranks fail and print why first; a stopped
    rank is then killed with its launcher's whole process group)."""
    from megatron_reshard.tools.supervise import read_progress, start, supervise

    if args.port is None:
        from megatron_reshard.tools.worlds import free_ports

        args.port = free_ports(2 + args.train_pp)[0]
    progress = tempfile.mktemp(prefix="vllm_style_progress_")
    common = [*argv, "--port", str(args.port)]
    procs = {"train": start([sys.executable, __file__, "train", *common])}
    time.sleep(0.5)  # the control store's host comes up first
    procs["gen"] = start([sys.executable, __file__, "gen", *common, "--progress-file", progress])
    try:
        codes, why = supervise(procs, lambda: read_progress(progress),
                               stall_s=3 * args.timeout_s, settle_s=args.timeout_s + SETTLE_MARGIN_S,
                               start_s=max(STARTUP_S, 3 * args.timeout_s))
    finally:
        for path in (progress, progress + ".tmp"):
            if os.path.exists(path):
                os.remove(path)
    shown = {name: "killed" if code is None else code for name, code in codes.items()}
    print(f"vllm_style_refit: training launcher exit {shown['train']}, generation launcher "
          f"exit {shown['gen']}{f' (killed: {why})' if why else ''}", file=sys.stderr)
    return 0 if codes == {"train": 0, "gen": 0} else 1


def main(argv: list | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    role = argv.pop(0) if argv and argv[0] in ("train", "gen") else None
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(p)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="gloo on CPU, nccl on GPUs (default: %(default)s)")
    p.add_argument("--port", type=int, default=None,
                   help="first of 2 + train-pp loopback ports (default: free ones, for both)")
    p.add_argument("--progress-file", default=None, help=argparse.SUPPRESS)
    p.set_defaults(model="dense", train_world=2, train_tp=2, train_pp=1, gen_world=2, gen_tp=2,
                   refits=2)
    args = p.parse_args(argv)
    args.device = "cuda" if args.backend == "nccl" else "cpu"
    cfg = config_from_args(args, tuple(range(1 + args.train_pp)))
    if cfg.problems():
        print("vllm_style_refit: " + "; ".join(cfg.problems()), file=sys.stderr)
        return 2
    apply_launch_defaults()  # before the launchers start: their workers log less
    if role is None:
        return both(args, argv)
    if args.port is None:
        print("vllm_style_refit: the train and gen launchers need --port", file=sys.stderr)
        return 2
    return train_launcher(args) if role == "train" else gen_launcher(args)


if __name__ == "__main__":
    sys.exit(main())
