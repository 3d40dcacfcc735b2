"""Every param of the generation model is refitted, or the user said to keep it as loaded.

Torch-free. A param that no payload entry writes (a bias the training model lacks, an
extra buffer-like param, a head the payload ties) would keep the bytes it was loaded
with while the weight state says the refit committed: silently stale. So
``prepare_refit`` refuses such params, naming them, unless the user lists them in
``keep_as_loaded`` (exact vLLM param names or ``fnmatch`` patterns). Listed params are
reported as not refitted (``report()["kept_as_loaded"]``, the weight state's
``not_refitted``). An entry that matches no unwritten param is an error too: it would
claim a param is kept as loaded while the refit writes it, or name nothing at all.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Optional, Sequence

from megatron_reshard.errors import BadInputTypeError
from megatron_reshard.receiver.targets import TargetError


class UncoveredParamsError(TargetError):
    """Params of the generation model that the payload does not write, not listed in
    ``keep_as_loaded`` (or an entry of ``keep_as_loaded`` that matches none of them)."""


def parse_keep_as_loaded(value: Optional[Iterable[str]]) -> tuple[str, ...]:
    """The option as a tuple of names/patterns (a bare string is refused: it would be
    iterated letter by letter)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not all(isinstance(v, str) and v for v in value):
        raise BadInputTypeError(f"keep_as_loaded: expected a list of vLLM param names or fnmatch "
                        f"patterns, found {value!r}")
    return tuple(value)


def kept_as_loaded(gaps: Mapping[str, int], keep: Sequence[str], where: str) -> dict[str, int]:
    """The unwritten params (``{name: elements not written}``) the user keeps as loaded;
    ``UncoveredParamsError`` naming the rest, or the entries of ``keep`` that match none."""
    unmatched = [k for k in keep if not any(k == n or fnmatchcase(n, k) for n in gaps)]
    if unmatched:
        raise UncoveredParamsError(
            f"{where}: keep_as_loaded entries {unmatched} match no param that this payload "
            f"leaves unwritten (unwritten here: {sorted(gaps) or 'none'}); list only params "
            f"the refit does not write")
    kept = {n: c for n, c in gaps.items() if any(k == n or fnmatchcase(n, k) for k in keep)}
    stale = sorted(set(gaps) - set(kept))
    if stale:
        counts = ", ".join(f"{n} ({gaps[n]} elements)" for n in stale[:8])
        more = f", ... ({len(stale)} in all)" if len(stale) > 8 else ""
        raise UncoveredParamsError(
            f"{where}: the payload writes no bytes to {len(stale)} param(s) of this model: "
            f"{counts}{more}. After a refit they would still hold what was loaded while the "
            f"weights report the new version. Refit them from the training side (is the "
            f"model the same architecture?), or list them in prepare_refit's keep_as_loaded "
            f"option (exact names or fnmatch patterns) to keep them as loaded, reported as "
            f"not refitted")
    return kept


__all__ = ["UncoveredParamsError", "kept_as_loaded", "parse_keep_as_loaded"]
