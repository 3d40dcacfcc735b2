"""The flip of a staged refit writes into the storage vLLM holds at the flip (processes: a
real receiver session needs the training ranks of its refit groups; the two-world harness of
tests/test_staged_refit.py, real megatron-core model, gloo, end-to-end checksums on).

Per generation rank, four staged refits:

1. plain: staged, flipped.
2. staged, then one param that N+1 changes is re-allocated before the flip (rank 0:
   ``param.data = clone``; rank 1: a new ``Parameter`` in other strides), then the flip: the
   param vLLM holds now must be bit-exact at N+1 (the old flip wrote the old storage).
3. a param re-allocated before the start (the other way round on each rank): re-bound, not
   refused; bit-exact at N+1 after the flip.
4. staged, then on rank 0 a param widened to float32 before the flip: the flip refuses
   before any byte of it is written, N stays live and consistent; rank 1 flips to N+1.
"""

import time

import pytest
import torch

from megatron_reshard.tools.e2e import tensor_digest
from test_staged_refit import GEN, TRAIN, _GEN_STATE, _train
from two_worlds import FAULT_TIMEOUT_S, changes_ahead, live_digests, prepared_worker, run_two_worlds

pytestmark = pytest.mark.slow

REFITS = 4


def _reallocate(model, name: str, how: str) -> torch.Tensor:
    """vLLM re-allocating ``name``: ``data`` (``param.data = ...``), ``parameter`` (a new
    ``Parameter`` in other strides where it has two dims), ``widen`` (float32). The param
    vLLM holds now."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    param = getattr(module, leaf)
    if how == "data":
        param.data = param.data.clone()
    elif how == "widen":
        param.data = param.data.float()
    else:
        data = param.data.t().contiguous().t() if param.dim() == 2 else param.data.clone()
        setattr(module, leaf, torch.nn.Parameter(data, requires_grad=False))
    return getattr(module, leaf)


def _gen(job, control, gen_rank, plan):
    options = {"verify_checksums": True, "staged": True}
    worker, model, _ = prepared_worker(job, control, gen_rank, GEN, TRAIN, FAULT_TIMEOUT_S,
                                       options, _GEN_STATE, fresh=True)
    rows = []
    for k in range(1, REFITS + 1):
        # a param this refit changes: stale bytes in it cannot pass for N+1
        before, want, changing = changes_ahead(control, k, gen_rank, model)
        row = {"k": k, "moved": None, "error": None}
        how = {2: ("data", "parameter"), 3: ("parameter", "data")}.get(k, (None, None))[gen_rank]
        if k == 3:  # before the start: the session re-binds instead of refusing
            row["moved"] = changing[0]
            moved = _reallocate(model, changing[0], how)
        control.set(f"started/{k}/{gen_rank}", "1")
        try:
            worker.start_staged_refit()
            worker.wait_staged_refit(timeout_s=120)
        except Exception as exc:  # noqa: BLE001 - reported (the old code refused step 3)
            rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
            break
        if k == 2:
            row["moved"] = changing[0]
            moved = _reallocate(model, changing[0], how)
        if k == 4 and gen_rank == 0:
            row["moved"] = changing[0]
            _reallocate(model, changing[0], "widen")
        at_flip = live_digests(model)
        try:
            out = worker.flip_staged_refit()
            row["rebound"] = out["staged"].get("flip_rebound")  # (absent before)
            row["version"] = out["version"]
        except Exception as exc:  # noqa: BLE001 - the refusal is the test's subject
            row["error"] = f"{type(exc).__name__}: {exc}"
        live = live_digests(model)
        row["exact"] = sorted(n for n, d in live.items() if want.get(n) == d)
        row["unchanged_by_flip"] = live == at_flip
        row["still_n"] = sorted(n for n, d in live.items() if before.get(n) == d)
        row["names"] = sorted(live)
        if row["moved"] and k in (2, 3):  # the object vLLM holds now, and its bytes
            row["moved_is_vllms"] = dict(model.named_parameters())[row["moved"]] is moved
            row["moved_exact"] = tensor_digest(moved) == want[row["moved"]]
        row["state"] = worker.refit_weights_state()
        rows.append(row)
    time.sleep(0.2)
    return {"rows": rows}


@pytest.fixture(scope="module", params=[False, True], ids=["full", "delta"])
def refits(pool, request):
    plan = {"refits": REFITS, "delta": request.param, "seed": 11, "fault": None,
            "victim": None}
    return request.param, run_two_worlds(pool, TRAIN, GEN, _train, _gen, plan, num_ports=3,
                                         timeout_s=300, grace_s=25)


def test_the_flip_writes_n_plus_1_into_a_param_vllm_re_allocated_after_the_receive(refits):
    delta, results = refits
    for r in range(TRAIN, TRAIN + GEN):
        rows = results[r]["rows"]
        assert rows[0]["error"] is None and rows[1]["error"] is None, rows[:2]
        # N+1 where vLLM reads now: the old flip wrote the storage vLLM had left (a new
        # Parameter; after a delta refit, ``param.data = ...`` too)
        assert rows[1]["moved_is_vllms"] and rows[1]["moved_exact"], (r, rows[1]["moved"])
    for r in range(TRAIN, TRAIN + GEN):
        rows = results[r]["rows"]
        moved_after_receive = rows[1]
        assert moved_after_receive["moved"] in moved_after_receive["rebound"]
        assert rows[0]["rebound"] == [], rows[0]
        assert len(rows) == REFITS, rows[-1]  # the old session refused step 3
        for row in rows[:3]:
            assert row["error"] is None, row
            assert row["exact"] == row["names"], sorted(set(row["names"]) - set(row["exact"]))
        assert rows[2]["moved_is_vllms"] and rows[2]["moved_exact"], rows[2]
        assert rows[2]["moved"] in rows[2]["rebound"], rows[2]
        assert rows[2]["state"]["version"] == 3 and rows[2]["state"]["state"] == "consistent"
    for r in range(TRAIN):
        assert results[r]["error"] is None, results[r]


def test_a_param_whose_dtype_changed_before_the_flip_refuses_it_before_any_byte(refits):
    delta, results = refits
    refused, flipped = results[TRAIN]["rows"][3], results[TRAIN + 1]["rows"][3]
    assert "flip is refused before writing any byte" in refused["error"], refused
    assert refused["moved"] in refused["error"] and "torch.float32" in refused["error"]
    assert "live weights are consistent at version 3" in refused["error"], refused["error"]
    assert refused["unchanged_by_flip"], refused  # not one byte of the flip was written
    assert set(refused["still_n"]) == set(refused["names"]) - {refused["moved"]}
    state = refused["state"]
    assert state["state"] == "consistent" and state["version"] == 3, state
    assert state["staged"]["phase"] == "idle" and state["staged"]["staged_version"] is None
    assert flipped["error"] is None and flipped["exact"] == flipped["names"], flipped
    assert flipped["state"]["version"] == 4
