"""Delta refits: per bulk param the plan moves in one hop, only the elements whose bits
changed since the last committed refit (docs/DESIGN.md, "Delta refits"). Torch + stdlib
only (the receiver imports it); never imports ``refit`` (the refit protocol drives it).

- ``bases``: what the training side keeps (``TrainBase``, under ``DeltaConfig``'s budget);
  ``base_digest``: the generation side's proof that its storage is still the base;
  ``eligible``: which params go as deltas (payload-derived, alike on every rank).
- ``wire_format``: a region's encodings and header on the wire; ``encoding``: a region cut
  and applied (torch, or the kernels on CUDA);
- ``kernels`` (which tensors take the Triton kernels, the cut), ``kernel_apply`` (the
  apply), ``triton_cut`` / ``triton_apply`` (the kernels' code);
- ``mover``: ``DeltaMover``, the transport's delta path of one stage, batched per peer.

The vote that decides a delta or a full refit is part of the refit protocol
(``refit.delta_vote``).
"""

from megatron_reshard.delta.bases import DeltaConfig

__all__ = ["DeltaConfig"]
