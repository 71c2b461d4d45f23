"""``varlen_attention`` on JAX arrays: the CPU varlen kernels as XLA FFI calls
(:mod:`._serve_handlers`), with a ``custom_vjp`` over the varlen backward (``lse`` saved as the
residual) and ``vmap`` folded into a loop of kernel launches (``vmap_method="broadcast_all"``).

Shapes, dtypes and the variants are checked at trace time with the NumPy API's checks
(:func:`sdpa_numba.problem.varlen.varlen_plan`); the values of ``cu_seqlens_q`` and
``cu_seqlens_k`` (traced under ``jax.jit``) are checked by the handler when the kernel runs, and
a bad one fails the call with an error naming it.
"""

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ..dropout import threshold
from ..problem import check_dropout, check_flag
from ..problem.varlen import varlen_plan
from ..score.recipe import NO_LIMIT
from ._serve_handlers import varlen_backward_target, varlen_forward_target
from ._mods import check_mods_grad, forward_mods, mod_operands, seed_operand
from .dense import _check_platform, _Spec, _stand_in

__all__ = ["varlen_attention"]


def not_taken(function, **given):
    """NotImplementedError for the first of ``given`` that is set (not None, not ``()``)."""
    for name, x in given.items():
        if x is not None and not (isinstance(x, tuple) and x == ()):
            raise NotImplementedError(
                f"sdpa_numba.jax.{function} does not take {name} yet: use the NumPy API "
                f"(sdpa_numba.{function}) outside jax.jit")


def is_concrete(x):
    """Whether ``x``'s values are known now (not a tracer): then the NumPy API's checks run on
    them at trace time, with its messages."""
    return not isinstance(x, jax.core.Tracer)


def int_operand(x):
    """An integer operand as the handlers read it: int64 where JAX has 64-bit integers and
    ``x`` needs them (int64, uint32, uint64), else int32."""
    x = jnp.asarray(x)
    wide = x.dtype.itemsize == 8 or x.dtype == np.uint32
    return x.astype(jnp.int64 if wide and jax.config.jax_enable_x64 else jnp.int32)


def _cu_stand_in(name, x, total):
    """What the NumPy API's checks read of ``cu_seqlens``: the values when they are concrete,
    else an array of its shape and dtype that passes the value checks (0, then ``total``)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array (int32 or int64), got "
                        f"{type(x).__name__}")
    if is_concrete(x):
        return np.asarray(x)
    a = np.zeros(tuple(x.shape), np.dtype(x.dtype))
    if a.ndim == 1 and a.shape[0] >= 1 and a.dtype.kind in "iu":
        a[-1] = total
    return a


def _max_hint(name, x):
    """``max_seqlen_*``: a static Python int (FlashAttention's hint) or None; -1 for None."""
    if x is None:
        return -1
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be a static Python int or None (under jax.jit, not a "
                        f"traced value), got {type(x).__name__}")
    if int(x) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(x)}")
    return int(x)


def _numbers(ints, floats):
    """The ``ints`` (int64) and ``floats`` (float64) operands, their bytes carried as uint32:
    JAX without ``jax_enable_x64`` has no 64-bit arrays (the handlers read the bytes)."""
    return (jnp.asarray(np.array(ints, np.int64).view(np.uint32)),
            jnp.asarray(np.array(floats, np.float64).view(np.uint32)))


# cfg: (dtype, ints, floats, out_shape, lse_shape, has_alibi, has_sinks, dropout, mods),
# hashable (custom_vjp's nondiff arg; mods: None or (score_mod, mask_mod, score_mod_grad,
# mod_arg specs), the functions by identity, as the dense function's)

