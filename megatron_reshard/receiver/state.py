"""What the generation side's weights hold: the version, and whether they are consistent.

Torch-free, plain data. A refit writes params one batch at a time, so a refit that fails
part-way leaves some params from the new version and the rest from the old one. This
state says which: ``consistent`` (every param is from ``version``; nothing was written by
a failed refit) or ``inconsistent`` (``started_from`` is the version the weights had, and
``overwritten`` names the model's params — vLLM's names, e.g. ``qkv_proj.weight`` — that a
failed refit may have written since). ``not_refitted`` names the params the payload does
not write and the user listed as kept-as-loaded (``prepare_refit``'s ``keep_as_loaded``;
any other unwritten param is refused there): "consistent at version V" covers every
other param; these hold what vLLM loaded, whatever the version. It lives with the
model (the vLLM worker keeps it across new refit groups and new payloads), and only a
refit that commits everywhere moves ``version`` and restores consistency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatron_reshard.errors import MegatronReshardError


class InconsistentWeightsError(MegatronReshardError, RuntimeError):
    """The weights mix versions after a failed refit; generating from them is refused."""


@dataclass
class WeightState:
    version: Optional[int] = None          # the last committed refit's version
    started_from: Optional[int] = None     # while inconsistent: the version before the failure
    overwritten: set = field(default_factory=set)  # params written since the last commit
    last_error: Optional[str] = None
    refits: int = 0                        # committed refits
    failed_refits: int = 0
    not_refitted: tuple = ()               # kept as loaded by the user's choice (sorted)

    @property
    def consistent(self) -> bool:
        return not self.overwritten

    def writing(self, names: Iterable[str]) -> None:
        """Params about to be written by the refit in progress."""
        if self.consistent:
            self.started_from = self.version
        self.overwritten.update(names)

    def committed(self, version: Optional[int], names: Iterable[str],
                  not_refitted: Iterable[str] = ()) -> None:
        """The refit landed everywhere: every param it carried is from ``version`` now.
        Params a failed refit overwrote and this one did not carry stay listed;
        ``not_refitted``: the params this refit's payload leaves as loaded (user's list)."""
        self.overwritten.difference_update(names)
        self.not_refitted = tuple(sorted(not_refitted))
        self.version = version
        self.refits += 1
        if self.consistent:
            self.started_from = None

    def failed(self, error: str) -> None:
        self.last_error = error
        self.failed_refits += 1

    def as_dict(self) -> dict:
        return {"state": "consistent" if self.consistent else "inconsistent",
                "version": self.version, "started_from": self.started_from,
                "overwritten": sorted(self.overwritten),
                "not_refitted": list(self.not_refitted), "refits": self.refits,
                "failed_refits": self.failed_refits, "last_error": self.last_error}

    def require_consistent(self) -> None:
        """Raise ``InconsistentWeightsError`` (naming the params) unless consistent."""
        if not self.consistent:
            names = sorted(self.overwritten)
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            raise InconsistentWeightsError(
                f"the weights are inconsistent: a failed refit overwrote {shown} after version "
                f"{self.started_from}; the last error: {self.last_error}. Run a refit that "
                f"completes to restore them")


__all__ = ["InconsistentWeightsError", "WeightState"]
