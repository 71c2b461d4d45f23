"""The problem layer: target-neutral, written once, used by both back ends (CPU and CUDA) and
by both directions (forward and backward).

* :mod:`.plan`: :func:`plan` validates the operands and returns the :class:`Plan`;
* :mod:`.kvcache`: :func:`~.kvcache.kvcache_problem`, a decode step against a key/value cache
  validated once (:class:`~.kvcache.KVCacheProblem`), and the keys each sequence reads;
* :mod:`.dtypes`: the storage dtypes (:func:`check_storage_dtype`) and the compute-dtype rule
  (:func:`compute_dtype`);
* :mod:`.arguments`: checks of flags, ``dropout_p``, the seed, device strides;
* :mod:`.out`: checks of a caller's ``out`` buffer (shapes, strides, byte ranges);
* :mod:`.views`: the operands as ``(*batch, heads, rows, cols)`` views;
* :mod:`.batching`: batch dims merged, and the split into kernel launches;
* :mod:`.reductions`: gradients summed back to broadcast shapes;
* :mod:`.flops`: the FLOP count of the benchmarks.

A target passes its ``as_strided`` (and, for ``out``, its ``address``); everything else is
shapes, strides and dtypes.
"""

from .arguments import check_device_strides, check_dropout, check_flag, check_seed, shape_str
from .batching import for_each_launch
from .dtypes import FLOATS, check_storage_dtype, compute_dtype
from .flops import flops
from .out import check_out, host_address, may_self_overlap
from .plan import Plan, plan
from .reductions import broadcast_axes, sum_to
from .views import broadcast_view, operand_views, row_view

__all__ = ["Plan", "plan", "FLOATS", "check_storage_dtype", "compute_dtype", "check_flag",
           "check_dropout", "check_seed", "check_device_strides", "shape_str", "check_out", "host_address",
           "may_self_overlap", "broadcast_view", "operand_views", "row_view",
           "for_each_launch", "broadcast_axes", "sum_to", "flops"]
