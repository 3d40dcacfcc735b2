"""``receiver.flip_base.check_flip_base`` on real tensors, in process: staging tensors and
live params of the same shapes, the base taken from views of the staging tensors as a
session takes it (``delta.base_digest.take_base`` over its held records), then the live
bytes compared record by record through the same views. The flip's use of it, with real
refits: tests/test_staged_flip_base.py."""

import importlib.util
from pathlib import Path

import torch

from megatron_reshard.delta.base_digest import take_base
from megatron_reshard.receiver.flip_base import check_flip_base

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_flip_base.py"


def _world():
    """Two params (one fused: two records), their staging tensors (the mirror: the same
    bytes), and the held records as views of the staging tensors."""
    g = torch.Generator().manual_seed(5)
    live = {"qkv": torch.randn(12, 8, generator=g).to(torch.bfloat16),
            "down": torch.randn(8, 16, generator=g).to(torch.bfloat16),
            "norm": torch.randn(8, generator=g).to(torch.bfloat16)}
    staging = {n: t.clone() for n, t in live.items()}
    held = [("q", staging["qkv"][:4]), ("kv", staging["qkv"][4:]), ("down", staging["down"])]
    return live, staging, held


def test_the_same_bytes_pass_and_each_written_param_is_named():
    live, staging, held = _world()
    base = take_base(held)
    for t in staging.values():  # the refit writes N+1 into staging: not what is checked
        t.add_(1)
    found = check_flip_base(base, held, staging, live, ["qkv", "down"])
    assert found.changed == [] and found.checked == 2
    assert found.checked_bytes == (12 * 8 + 8 * 16) * 2
    live["qkv"][9, 3] = 0  # one element of the second record of the fused param
    assert check_flip_base(base, held, staging, live, ["qkv", "down"]).changed == ["qkv"]
    live["down"].zero_()   # sleep(level=2)
    assert check_flip_base(base, held, staging, live, ["qkv", "down"]).changed == ["down", "qkv"]
    # only the params asked about (the rest is copied whole by the flip anyway)
    assert check_flip_base(base, held, staging, live, ["down"]).changed == ["down"]


def test_what_proves_nothing_counts_as_changed_and_unheld_params_are_not_checked():
    live, staging, held = _world()
    base = take_base(held)
    assert check_flip_base(None, held, staging, live, ["qkv", "down"]).changed == ["down", "qkv"]
    # a record the base does not know (the held set changed): its param is not proven
    partial = take_base(held[1:])
    assert check_flip_base(partial, held, staging, live, ["qkv", "down"]).changed == ["qkv"]
    # a staged param with no held record takes no delta: not checked, whatever it holds
    live["norm"].zero_()
    found = check_flip_base(base, held, staging, live, ["norm"])
    assert found.changed == [] and found.checked == 0
    assert check_flip_base(base, held, staging, live, []).changed == []


def test_the_benchmark_runs_and_finds_nothing_changed(capsys):
    """``scripts/bench_flip_base.py`` at a toy size (its own assert: the check passes the
    unchanged params); figures are printed, never compared here."""
    spec = importlib.util.spec_from_file_location("bench_flip_base", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--layers", "1", "--hidden", "64", "--ffn", "128", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 params, 6 records" in out and "check / copy" in out, out
