"""Transfer engine: exact shard-to-shard reshard of global tensors between two layouts.

geometry (who owns which box) -> param_plan (who sends which box to whom, with the
optional ``link_costs`` model; proven by ``plan_check``; cached by ``plan.Planner``) ->
execute, the orchestration of one call: checks (layouts and this rank's tensors) -> agree
(one small vote, so bad input fails on every rank) -> schedule (plain-data rounds of
messages) -> program (views, copies, packing, CUDA streams) over a P2P ``transport``;
``batch`` holds the per-batch state a ``Planner`` caches. ``reference`` is the golden,
slow transport used by the tests.
"""

from .api import DTensorRef, Transfer, xferdtensor
from .execute import xfer_batch
from .param_plan import ParamPlan, build_plan
from .plan import Planner, layout_key
from .reference import xfer_batch_reference
from .p2p import P2PTransport

__all__ = ["DTensorRef", "Transfer", "xferdtensor", "xfer_batch", "xfer_batch_reference",
           "Planner", "ParamPlan", "build_plan", "layout_key", "P2PTransport"]
