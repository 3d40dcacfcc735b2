"""The flip of a staged delta refit checks its base first (issue 53): the live storage written
between the refit's start and its flip (vLLM's ``sleep(level=2)`` + ``wake_up`` leaves
zeros; a user's ``load_weights`` an older policy) must not take the deltas, which were cut
from version N. Processes: the two-world harness of tests/test_staged_refit.py (a real
megatron-core dense model, PP2 on 2 training ranks, 2 generation ranks TP2, gloo, checksums
on), delta refits, the training side leaving every norm param unchanged (so N+1 has params
no delta touches: the flip writes nothing into them unless it copies them).

Per generation rank, four staged refits (1 full, then deltas), each checked bit for bit
against the reference (full HF tensors sliced by vLLM's layout) after its flip:

2. staged; then every live param zeroed in place (what ``sleep(level=2)`` leaves): the flip
   copies what changed from staging whole and names it (``flip_base_changed``).
3. staged; then version N-1's bytes written into the live params (rank 0: all of them;
   rank 1: one param N+1 changes): the same, that param alone named on rank 1.
4. staged, nothing written: no param named, the deltas applied (the check finds what
   changed and nothing else), and the refit is a delta refit (the base the flips left is
   sound).
"""

import time
from datetime import timedelta

import pytest
import torch

from test_staged_refit import GEN, TRAIN, _GEN_STATE
from two_worlds import (FAULT_TIMEOUT_S, changes_ahead, delta_pp2_sender, live_digests, nudge_sparsely,
                        prepared_worker, publish_reference, run_two_worlds)

pytestmark = pytest.mark.slow

REFITS = 4
ZEROS, OLDER, UNTOUCHED = 2, 3, 4  # the refit whose live bytes are overwritten, and how


@torch.no_grad()
def _nudge_all_but_norms(model, step: int) -> None:
    """``nudge_sparsely``, then the norm params put back: N+1 leaves them as they were."""
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    nudge_sparsely(model, step)
    for n, p in model.named_parameters():
        if n in norms:
            p.copy_(norms[n])


def _train(job, control, rank, plan):
    model, source, family, vocab_size, sender = delta_pp2_sender(job, control, rank, GEN,
                                                                 FAULT_TIMEOUT_S)
    rows = []
    for k in range(1, REFITS + 1):
        if k > 1:
            _nudge_all_but_norms(model, 100 * plan["seed"] + k)
        publish_reference(job, control, model, family, vocab_size, source.hf_config, k, GEN)
        control.wait([f"started/{k}/{g}" for g in range(GEN)], timedelta(seconds=60))
        out = sender.refit()
        rows.append({"mode": out["mode"], "version": out.get("version")})
    return {"rows": rows}


@torch.no_grad()
def _overwrite(model, k: int, gen_rank: int, older: dict, changing: list) -> list:
    """Write the live storage in place, as something outside the refit would between its
    start and its flip; the params written."""
    params = dict(model.named_parameters())
    if k == ZEROS:  # sleep(level=2) + wake_up: the same addresses, the contents gone
        for p in params.values():
            p.zero_()
        return sorted(params)
    names = sorted(params) if gen_rank == 0 else changing[:1]
    for n in names:  # version N-1: a plausible-looking older policy
        params[n].copy_(older[n])
    return names


def _gen(job, control, gen_rank, plan):
    options = {"verify_checksums": True, "staged": True}
    worker, model, _ = prepared_worker(job, control, gen_rank, GEN, TRAIN, FAULT_TIMEOUT_S,
                                       options, _GEN_STATE, fresh=True)
    rows, held = [], {}  # held[k]: the live bytes after refit k's flip
    for k in range(1, REFITS + 1):
        # 2-D params N+1 changes (their deltas must not land on other bytes), and the
        # params it leaves as they are (the flip writes nothing into those)
        before, want, changing = changes_ahead(control, k, gen_rank, model)
        untouched = sorted(n for n in before if want.get(n) == before[n])
        control.set(f"started/{k}/{gen_rank}", "1")
        worker.start_staged_refit()
        worker.wait_staged_refit(timeout_s=120)
        written = (_overwrite(model, k, gen_rank, held.get(k - 2), changing)
                   if k in (ZEROS, OLDER) else [])
        out = worker.flip_staged_refit()
        live = live_digests(model)
        rows.append({"k": k, "mode": out["mode"], "written": written, "changing": changing,
                     "untouched": untouched, "flip": out["staged"], "names": sorted(live),
                     "exact": sorted(n for n, d in live.items() if want.get(n) == d),
                     "state": worker.refit_weights_state()})
        held[k] = {n: p.detach().clone() for n, p in model.named_parameters()}
    time.sleep(0.2)
    return {"rows": rows}


@pytest.fixture(scope="module")
def refits(pool):
    return run_two_worlds(pool, TRAIN, GEN, _train, _gen, {"seed": 21}, num_ports=3,
                          timeout_s=300, grace_s=25)


def test_the_flip_copies_whole_what_was_written_after_the_start_and_is_exact(refits):
    for r in range(TRAIN, TRAIN + GEN):
        for row in refits[r]["rows"]:
            # bit-exact at N+1 after every flip, whatever was written into the live storage
            assert row["exact"] == row["names"], (r, row["k"], row["written"][:3],
                                                  sorted(set(row["names"]) - set(row["exact"])))
            assert row["state"]["state"] == "consistent", row["state"]
            assert row["state"]["version"] == row["k"]
    for r in range(TRAIN):  # each flip left a sound base: the next refit is a delta again
        assert [row["mode"] for row in refits[r]["rows"]] == ["full"] + ["delta"] * 3


def test_the_flip_names_the_params_whose_base_changed(refits):
    for r in range(TRAIN, TRAIN + GEN):
        rows = {row["k"]: row for row in refits[r]["rows"]}
        zeroed = rows[ZEROS]
        assert zeroed["mode"] == "delta" and zeroed["untouched"], zeroed["untouched"]
        named = set(zeroed["flip"]["flip_base_changed"])
        # the deltas' targets and the params N+1 leaves alone alike: every byte was zeroed
        assert set(zeroed["changing"]) <= named and set(zeroed["untouched"]) & named, named
        assert named <= set(zeroed["written"])
        older = rows[OLDER]
        assert older["mode"] == "delta"
        named = older["flip"]["flip_base_changed"]
        if r == TRAIN + 1:  # one param written back to N-1: that one alone
            assert named == older["written"] == older["changing"][:1], named
        else:  # every param: those N-1 and N differ in (not the norms: the same bytes)
            assert set(older["changing"]) <= set(named) and not set(named) & set(
                older["untouched"]), named
        quiet = rows[UNTOUCHED]
        assert quiet["mode"] == "delta" and quiet["flip"]["flip_base_changed"] == []
        assert quiet["flip"]["flip_delta_regions"] > 0 and quiet["flip"]["flip_delta_targets"] > 0
