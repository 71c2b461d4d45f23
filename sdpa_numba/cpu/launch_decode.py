"""From a validated :class:`~sdpa_numba.problem.kvcache.KVCacheProblem` and NumPy arrays to
the jitted decode (:mod:`.decode`): the append into the cache and the launch.

:func:`prepare` does, once per problem, what depends on it alone: the compiled entry point
(serial or parallel, by the bytes read; one specialization per storage dtype and recipe type,
all layouts 'A'), the storage views' dtype, and the arguments every layer passes alike. The
launch returned then only views the arrays, appends, allocates the result and calls the entry.
"""

import numpy as np

from .._runtime import check_jit, compile_entry, kernel_launch
from .launch import arr, kernel_types, recipe_type
from .storage import is_bfloat16

#: Bytes of keys and values read below which a call runs on the calling thread, without a
#: parallel launch. Serial and parallel runs give bitwise the same result, so the threshold
#: never changes a result; it depends on the shapes and lengths only. Measured (2 threads,
#: median after 50 ms idle, B1 H8 D128 float32, a loaded machine): a parallel launch costs
#: ~0.16 ms more than a serial call (0.26 against 0.10 ms at 0.5 MiB), and serial calls
#: stream ~16 GB/s, so two threads would pay off from about 2 x 0.16 ms x 16 GB/s ~ 4 MiB;
#: but at 2 MiB serial took 0.27 ms, parallel 0.41, at 8 MiB 0.62 and 0.78 with the second
#: core busy, and at B1 Hq12 H4 S2080 D64 (4.1 MiB, a transformers decode step; AMD EPYC,
#: back-to-back calls) the serial kernel 0.33 ms, the parallel 0.40 (min of 40). Hence 8 MiB.
SERIAL_BYTES = 8 << 20

_entries: dict = {}


def entry(parallel, dtype, recipe_t, scale_dtype=None):
    """The compiled decode for a storage dtype and recipe type (plain, windowed and soft-capped
    calls share the plain recipe's type: their numbers are run-time values); with
    ``scale_dtype`` (float32 or float16), for a quantized cache with such scales (every
    format one specialization: the caches are read as int8, the format is a run-time
    value)."""
    from numba import types

    from .decode import decode, decode_serial

    # Looked up by the type's identity first: hashing a recipe's Numba type walks all its
    # fields (~10 us a call); Numba interns types, so the same recipe gives the same object.
    fast = _entries.get((parallel, dtype, id(recipe_t), scale_dtype))
    if fast is not None and fast[0] is recipe_t:
        return fast[1]
    key = (parallel, dtype, recipe_t, scale_dtype)
    if key not in _entries:
        st, ct, _ = kernel_types(dtype, "none")
        cache_t = st if scale_dtype is None else types.int8
        sig = (arr(st, 4, True), arr(cache_t, 4, True), arr(cache_t, 4, True),
               arr(types.int32, 2, True), arr(types.int64, 1, True), types.boolean,
               types.float64, arr(st, 4, False), arr(ct, 3, False), recipe_t,
               arr(types.int64, 1, True))
        if scale_dtype is not None:
            sc_t = arr(types.uint16 if scale_dtype == np.float16 else types.float32, 4, True)
            d_t = arr(types.float32, 2, True)
            sig += (types.Tuple((sc_t, sc_t, d_t, d_t, types.int64)),)
        else:
            sig += (types.none,)
        _entries[key] = compile_entry(decode if parallel else decode_serial, sig)
    _entries[parallel, dtype, id(recipe_t), scale_dtype] = (recipe_t, _entries[key])
    return _entries[key]


def _storage_dtype(dtype):
    """The dtype the kernels read ``dtype`` as (float16 as uint16, bfloat16 as int16); None
    where it is read as is."""
    if dtype == np.float16:
        return np.dtype(np.uint16)
    return np.dtype(np.int16) if is_bfloat16(dtype) else None


def append(p, k, v, k_cache, v_cache):
    """Write the new keys and values into the cache slots of problem ``p`` (checked)."""
    if p.pages is None:
        return
    n, (h, e), ev = len(p.pages), p.k_shape[-2:], p.v_shape[-1]
    k_cache[p.pages, p.slots] = k.reshape(n, h, e)
    v_cache[p.pages, p.slots] = v.reshape(n, h, ev)


def _quant_args(p, k_scale, v_scale):
    """The kernel's ``quant`` tuple of problem ``p``'s quantized cache: the scales as
    ``(N, S, H, n_blocks)`` (ones for fp8), the descales as ``(B, H)`` (ones for int8), the
    format's code; views, no copies."""
    n, s, h = p.k_cache_shape[:3]
    b = p.n_seq
    spec = p.quant
    if spec.fp8:
        ones = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (n, s, h, 1))
        kd = np.broadcast_to(k_scale, (b, h))
        vd = np.broadcast_to(v_scale, (b, h))
        return (ones, ones, kd, vd, spec.fmt)
    one = np.broadcast_to(np.ones((1, 1), np.float32), (b, h))

    def blocks(x):
        x = x[..., None] if x.ndim == 3 else x
        return x.view(np.uint16) if x.dtype == np.float16 else x
    return (blocks(k_scale), blocks(v_scale), one, one, spec.fmt)


