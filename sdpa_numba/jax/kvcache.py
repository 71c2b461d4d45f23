"""``attention_with_kvcache`` on JAX arrays, functional: the CPU decode kernel and the append
as one XLA FFI call (:mod:`._serve_handlers`) that returns ``(out, k_cache, v_cache)``, the
caches aliased to the inputs (``input_output_aliases``): under ``jax.jit`` with the caches
donated, the append writes into the caller's buffers and nothing is copied; without donation
XLA copies each cache once and the caller's arrays are unchanged.

Shapes, dtypes and the variants are checked at trace time with the NumPy API's checks
(:func:`sdpa_numba.problem.kvcache.kvcache_problem`); the values of ``cache_seqlens``,
``cache_leftpad`` and ``block_table`` (traced under ``jax.jit``) are checked by the handler
before anything is written, and a bad one (an append past the cache's end) fails the call with
an error that reaches the caller.
"""

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ..problem import check_flag
from ..problem.arguments import shape_str
from ..problem.kvcache import kvcache_problem
from ..score.recipe import NO_LIMIT
from ._mods import mod_operands
from ._serve_handlers import QUANT_NAMES, kvcache_target
from .dense import _check_platform, _stand_in
from .varlen import _numbers, int_operand, is_concrete, not_taken

__all__ = ["attention_with_kvcache"]


