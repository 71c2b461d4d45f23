"""``scaled_dot_product_attention`` on JAX arrays: the CPU kernels as XLA FFI calls, with a
``custom_vjp`` over the backward kernel (``lse`` saved as the residual) and ``vmap`` folded into
the kernels' batch (the FFI calls' ``vmap_method="expand_dims"``: the handlers read the batch
dims, broadcast ones included, from XLA's buffers).

Validation runs at trace time, on shapes and dtypes alone, with the NumPy API's own checks
(:func:`sdpa_numba.problem.plan`): bad input under ``jax.jit`` fails before anything is
compiled, with the NumPy API's messages.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ..problem import check_dropout, check_flag, plan
from ..score.recipe import NO_LIMIT
from ._handlers import backward_target, forward_target

__all__ = ["scaled_dot_product_attention"]


class _Spec:
    """What :func:`sdpa_numba.problem.plan` reads of an operand: shape, ndim and dtype (a
    tracer has them, but a stand-in keeps the check free of JAX's own types)."""

    __slots__ = ("shape", "ndim", "dtype")

    def __init__(self, x):
        self.shape = tuple(int(n) for n in x.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(x.dtype)


def _spec(x):
    return None if x is None else _Spec(x)


def _stand_in(x):
    """A small host array of ``x``'s shape and dtype, for the checks of ALiBi slopes and
    sinks (their values are traced: only shapes and dtypes are checked at trace time)."""
    if x is None:
        return None
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x  # not an array: the NumPy API's check refuses it
    return np.zeros(tuple(x.shape), np.dtype(x.dtype))


def _check_platform(named):
    """The kernels run on the host: a concrete array on another device is refused."""
    for name, x in named:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            platforms = {d.platform for d in x.devices()}
            if platforms != {"cpu"}:
                raise NotImplementedError(
                    f"sdpa_numba.jax runs on the CPU only: {name} is on "
                    f"{', '.join(sorted(platforms))} (move it with jax.device_put(x, "
                    f"jax.devices('cpu')[0]))")


def _unsupported(**given):
    for name, x in given.items():
        if x is not None and x != ():
            raise NotImplementedError(
                f"sdpa_numba.jax does not take {name} yet (a Numba function or block mask "
                f"cannot enter an XLA FFI call here): use the NumPy API "
                f"(sdpa_numba.scaled_dot_product_attention) outside jax.jit")


def _lead(x, rank):
    """``x`` with leading dims of size 1 up to ``rank``."""
    return x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))


def _sum_to(g, shape):
    """``g`` summed over the dims where ``shape`` (same rank) has 1 and ``g`` has more."""
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, g.shape)) if a == 1 and b != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


# The static part of a call: everything but the arrays (hashable: custom_vjp's nondiff arg).
# (dtype, mask_kind, has_alibi, has_sinks, ints, floats, out_shape, lse_shape)


def _numbers(cfg):
    """The ``ints`` (int64) and ``floats`` (float64) operands, their bytes carried as uint32:
    JAX without ``jax_enable_x64`` has no 64-bit arrays (the handlers read the bytes)."""
    _, _, _, _, ints, floats, _, _ = cfg
    return (jnp.asarray(np.array(ints, np.int64).view(np.uint32)),
            jnp.asarray(np.array(floats, np.float64).view(np.uint32)))


def _forward_call(cfg, q, k, v, mask, alibi, sinks):
    dtype, mask_kind, has_alibi, has_sinks, _, _, out_shape, lse_shape = cfg
    ct = np.float64 if dtype == np.float64 else np.float32
    name = forward_target(dtype, mask_kind, has_alibi, has_sinks)
    ops = [q, k, v] + [x for x in (mask, alibi, sinks) if x is not None]
    call = jax.ffi.ffi_call(name, (jax.ShapeDtypeStruct(out_shape, dtype),
                                   jax.ShapeDtypeStruct(lse_shape, ct)),
                            vmap_method="expand_dims")
    return call(*ops, *_numbers(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, mask, alibi, sinks):
    return _forward_call(cfg, q, k, v, mask, alibi, sinks)


def _value(x):
    return None if x is None else x.value


def _fwd(cfg, q, k, v, mask, alibi, sinks):
    vals = [_value(x) for x in (q, k, v, mask, alibi, sinks)]
    if alibi is not None and alibi.perturbed:
        raise NotImplementedError("sdpa_numba.jax has no gradient for alibi_slopes (the "
                                  "backward kernel does not compute it)")
    mask_grad = mask is not None and cfg[1] == "additive" and mask.perturbed
    out, lse = _forward_call(cfg, *vals)
    return (out, lse), (vals, out, lse, mask_grad)


def _bwd(cfg, res, cts):
    (q, k, v, mask, alibi, sinks), out, lse, mask_grad = res
    g, g_lse = cts
    dtype, mask_kind, has_alibi, has_sinks, _, _, out_shape, lse_shape = cfg
    if not isinstance(g_lse, SymbolicZero):
        raise NotImplementedError("sdpa_numba.jax has no gradient through lse (return_lse="
                                  "True): differentiate the output only")
    g = jnp.zeros(out_shape, dtype) if isinstance(g, SymbolicZero) else g.astype(dtype)
    ct = np.float64 if dtype == np.float64 else np.float32
    full_q = (*out_shape[:-1], q.shape[-1])
    full_k = (*out_shape[:-3], k.shape[-3], k.shape[-2], k.shape[-1])
    full_v = (*out_shape[:-3], v.shape[-3], v.shape[-2], v.shape[-1])
    results = [jax.ShapeDtypeStruct(full_q, ct), jax.ShapeDtypeStruct(full_k, ct),
               jax.ShapeDtypeStruct(full_v, ct)]
    if mask_grad:
        results.append(jax.ShapeDtypeStruct((*out_shape[:-1], k.shape[-2]), ct))
    name = backward_target(dtype, mask_kind, has_alibi, has_sinks, mask_grad)
    ops = [q, k, v] + [x for x in (mask, alibi, sinks) if x is not None] + [g, out, lse]
    grads = jax.ffi.ffi_call(name, results, vmap_method="expand_dims")(*ops, *_numbers(cfg))
    dq, dk, dv = (_sum_to(d, x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v)))
    dmask = _sum_to(grads[3], mask.shape).astype(mask.dtype) if mask_grad else None
    dsinks = None
    if sinks is not None:
        # d sink_h = -sum_{b,i} exp(sink_h - lse_{b,h,i}) * rowsum(dO * O)_{b,h,i}
        d = jnp.einsum("...e,...e->...", g.astype(ct), out.astype(ct))
        s = sinks[..., None]  # (.., Hq, 1) against lse's (..., Hq, L)
        w = jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - lse))
        dsinks = _sum_to(-(w * d).sum(axis=-1), sinks.shape).astype(sinks.dtype)
    return dq, dk, dv, dmask, None, dsinks


