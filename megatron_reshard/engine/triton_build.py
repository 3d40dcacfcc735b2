"""Triton kernels built once per process, or None where Triton is absent (CPU builds of
torch ship none). Torch + stdlib only: Triton is imported lazily, at the first use."""

from __future__ import annotations

from typing import Any, Callable, Optional


def built_once(build: Callable[[Any, Any], Any]) -> Callable[[], Optional[Any]]:
    """A getter of ``build(triton, triton.language)``, run at its first call (None, also
    remembered, where Triton cannot be imported)."""
    cache: list = []

    def get() -> Optional[Any]:
        if not cache:
            try:
                import triton
                import triton.language as tl
            except Exception:  # noqa: BLE001 - CPU builds of torch ship no Triton
                cache.append(None)
            else:
                cache.append(build(triton, tl))
        return cache[0]

    return get


__all__ = ["built_once"]
