"""A dict that keeps at most ``limit`` keys, the oldest inserted dropped first: for what a
worker learns once per layer kind and shape and keeps for the process (vLLM's code does not
change while it runs), bounded so that a process that meets shape after shape (many
models, a sweep) does not grow without end. Torch-free, stdlib only."""

from __future__ import annotations

from typing import Any

from megatron_reshard.errors import BadInputError


class BoundedCache(dict):
    """``dict`` whose insert of a new key beyond ``limit`` drops the oldest key first."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise BadInputError(f"BoundedCache limit {limit}: expected an integer >= 1")
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self and len(self) >= self.limit:
            del self[next(iter(self))]  # dicts keep insertion order: the oldest
        super().__setitem__(key, value)


__all__ = ["BoundedCache"]