def _forward_call(cfg, q, k, v, cu_q, cu_k, alibi, sinks, seed, mod_args):
    dtype, ints, floats, out_shape, lse_shape, has_alibi, has_sinks, dropout, mods = cfg
    ct = np.float64 if dtype == np.float64 else np.float32
    call = jax.ffi.ffi_call(varlen_forward_target(dtype, has_alibi, has_sinks, dropout,
                                                  forward_mods(mods)),
                            (jax.ShapeDtypeStruct(out_shape, dtype),
                             jax.ShapeDtypeStruct(lse_shape, ct)),
                            vmap_method="broadcast_all")
    return call(q, k, v, cu_q, cu_k, *_numbers(ints, floats),
                *[x for x in (alibi, sinks, seed) if x is not None], *mod_args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _varlen(cfg, q, k, v, cu_q, cu_k, alibi, sinks, seed, mod_args):
    return _forward_call(cfg, q, k, v, cu_q, cu_k, alibi, sinks, seed, mod_args)


def _fwd(cfg, q, k, v, cu_q, cu_k, alibi, sinks, seed, mod_args):
    if alibi is not None and alibi.perturbed:
        raise NotImplementedError("sdpa_numba.jax.varlen_attention has no gradient for "
                                  "alibi_slopes (the NumPy API's backward has none either)")
    check_mods_grad(cfg[8], mod_args, "varlen_attention")
    vals = [None if x is None else x.value
            for x in (q, k, v, cu_q, cu_k, alibi, sinks, seed)]
    vals.append(tuple(x.value for x in mod_args))
    out, lse = _forward_call(cfg, *vals)
    return (out, lse), (vals, out, lse)


def _bwd(cfg, res, cts):
    (q, k, v, cu_q, cu_k, alibi, sinks, seed, mod_args), out, lse = res
    g, g_lse = cts
    dtype, ints, floats, out_shape, _, has_alibi, has_sinks, dropout, mods = cfg
    if not isinstance(g_lse, SymbolicZero):
        raise NotImplementedError("sdpa_numba.jax.varlen_attention has no gradient through "
                                  "lse (return_lse=True): differentiate the output only")
    g = jnp.zeros(out_shape, dtype) if isinstance(g, SymbolicZero) else g.astype(dtype)
    ct = np.float64 if dtype == np.float64 else np.float32
    results = [jax.ShapeDtypeStruct(x.shape, ct) for x in (q, k, v)]
    grads = jax.ffi.ffi_call(varlen_backward_target(dtype, has_alibi, has_sinks, dropout,
                                                    mods),
                             results, vmap_method="broadcast_all")(
        q, k, v, cu_q, cu_k, g, out, lse, *_numbers(ints, floats),
        *[x for x in (alibi, sinks, seed) if x is not None], *mod_args)
    dsinks = None
    if sinks is not None:
        # d sink_h = -sum_i exp(sink_h - lse_{h,i}) * rowsum(dO * O)_{i,h} (the dense one's)
        d = jnp.einsum("...ihe,...ihe->...hi", g.astype(ct), out.astype(ct))
        s = sinks[..., None]  # (Hq, 1) against lse's (Hq, total_q)
        w = jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - lse))
        dsinks = (-(w * d).sum(axis=-1)).astype(sinks.dtype)
    # the NumPy API's: the compute dtype's gradients cast to the inputs' dtype
    # no gradient for the seed or the mod_args (numbers the user's functions read)
    return tuple(d.astype(dtype) for d in grads) + (None, None, None, dsinks, None,
                                                    tuple(None for _ in mod_args))


