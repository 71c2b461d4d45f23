"""From a validated :class:`~sdpa_numba.problem.kvcache.KVCacheProblem` and Numba device
arrays to the CUDA decode (:mod:`.decode`): the append into the cache on the device, then the
launch.

:func:`prepare` copies what every layer of a step shares to the device once (the block
table, a rotation's table rows); the launch returned rotates q and the new keys into scratch
(:mod:`.rope`) when the step has a rotation, appends, allocates the result and launches,
asynchronously on the default stream.

A quantized cache (:mod:`.quant`): its scales and the new keys and values are first checked
finite on the host (copies: the CPU reads them all for the same check), then the new rows are
quantized into the cache on the device and the kernel reads the cache's bytes with the scales.
"""

import numpy as np
from numba import cuda

from ..problem.quant import check_scales
from .arrays import as_strided, device_array
from .decode import append, decode
from .quant import append_quantized, quant_operands
from .rope import gather_rows, rotate


def _one(x):
    """Device array ``x`` as one batch entry: ``(1, *x.shape)``, a view."""
    return as_strided(x, (1, *x.shape), (0, *x.strides))


def _per_row(x):
    """Packed ``(total, H, E)`` device array ``x`` as ``(total, 1, H, E)``, a view."""
    s0, s1, s2 = x.strides
    return as_strided(x, (x.shape[0], 1, x.shape[1], x.shape[2]), (s0, 0, s1, s2))


def _rows_back(x):
    """``(total, 1, H, E)`` device array ``x`` as ``(total, H, E)``, a view."""
    s0, _, s2, s3 = x.strides
    return as_strided(x, (x.shape[0], x.shape[2], x.shape[3]), (s0, s2, s3))


def _bytes(x):
    """Device array ``x`` (a quantized cache) as its bytes, uint8, a view."""
    return as_strided(x, x.shape, x.strides, np.uint8)


def _host(x):
    """A NumPy copy of device array ``x`` (None stays None), bfloat16 as float32."""
    if x is None:
        return None
    from .._bf16 import is_bfloat16

    if is_bfloat16(x.dtype):  # NumPy's isfinite has no bfloat16: its bits, widened
        bits = as_strided(x, x.shape, x.strides, np.uint16).copy_to_host().astype(np.uint32)
        return (bits << 16).view(np.float32)
    return x.copy_to_host()


def prepare(p):
    """The launch of problem ``p``: ``launch(q, k_cache, v_cache, k, v, out, k_scale=None,
    v_scale=None) -> (out, lse)`` on device arrays checked against ``p`` (``k``, ``v`` None:
    no append; ``out`` None: a new array; ``k_scale``, ``v_scale``: a quantized cache's
    scales, device arrays)."""
    table = cuda.to_device(p.table)
    bounds = (p.lo, p.hi)
    # A ragged batch: its packed rows as one batch entry, placed by its table's rows
    # (sdpa_numba.problem.kvcache.query_rows): (qb, q0, lq_b, i0, off) per sequence.
    ragged = p.cu_q is not None
    seq_rows = p.begin[p.n_seq:].reshape(5, p.n_seq) if ragged else None
    rope = p.rope
    if rope is not None and rope.tables is None:  # rows gathered on the host: copied once
        rows = [cuda.to_device(x) for x in (rope.q_cos, rope.q_sin, rope.k_cos, rope.k_sin)]
    elif rope is not None:  # device tables: their rows gathered on the device, once
        cos, sin = rope.tables
        rows = [gather_rows(cos, rope.q_pos), gather_rows(sin, rope.q_pos),
                gather_rows(cos, rope.k_pos), gather_rows(sin, rope.k_pos)]

    def launch(q, k_cache, v_cache, k, v, out, k_scale=None, v_scale=None):
        qz = None
        if p.quant is not None:
            # NaN / inf in the scales or the new rows, refused before anything is written.
            check_scales(p.quant, _host(k_scale), _host(v_scale), _host(k), _host(v))
            qz = quant_operands(p, k_scale, v_scale)
            k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
        if rope is not None:
            # Into scratch: the caller's q and k are inputs, never written.
            if ragged:  # each token its own sequence of one row (the problem's rows)
                q = _rows_back(rotate(_per_row(q), rows[0], rows[1], rope.interleaved))
                k = _rows_back(rotate(_per_row(k), rows[2], rows[3], rope.interleaved))
            else:
                q = rotate(q, rows[0], rows[1], rope.interleaved)
                k = rotate(k, rows[2], rows[3], rope.interleaved)
        if p.pages is not None and qz is not None:
            append_quantized(p, _one(k) if ragged else k, _one(v) if ragged else v, k_cache,
                             v_cache, qz)
        elif p.pages is not None:
            append(_one(k) if ragged else k, _one(v) if ragged else v, k_cache, v_cache,
                   p.pages, p.slots)
        result = device_array(p.out_shape, p.dtype) if out is None else out
        lse = device_array(p.lse_shape, p.compute_dtype)
        if ragged:
            decode(_one(q), k_cache, v_cache, table, p.kv_lens, p.is_causal, p.scale,
                   _one(result), _one(lse), bounds=bounds, recipe=p.recipe, rows=seq_rows,
                   quant=qz)
        else:
            decode(q, k_cache, v_cache, table, p.kv_lens, p.is_causal, p.scale, result, lse,
                   bounds=bounds, recipe=p.recipe, quant=qz)
        return result, lse

    return launch