class _Spec:
    """What the NumPy API's checks read of an operand: shape, ndim, dtype and the strides of
    XLA's row-major buffers."""

    __slots__ = ("shape", "ndim", "dtype", "strides")

    def __init__(self, x):
        self.shape = tuple(int(n) for n in x.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(x.dtype)
        strides, s = [], self.dtype.itemsize
        for n in reversed(self.shape):
            strides.append(s)
            s *= max(n, 1)
        self.strides = tuple(reversed(strides))


def _ints_stand_in(name, x, fill=None):
    """An integer argument as the NumPy API's checks read it: its values when concrete, else
    an array of its shape and dtype (zeros, or ``fill(shape)``) that passes the value
    checks."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if is_concrete(x):
        return np.asarray(x)
    shape = tuple(int(n) for n in x.shape)
    if fill is not None and len(shape) == 2:
        return fill(shape).astype(np.dtype(x.dtype))
    return np.zeros(shape, np.dtype(x.dtype))


def _scale_operand(name, x):
    """A quantized cache's scale as a JAX array: a Python number as a float32 scalar (the
    NumPy API's), an array as JAX holds it (shape and dtype checked by the NumPy API's
    :func:`sdpa_numba.problem.quant.quant_spec`)."""
    if x is None:
        return None
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return jnp.asarray(np.float32(x))
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array or a float, got {type(x).__name__}")
    return jnp.asarray(x)


def _no_vmap(*args):
    raise NotImplementedError(
        "sdpa_numba.jax.attention_with_kvcache does not run under jax.vmap: its call updates "
        "the caches in place (aliased); fold the mapped dim into the batch dim B instead")


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None,
                           block_table=None, cache_leftpad=None, is_causal=True, scale=None,
                           return_lse=False, out=None, k_scale=None, v_scale=None,
                           window=None, chunk=None, alignment="bottom_right", softcap=None,
                           alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None,
                           mod_args=(), block_mask=None):
    """Attention of new query tokens against a key/value cache, on JAX arrays, under
    ``jax.jit``: :func:`sdpa_numba.attention_with_kvcache` (same arguments and semantics),
    functional.

    Parameters
    ----------
    q : jax.Array, shape (B, Lq, Hq, E)
        float16, bfloat16, float32 or float64 (float64 needs ``jax_enable_x64``).
    k_cache, v_cache : jax.Array, shapes (B, S_max, H, E) and (B, S_max, H, Ev)
        Or with ``block_table`` a paged cache ``(num_pages, page_size, H, E / Ev)``. q's dtype,
        or a quantized cache: int8, ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2`` with
        ``k_scale`` and ``v_scale``.
    cache_seqlens : int or jax.Array of ints, shape (B,)
        Keys in the cache of each sequence; may be traced.
    k, v : jax.Array, shapes (B, Lq_new, H, E) and (B, Lq_new, H, Ev), optional
        New keys and values, appended at ``cache_seqlens[b] ..`` in the returned caches and
        attended to.
    block_table : jax.Array of ints, shape (B, max_pages), optional
        Paged cache (as in the NumPy API); may be traced.
    cache_leftpad : jax.Array of ints, shape (B,), optional
        As in the NumPy API; may be traced.
    is_causal, scale, window, chunk, alignment, softcap, return_lse
        As in the NumPy API (``lse`` ``(B, Hq, Lq)``, compute dtype).
    alibi_slopes, sinks : jax.Array, optional
        As in the NumPy API (slopes ``(Hq,)`` or ``(B, Hq)``, sinks ``(Hq,)``; float32 or
        float64): shapes and dtypes checked at trace time, values the caller's to keep. Each
        on/off is a specialization (a handler and a kernel compiled once per process).
    k_scale, v_scale : jax.Array or float, optional
        A quantized cache's scales, as in the NumPy API (:mod:`sdpa_numba.quant`): int8
        caches float32 or float16 scales ``(N, S, H)`` ("int8") or ``(N, S, H, E // 32)``
        ("q8_0"); fp8 caches a float32 descale, a float or of shape ``()`` or ``(B, H)``.
        Shapes and dtypes checked at trace time with the NumPy API's messages; values (and
        the new ``k``, ``v`` of an append) checked finite when the call runs, before
        anything is written. An append quantizes ``k`` and ``v`` into the returned caches
        (the NumPy API's rule, bit for bit) and, for int8 / q8_0, writes their scales: the
        returned scales are then results aliased to the scale operands, as the caches are.
        One specialization per scale dtype (the format is a run-time value), fp8 or not.
    score_mod, mask_mod, mod_args
        As in :func:`sdpa_numba.jax.scaled_dot_product_attention` (functions compiled into
        the handler, by identity; ``mod_args`` FFI operands, may be traced), with ``i`` the
        query token's position in the cache's frame and ``j`` the key's, as in the NumPy API.
    out
        Not taken under JAX (NotImplementedError: JAX arrays are immutable); ``block_mask``
        as the NumPy API (NotImplementedError).

    Returns
    -------
    out : jax.Array, shape (B, Lq, Hq, Ev), q's dtype
    k_cache, v_cache : jax.Array
        The caches after the append (the inputs' values without ``k`` and ``v``): the FFI
        call's results aliased to its cache operands, so that ``jax.jit(...,
        donate_argnums=...)`` over the caches updates them without a copy.
    k_scale, v_scale : jax.Array, only with a quantized cache
        The scales after the append (int8 / q8_0; aliased like the caches), or as given
        (fp8 descales; a float as a float32 scalar).
    lse : jax.Array, shape (B, Hq, Lq), only with ``return_lse=True``, last

    Raises
    ------
    TypeError, ValueError
        For bad shapes, dtypes or flags at trace time, with the NumPy API's messages (also for
        bad values of the integer arguments when they are concrete).
    NotImplementedError
        For the arguments above, under ``jax.vmap``, and for arrays on a device other than the
        CPU.

    Notes
    -----
    Forward only (the NumPy API has no backward for it). With traced integer arguments, a bad
    value (negative ``cache_seqlens``, an append past the cache's end, a ``cache_leftpad`` or
    ``block_table`` entry out of range, an append into a shared page) fails the call when it
    runs, before anything is written: the error reaches the caller when the result is read
    (``jax.block_until_ready``).
    """
    not_taken("attention_with_kvcache", out=out)
    if block_mask is not None:
        raise NotImplementedError(
            "attention_with_kvcache does not take a block_mask: a block mask is made for one "
            "(L, S), while each sequence of the cache has its own length, growing at every "
            "step; pass its mask_mod instead")
    return_lse = check_flag("return_lse", return_lse)
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
             ("cache_seqlens", cache_seqlens), ("block_table", block_table),
             ("cache_leftpad", cache_leftpad)]
    _check_platform(named + [("alibi_slopes", alibi_slopes), ("sinks", sinks)])
    alibi_slopes, sinks = (x if x is None or not hasattr(x, "shape") else jnp.asarray(x)
                           for x in (alibi_slopes, sinks))
    per_head = dict(alibi_slopes=_stand_in(alibi_slopes), sinks=_stand_in(sinks))
    k_scale, v_scale = (_scale_operand(n, x) for n, x in (("k_scale", k_scale),
                                                          ("v_scale", v_scale)))
    _check_platform([("k_scale", k_scale), ("v_scale", v_scale)])
    per_head.update((n, None if x is None else _Spec(x)) for n, x in (("k_scale", k_scale),
                                                                       ("v_scale", v_scale)))
    for name, x in named[:5]:
        if x is not None and not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    q, k_cache, v_cache = (jnp.asarray(x) for x in (q, k_cache, v_cache))
    k, v = (None if x is None else jnp.asarray(x) for x in (k, v))
    if q.ndim != 4:  # (the NumPy API's check; B is needed below)
        raise ValueError(f"q must have 4 dims (B, Lq, Hq, E), got shape {shape_str(q)}")
    B = int(q.shape[0])
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full((B,), int(cache_seqlens), np.int64)
    seqlens_in = _ints_stand_in("cache_seqlens", cache_seqlens)
    leftpad_in = (None if cache_leftpad is None
                  else _ints_stand_in("cache_leftpad", cache_leftpad))
    paged = block_table is not None
    if paged:
        # distinct pages where there are enough: a stand-in's append writes no shared page
        n_pages = max(int(k_cache.shape[0]), 1) if k_cache.ndim else 1
        table_in = _ints_stand_in("block_table", block_table,
                                  lambda shape: np.arange(int(np.prod(shape))).reshape(shape)
                                  % n_pages)
    else:
        table_in = None
    concrete = all(is_concrete(x) for x in (cache_seqlens, cache_leftpad, block_table))
    try:
        p = kvcache_problem(_Spec(q), _Spec(k_cache), _Spec(v_cache), seqlens_in,
                            None if k is None else _Spec(k), None if v is None else _Spec(v),
                            table_in, leftpad_in, is_causal, scale, alignment=alignment,
                            window=window, chunk=chunk, softcap=softcap, **per_head)
    except ValueError as e:
        # A stand-in's pages are the checks' guess: whether an append writes a shared page
        # depends on traced values, checked when the kernel runs.
        if concrete or not str(e).startswith("the append would write into page"):
            raise
        p = kvcache_problem(_Spec(q), _Spec(k_cache), _Spec(v_cache), seqlens_in, None, None,
                            table_in, leftpad_in, is_causal, scale, alignment=alignment,
                            window=window, chunk=chunk, softcap=softcap, **per_head)
    mods, mod_ops = mod_operands(score_mod, mask_mod, None, mod_args, p.compute_dtype,
                                 _check_platform)
    r = p.recipe
    ct = p.compute_dtype
    per_head_ops = []
    if r.alibi is not None:  # as the NumPy API's: (1, Hq), or (B, Hq) broadcast
        a = alibi_slopes.astype(ct)
        per_head_ops.append(a.reshape(1, -1) if r.alibi.shape[0] == 1 else
                            jnp.broadcast_to(a, r.alibi.shape))
    if r.sinks is not None:
        per_head_ops.append(sinks.astype(ct))
    seqlens = int_operand(cache_seqlens)
    leftpad = (jnp.zeros((B,), jnp.int32) if cache_leftpad is None
               else int_operand(cache_leftpad))
    table = (int_operand(block_table).astype(jnp.int32) if paged
             else jnp.arange(B, dtype=jnp.int32).reshape(B, 1))
    qs = p.quant
    ints = (int(p.is_causal), int(min(r.left, NO_LIMIT)), int(min(r.right, NO_LIMIT)),
            int(r.chunk), int(paged), 0 if qs is None else QUANT_NAMES.index(qs.name))
    results = [jax.ShapeDtypeStruct(p.out_shape, p.dtype),
               jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
               jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
               jax.ShapeDtypeStruct(p.lse_shape, ct)]
    appending = k is not None
    ops = [q, k_cache, v_cache, seqlens, table, leftpad] + ([k, v] if appending else [])
    numbers_ops = _numbers(ints, (float(p.scale), float(r.softcap)))
    aliases = {1: 1, 2: 2}
    scale_ops = []
    if qs is not None:
        scale_ops = [k_scale, v_scale]
        if appending and not qs.fp8:  # the append writes the scales: aliased results too
            at = len(ops) + len(numbers_ops) + len(per_head_ops)
            aliases.update({at: 4, at + 1: 5})
            results += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in scale_ops]
    call = jax.ffi.ffi_call(kvcache_target(p.dtype, appending, r.alibi is not None,
                                           r.sinks is not None, mods,
                                           None if qs is None else (qs.scale_dtype.str,
                                                                    qs.fp8)),
                            tuple(results), input_output_aliases=aliases)
    call = jax.custom_batching.custom_vmap(call)
    call.def_vmap(_no_vmap)
    got = call(*ops, *numbers_ops, *per_head_ops, *scale_ops, *mod_ops)
    result, k_cache, v_cache, lse = got[:4]
    if qs is not None:
        # the scales after the append (int8 / q8_0), or as given (fp8 descales)
        k_scale, v_scale = got[4:6] if len(got) > 4 else (k_scale, v_scale)
        result = (result, k_cache, v_cache, k_scale, v_scale)
    else:
        result = (result, k_cache, v_cache)
    return result + (lse,) if return_lse else result