_attention.defvjp(_fwd, _bwd, symbolic_zeros=True)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 return_lse=False, seed=None, window=None,
                                 alignment="top_left", softcap=None, alibi_slopes=None,
                                 sinks=None, score_mod=None, mask_mod=None, mod_args=(),
                                 score_mod_grad=None, block_mask=None):
    """Attention(Q, K, V) on JAX arrays, under ``jax.jit``, ``jax.grad`` and ``jax.vmap``:
    :func:`sdpa_numba.scaled_dot_product_attention` (same arguments and semantics) with the
    CPU kernels as XLA FFI calls.

    Parameters
    ----------
    query, key, value, attn_mask, is_causal, scale, enable_gqa, window, alignment, softcap,
    alibi_slopes, sinks
        As in the NumPy API. ``alibi_slopes`` and ``sinks`` are checked for shape and dtype at
        trace time; their values (finite; sinks finite or ``-inf``) are the caller's to keep.
    dropout_p : float
        Only 0 (dropout under JAX is not built yet: NotImplementedError).
    return_lse : bool, keyword-only
        Also return ``lse`` (shape ``(..., Hq, L)``, compute dtype). No gradient flows through
        it (NotImplementedError if one is asked).
    seed, score_mod, mask_mod, mod_args, score_mod_grad, block_mask
        Not supported under JAX yet (NotImplementedError when given).

    Returns
    -------
    out : jax.Array, shape (..., Hq, L, Ev), the inputs' dtype
    lse : jax.Array, only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad shapes, dtypes or flags, at trace time, with the NumPy API's messages.
    NotImplementedError
        For the arguments above, for gradients of ``alibi_slopes`` or through ``lse``, and for
        arrays on a device other than the CPU.

    Notes
    -----
    Gradients: query, key, value, a float ``attn_mask`` (computed only when asked) and
    ``sinks``. The kernels' numbers are the NumPy API's: the same results bit for bit on the
    same inputs.
    """
    _unsupported(score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args or None,
                 score_mod_grad=score_mod_grad, block_mask=block_mask)
    if check_dropout(dropout_p) > 0:
        raise NotImplementedError("sdpa_numba.jax does not take dropout_p > 0 yet")
    del seed  # only read with dropout
    return_lse = check_flag("return_lse", return_lse)
    named = [("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask),
             ("alibi_slopes", alibi_slopes), ("sinks", sinks)]
    _check_platform(named)
    for name, x in named[:4]:
        if x is not None and not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    # As JAX sees them (without jax_enable_x64, float64 NumPy input becomes float32): the
    # checks and the handler read the arrays the kernels will get.
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    attn_mask, alibi_slopes, sinks = (None if x is None or not hasattr(x, "shape") else
                                      jnp.asarray(x) for x in (attn_mask, alibi_slopes, sinks))
    p = plan(_spec(query), _spec(key), _spec(value), _spec(attn_mask), is_causal, scale,
             enable_gqa, window=window, alignment=alignment, softcap=softcap,
             alibi_slopes=_stand_in(alibi_slopes), sinks=_stand_in(sinks))
    r = p.recipe
    rank = max(len(p.batch), 1) + 3
    batch = (1,) * (rank - 3 - len(p.batch)) + tuple(p.batch)
    q, k, v = (_lead(x, rank) for x in (query, key, value))
    mask = None if attn_mask is None else _lead(attn_mask, rank)
    alibi = sinks_ = None
    ct = p.compute_dtype
    if r.alibi is not None:
        a = jnp.asarray(alibi_slopes).astype(ct)
        alibi = jnp.broadcast_to(a, (*p.batch, p.hq)).reshape((*batch, p.hq))
    if r.sinks is not None:
        sinks_ = jnp.asarray(sinks).astype(ct).reshape((1,) * len(batch) + (p.hq,))
    out_shape = (*batch, p.hq, p.L, p.Ev)
    ints = (int(r.offset), int(min(r.left, NO_LIMIT)), int(min(r.right, NO_LIMIT)),
            int(p.is_causal))
    cfg = (p.dtype, p.mask_kind, alibi is not None, sinks_ is not None, ints,
           (float(p.scale), float(r.softcap)), out_shape, out_shape[:-1])
    out, lse = _attention(cfg, q, k, v, mask, alibi, sinks_)
    out = out.reshape(p.out_shape)
    if not return_lse:
        return out
    return out, lse.reshape(p.out_shape[:-1])