_varlen.defvjp(_fwd, _bwd, symbolic_zeros=True)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                     max_seqlen_k=None, *, is_causal=False, scale=None, dropout_p=0.0,
                     seed=None, dropout_rng=None, return_lse=False, out=None, window=None,
                     chunk=None, alignment="top_left", softcap=None, alibi_slopes=None,
                     sinks=None, score_mod=None, mask_mod=None, mod_args=(), score_mod_grad=None,
                     block_mask=None):
    """Attention over a ragged batch packed back to back, on JAX arrays, under ``jax.jit``,
    ``jax.grad`` and ``jax.vmap``: :func:`sdpa_numba.varlen_attention` (same arguments and
    semantics) with the CPU varlen kernels as XLA FFI calls.

    Parameters
    ----------
    q, k, v : jax.Array, shapes (total_q, Hq, E), (total_k, H, E), (total_k, H, Ev)
        float16, bfloat16, float32 or float64 (float64 needs ``jax_enable_x64``).
    cu_seqlens_q, cu_seqlens_k : jax.Array of ints, shape (B + 1,)
        May be traced. Shapes and dtypes are checked at trace time; the values (start at 0,
        never decrease, end at the totals) when they are concrete, else when the kernel runs:
        a bad value fails the call with an error naming the argument, which
        ``jax.block_until_ready`` (or reading the result) raises.
    max_seqlen_q, max_seqlen_k : int, optional
        Static Python ints (FlashAttention's hints): checked to be at least the longest
        sequence (when the kernel runs, for traced cu_seqlens).
    is_causal, scale, window, chunk, alignment, softcap, return_lse
        As in the NumPy API. ``lse`` has shape ``(Hq, total_q)`` in the compute dtype; no
        gradient flows through it (NotImplementedError if one is asked).
    dropout_p, seed, dropout_rng
        Dropout as in :func:`sdpa_numba.jax.scaled_dot_product_attention` (``dropout_rng`` a
        JAX key, or ``seed`` an int or two uint32 words, traced): the NumPy API's mask (of
        sequence index, head, row, key) for the same seed, bit for bit, redrawn by the
        backward. Under ``vmap`` each index draws the unmapped call's mask (its own with
        mapped keys).
    alibi_slopes, sinks : jax.Array, optional
        As in the NumPy API (``(Hq,)`` or ``(B, Hq)`` slopes; ``(Hq,)`` sinks): shapes and
        dtypes checked at trace time, values (finite; sinks finite or ``-inf``) the caller's
        to keep. ``sinks`` have a gradient; ``alibi_slopes`` none, as in the NumPy API
        (NotImplementedError when one is asked). Each on/off is a specialization (a handler
        and a kernel compiled once per process).
    score_mod, mask_mod, mod_args, score_mod_grad
        As in :func:`sdpa_numba.jax.scaled_dot_product_attention` (Numba functions compiled
        into the handlers, by identity; ``mod_args`` FFI operands, may be traced, no gradient
        to them), with ``b`` the sequence index, ``i`` and ``j`` counted from the sequence's
        first row and key, as in the NumPy API. ``jax.grad`` through a ``score_mod`` needs
        ``score_mod_grad`` (ValueError otherwise). Under ``vmap`` each index reads its own
        slice of mapped ``mod_args``.
    out
        Not taken under JAX (NotImplementedError: JAX arrays are immutable). ``block_mask``
        is refused as by the NumPy API (ValueError).

    Returns
    -------
    out : jax.Array, shape (total_q, Hq, Ev), the inputs' dtype
    lse : jax.Array, shape (Hq, total_q), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad shapes, dtypes, flags, hints, and concrete cu_seqlens values, at trace time,
        with the NumPy API's messages.
    NotImplementedError
        For ``out``, for gradients of ``alibi_slopes``, ``mod_args`` or through ``lse``,
        and for arrays on a device other than the CPU.

    Notes
    -----
    Gradients: q, k, v (by :func:`sdpa_numba.varlen_attention_backward`'s kernel, bit for
    bit its results) and sinks. Under ``vmap`` every operand is broadcast to the mapped size and the
    kernel runs once per index.
    """
    not_taken("varlen_attention", out=out)
    dropout_p = check_dropout(dropout_p)
    seed_op = seed_operand(seed, dropout_rng) if dropout_p > 0 else None
    return_lse = check_flag("return_lse", return_lse)
    named = [("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k", cu_seqlens_k)]
    _check_platform(named)
    for name, x in named[:3]:
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    _check_platform([("alibi_slopes", alibi_slopes), ("sinks", sinks)])
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    alibi_slopes, sinks = (x if x is None or not hasattr(x, "shape") else jnp.asarray(x)
                           for x in (alibi_slopes, sinks))
    max_q = _max_hint("max_seqlen_q", max_seqlen_q)
    max_k = _max_hint("max_seqlen_k", max_seqlen_k)
    total_q = int(q.shape[0]) if q.ndim else 0
    total_k = int(k.shape[0]) if k.ndim else 0
    cq = _cu_stand_in("cu_seqlens_q", cu_seqlens_q, total_q)
    ck = _cu_stand_in("cu_seqlens_k", cu_seqlens_k, total_k)
    concrete = is_concrete(cu_seqlens_q) and is_concrete(cu_seqlens_k)
    p = varlen_plan(_Spec(q), _Spec(k), _Spec(v), cq, ck,
                    max_seqlen_q=max_seqlen_q if concrete else None,
                    max_seqlen_k=max_seqlen_k if concrete else None, is_causal=is_causal,
                    scale=scale, window=window, chunk=chunk, alignment=alignment,
                    softcap=softcap, block_mask=block_mask, alibi_slopes=_stand_in(alibi_slopes),
                    sinks=_stand_in(sinks))
    mods, mod_ops = mod_operands(score_mod, mask_mod, score_mod_grad, mod_args,
                                 p.compute_dtype, _check_platform)
    r = p.recipe
    alibi = sinks_ = None
    if r.alibi is not None:  # as the NumPy API's: (1, Hq), or (B, Hq) broadcast
        alibi = jnp.broadcast_to(alibi_slopes.astype(p.compute_dtype),
                                 (p.n_seq, p.hq)).reshape(r.alibi.shape) \
            if r.alibi.shape[0] != 1 else alibi_slopes.astype(p.compute_dtype).reshape(1, p.hq)
    if r.sinks is not None:
        sinks_ = sinks.astype(p.compute_dtype)
    ints = (int(p.is_causal), int(p.bottom_right), int(min(r.left, NO_LIMIT)),
            int(min(r.right, NO_LIMIT)), int(r.chunk), max_q, max_k, threshold(dropout_p))
    cfg = (p.dtype, ints, (float(p.scale), float(r.softcap), 1.0 / (1.0 - dropout_p)),
           p.out_shape, p.lse_shape, alibi is not None, sinks_ is not None, dropout_p > 0,
           mods)
    result, lse = _varlen(cfg, q, k, v, int_operand(cu_seqlens_q), int_operand(cu_seqlens_k),
                          alibi, sinks_, seed_op, mod_ops)
    return (result, lse) if return_lse else result
