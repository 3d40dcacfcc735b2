"""What the library keeps for the whole process and learns per layer kind and shape stays
bounded (issue 56): a worker that meets shape after shape (a sweep, many models) keeps at
most ``limit`` verdicts, the oldest dropped, and still answers each layer correctly."""

import pytest
import torch

from megatron_reshard.receiver import kernel_layouts, staged_conversion
from megatron_reshard.receiver.bounded_cache import BoundedCache
from megatron_reshard.receiver.staged_conversion import StagedLayer


def test_a_bounded_cache_drops_the_oldest_key_past_its_limit():
    cache = BoundedCache(limit=3)
    for k in "abcd":
        cache[k] = k.upper()
    assert list(cache.items()) == [("b", "B"), ("c", "C"), ("d", "D")]
    cache["c"] = "again"  # a key already held is updated in place, nothing dropped
    assert list(cache) == ["b", "c", "d"] and cache["c"] == "again"
    with pytest.raises(ValueError, match="limit 0"):
        BoundedCache(limit=0)


def _layer(rows: int) -> StagedLayer:
    """A linear layer whose conversion hands its input back (as Triton's block kernels do)."""
    weight = torch.zeros(rows, 8, dtype=torch.bfloat16)
    return StagedLayer(f"layers.{rows}.proj", "Fp8LinearMethod", "TRITON", ("weight",),
                       (weight,), run=lambda ts: ts)


def test_the_dry_runs_learned_per_shape_stay_bounded(monkeypatch):
    monkeypatch.setattr(staged_conversion, "_dry_runs", BoundedCache(limit=4))
    for rows in range(1, 11):  # ten shapes through a cache of four
        layer = _layer(rows)
        staged_conversion._dry_run(layer)
        assert layer.identity  # each answered by its own dry run
    assert len(staged_conversion._dry_runs) == 4
    assert [key[2] for key in staged_conversion._dry_runs] == [((r, 8),) for r in (7, 8, 9, 10)]


def test_the_process_caches_keyed_by_shapes_have_bounds():
    # the module-level caches as the library declares them (not the test's replacements)
    assert isinstance(kernel_layouts._learned, BoundedCache) and kernel_layouts._learned.limit == 64
    assert isinstance(staged_conversion._dry_runs, BoundedCache)
    assert staged_conversion._dry_runs.limit == 256
