"""Refit contracts between a backend (train source / generation destination) and the loop.

Torch + stdlib only. A backend describes each HF parameter it holds as a LocalParamSpec:
the live tensor (``base``) and, where the transfer cannot read or write ``base`` directly,
a ``pre`` hook that materialises the transfer buffer and a ``post`` hook that finishes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch


@dataclass
class RefitCtx:
    """Handoff between a param's ``pre`` and ``post`` hooks; the engine reads only ``buf``."""

    buf: Optional[torch.Tensor] = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalParamSpec:
    """Recipe for moving one HF param: ``base``, optional ``pre(base) -> RefitCtx``, ``post(ctx)``.

    On the training side ``post`` may run while the batch is still being read (a colocated
    refit's generation ranks read one batch while the next is prepared; the transport keeps
    ``buf`` alive until then): it may drop ``buf`` but must not write into it."""

    base: Any = None
    pre: Optional[Callable[[Any], RefitCtx]] = None
    post: Optional[Callable[[RefitCtx], None]] = None

    def begin(self) -> RefitCtx:
        """Run ``pre`` (or wrap ``base``) and return the context holding the transfer buffer."""
        return self.pre(self.base) if self.pre is not None else RefitCtx(buf=self.base)

    def finish(self, ctx: RefitCtx) -> None:
        """Run ``post`` if there is one."""
        if self.post is not None:
            self.post(ctx)


@dataclass
class HFToLocalParamMap:
    """``hf_name -> LocalParamSpec`` for the params one rank holds."""

    specs: dict[str, LocalParamSpec] = field(default_factory=dict)

    def get(self, hf_name: str, default: Optional[LocalParamSpec] = None) -> Optional[LocalParamSpec]:
        return self.specs.get(hf_name, default)

    def __contains__(self, hf_name: object) -> bool:
        return hf_name in self.specs

    def __len__(self) -> int:
        return len(self.specs)


@runtime_checkable
class RefitBuilderInterface(Protocol):
    """A refit backend builds its ``hf_name -> LocalParamSpec`` map once from the refit info."""

    def build_hf_to_local_param_map(self, refit_info: dict) -> HFToLocalParamMap: ...
