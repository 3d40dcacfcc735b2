"""The refit protocol both sides run: the training sender and the generation receiver.

Torch + stdlib only (the receiver imports it). ``protocol`` states the order of one refit
once; ``loop`` walks a stage's bulk params through the engine (``local`` checks this rank's
side first, ``order`` derives the transfer order from the payload alone); ``packed`` moves
the small full tensors as one buffer; ``checksums`` and ``integrity`` check the bytes end to
end; ``version`` is the check that opens every refit (``delta_vote``: its delta/full
columns), ``commit`` the vote that ends it; ``finite`` is the opt-in NaN/Inf check of the
training weights. Delta refits themselves (bases, encoding, kernels, mover) are the
``megatron_reshard.delta`` package, which never imports this one.
"""

from megatron_reshard.refit.commit import CommitOutcome, commit_refit
from megatron_reshard.refit.loop import PlanMismatchError, RefitLoop, RefitStats
from megatron_reshard.refit.protocol import RefitProtocol, RefitRound
from megatron_reshard.refit.version import (NonFiniteRefused, RefitRefused, TensorsRefused,
                                            VersionRefused, agree_version)

__all__ = ["CommitOutcome", "NonFiniteRefused", "PlanMismatchError", "RefitLoop", "RefitProtocol", "RefitRefused",
           "RefitRound", "RefitStats", "TensorsRefused", "VersionRefused", "agree_version",
           "commit_refit"]