def _quantized_rows(p, x, scale, name):
    """The new rows ``x`` (B, Lq_new, H, D) of problem ``p``'s append, quantized: ``(values,
    scales)`` of shapes (n, H, D) and (n, H, n_blocks) (None for fp8), ``n = B * Lq_new``."""
    from .quant import quantize_blocks, quantize_fp8

    n = len(p.pages)
    h, d = x.shape[-2:]
    x = np.ascontiguousarray(x, np.float64 if x.dtype == np.float64 else np.float32)
    x = x.reshape(n, 1, h, d)
    values = np.empty((n, 1, h, d), np.int8)
    if p.quant.fp8:
        descale = np.broadcast_to(scale, (p.n_seq, h))[p.append_b]
        quantize_fp8(x, values, np.ascontiguousarray(descale, np.float32), p.quant.fmt)
        return values[:, 0], None
    nb = 1 if scale.ndim == 3 else scale.shape[3]
    scales = np.empty((n, 1, h, nb), np.float32)
    quantize_blocks(x, values, scales, scale.dtype == np.float16)
    return values[:, 0], scales[:, 0]


def append_quantized(p, k, v, k_cache, v_cache, k_scale, v_scale):
    """The append of problem ``p`` into a quantized cache: the new keys and values quantized
    (:mod:`.quant`'s rule) into their slots, and for int8 caches their scales."""
    if p.pages is None:
        return
    for x, cache, scale, name in ((k, k_cache, k_scale, "k"), (v, v_cache, v_scale, "v")):
        values, scales = _quantized_rows(p, x, scale, name)
        cache.view(np.int8)[p.pages, p.slots] = values
        if scales is not None:
            scale[p.pages, p.slots] = scales.reshape(scale[p.pages, p.slots].shape)


def prepare(p):
    """The launch of problem ``p``: ``launch(q, k_cache, v_cache, k, v, out) -> (out, lse)``
    on NumPy arrays checked against ``p`` (``k``, ``v`` None: no append; ``out`` None: a new
    array). Compiles the entry point now if it is not yet. With a rotation (``p.rope``), q and
    ``k`` are rotated into scratch first (:mod:`.rope`), and the rotated keys appended."""
    empty = not (int(np.prod(p.out_shape)) or int(np.prod(p.lse_shape)))
    parallel = p.read_bytes >= SERIAL_BYTES
    # The parallel kernel whatever the thread count: which kernel runs depends on the shape
    # only, so a result cannot change with the thread count (the serial and the parallel
    # kernel may round the last bit differently when loaded from the cache).
    quant = p.quant
    fn = None if empty else entry(parallel, p.dtype, recipe_type(p.recipe),
                                  None if quant is None else quant.scale_dtype)
    sd = _storage_dtype(p.dtype)
    out_shape, lse_shape, dtype, ct = p.out_shape, p.lse_shape, p.dtype, p.compute_dtype
    table, kv_lens, is_causal, scale, r, lo = (p.table, p.kv_lens, p.is_causal, p.scale,
                                               p.recipe, p.lo)
    rope = p.rope
    # A ragged batch: its packed rows as one batch entry, placed by its table (the kernel's
    # kv_begin, see sdpa_numba.problem.kvcache.query_rows).
    ragged = p.cu_q is not None
    begin = lo if p.begin is None else p.begin

    def launch(q, k_cache, v_cache, k, v, out, k_scale=None, v_scale=None):
        if rope is not None:
            # Into scratch: the caller's q and k are inputs, never written.
            from .rope import rotate

            check_jit()
            if ragged:  # each token its own sequence of one row (the problem's rows)
                q = rotate(q[:, None], rope.q_cos, rope.q_sin, rope.interleaved)[:, 0]
                k = rotate(k[:, None], rope.k_cos, rope.k_sin, rope.interleaved)[:, 0]
            else:
                q = rotate(q, rope.q_cos, rope.q_sin, rope.interleaved)
                k = rotate(k, rope.k_cos, rope.k_sin, rope.interleaved)
        if k is not None:
            if quant is None:
                append(p, k, v, k_cache, v_cache)
            else:
                append_quantized(p, k, v, k_cache, v_cache, k_scale, v_scale)
        result = np.empty(out_shape, dtype) if out is None else out
        lse = np.empty(lse_shape, ct)
        if fn is None:
            return result, lse
        res, lse_k = (result[None], lse[None]) if ragged else (result, lse)
        if ragged:
            q = q[None]
        if quant is not None:
            qv = q if sd is None else q.view(sd)
            args = (qv, k_cache.view(np.int8), v_cache.view(np.int8), table, kv_lens, is_causal,
                    scale, res if sd is None else res.view(sd), lse_k, r, begin,
                    _quant_args(p, k_scale, v_scale))
        elif sd is None:
            args = (q, k_cache, v_cache, table, kv_lens, is_causal, scale, res, lse_k, r, begin,
                    None)
        else:
            args = (q.view(sd), k_cache.view(sd), v_cache.view(sd), table, kv_lens, is_causal,
                    scale, res.view(sd), lse_k, r, begin, None)
        if parallel:
            with kernel_launch():
                fn(*args)
        else:  # on the calling thread: no thread pool to start or guard
            check_jit()
            fn(*args)
        return result, lse

    return launch
