"""Ring attention over MPI (see :mod:`sdpa_numba.distributed.ring_forward`)."""

from . import ring_forward as _impl
from .ring_forward import *  # noqa: F401,F403
from .ring_forward import (__all__, _attend, _attend_backward,  # noqa: F401
                           _mpix_query_cuda_support, _work)
