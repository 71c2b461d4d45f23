"""From a validated :class:`~sdpa_numba.problem.kvcache.KVCacheProblem` and Numba device
arrays to the CUDA decode (:mod:`.decode`): the append into the cache on the device, then the
launch.

:func:`prepare` copies what every layer of a step shares to the device once (the block
table); the launch returned appends, allocates the result and launches, asynchronously on the
default stream.
"""

from numba import cuda

from .arrays import device_array
from .decode import append, decode


def prepare(p):
    """The launch of problem ``p``: ``launch(q, k_cache, v_cache, k, v, out) -> (out, lse)``
    on device arrays checked against ``p`` (``k``, ``v`` None: no append; ``out`` None: a new
    array)."""
    table = cuda.to_device(p.table)
    bounds = (p.lo, p.hi)

    def launch(q, k_cache, v_cache, k, v, out):
        if p.pages is not None:
            append(k, v, k_cache, v_cache, p.pages, p.slots)
        result = device_array(p.out_shape, p.dtype) if out is None else out
        lse = device_array(p.lse_shape, p.compute_dtype)
        decode(q, k_cache, v_cache, table, p.kv_lens, p.is_causal, p.scale, result, lse,
               bounds=bounds, recipe=p.recipe)
        return result, lse

    return launch
