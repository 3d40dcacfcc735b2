"""Transfer engine: exact shard-to-shard reshard of global tensors between two layouts.

geometry (who owns which box) -> plan (who sends which box to whom, cached) -> execute
(validate, agree, batched rounds over a P2P transport). ``reference`` is the golden,
slow transport used by the tests; ``m2n`` the optional native backend.
"""

from .api import DTensorRef, Transfer, xferdtensor
from .execute import xfer_batch
from .plan import ParamPlan, Planner, build_plan, layout_key
from . import m2n
from .reference import xfer_batch_reference
from .transport import P2PTransport

__all__ = ["DTensorRef", "Transfer", "xferdtensor", "xfer_batch", "xfer_batch_reference",
           "Planner", "ParamPlan", "build_plan", "layout_key", "P2PTransport"]
