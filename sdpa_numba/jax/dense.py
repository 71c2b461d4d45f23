"""``scaled_dot_product_attention`` on JAX arrays: the CPU kernels as XLA FFI calls, with a
``custom_vjp`` over the backward kernel (``lse`` saved as the residual) and ``vmap`` folded into
the kernels' batch (the FFI calls' ``vmap_method="expand_dims"``: the handlers read the batch
dims, broadcast ones included, from XLA's buffers).

Validation runs at trace time, on shapes and dtypes alone, with the NumPy API's own checks
(:func:`sdpa_numba.problem.plan`): bad input under ``jax.jit`` fails before anything is
compiled, with the NumPy API's messages. The user's functions and their ``mod_args``, and
dropout's seed, are checked and made operands by :mod:`._mods`.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ..problem import check_dropout, check_flag, plan
from ..score.recipe import NO_LIMIT
from ..dropout import threshold
from ._handlers import backward_target, forward_target
from ._mods import check_mods_grad, forward_mods, mod_operands, seed_operand

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
                f"sdpa_numba.jax does not take {name} (its states are built on the host "
                f"from the mod_args' values): pass its mask_mod (evaluated per element), "
                f"or use the NumPy API (sdpa_numba.scaled_dot_product_attention) outside "
                f"jax.jit")


def _lead(x, rank):
    """``x`` with leading dims of size 1 up to ``rank``."""
    return x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))


def _sum_to(g, shape):
    """``g`` summed over the dims where ``shape`` (same rank) has 1 and ``g`` has more."""
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, g.shape)) if a == 1 and b != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


class _Cfg(NamedTuple):
    """The static part of a call: everything but the arrays (hashable: custom_vjp's nondiff
    arg; the user's functions by identity)."""

    dtype: np.dtype
    mask_kind: str
    has_alibi: bool
    has_sinks: bool
    ints: tuple     # offset, left, right, is_causal, n_batch, dropout threshold
    floats: tuple   # scale, softcap, dropout's inv_keep
    out_shape: tuple
    lse_shape: tuple
    mods: tuple     # None or (score_mod, mask_mod, score_mod_grad, mod_arg specs)
    dropout: bool


def _numbers(cfg):
    """The ``ints`` (int64) and ``floats`` (float64) operands, their bytes carried as uint32:
    JAX without ``jax_enable_x64`` has no 64-bit arrays (the handlers read the bytes)."""
    return (jnp.asarray(np.array(cfg.ints, np.int64).view(np.uint32)),
            jnp.asarray(np.array(cfg.floats, np.float64).view(np.uint32)))


def _extra(seed, mod_args):
    return ([] if seed is None else [seed]) + list(mod_args)


def _forward_call(cfg, q, k, v, mask, alibi, sinks, seed, mod_args):
    ct = np.float64 if cfg.dtype == np.float64 else np.float32
    name = forward_target(cfg.dtype, cfg.mask_kind, cfg.has_alibi, cfg.has_sinks,
                          forward_mods(cfg.mods), cfg.dropout)
    ops = [q, k, v] + [x for x in (mask, alibi, sinks) if x is not None]
    call = jax.ffi.ffi_call(name, (jax.ShapeDtypeStruct(cfg.out_shape, cfg.dtype),
                                   jax.ShapeDtypeStruct(cfg.lse_shape, ct)),
                            vmap_method="expand_dims")
    return call(*ops, *_numbers(cfg), *_extra(seed, mod_args))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, mask, alibi, sinks, seed, mod_args):
    return _forward_call(cfg, q, k, v, mask, alibi, sinks, seed, mod_args)


def _value(x):
    return None if x is None else x.value


def _fwd(cfg, q, k, v, mask, alibi, sinks, seed, mod_args):
    vals = [_value(x) for x in (q, k, v, mask, alibi, sinks, seed)]
    vals.append(tuple(_value(x) for x in mod_args))
    if alibi is not None and alibi.perturbed:
        raise NotImplementedError("sdpa_numba.jax has no gradient for alibi_slopes (the "
                                  "NumPy API's backward has none either: the slopes are "
                                  "constants there)")
    check_mods_grad(cfg.mods, mod_args, "scaled_dot_product_attention")
    mask_grad = mask is not None and cfg.mask_kind == "additive" and mask.perturbed
    out, lse = _forward_call(cfg, *vals)
    return (out, lse), (vals, out, lse, mask_grad)


def _bwd(cfg, res, cts):
    (q, k, v, mask, alibi, sinks, seed, mod_args), out, lse, mask_grad = res
    g, g_lse = cts
    dtype, out_shape = cfg.dtype, cfg.out_shape
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
    name = backward_target(dtype, cfg.mask_kind, cfg.has_alibi, cfg.has_sinks, mask_grad,
                           cfg.mods, cfg.dropout)
    ops = [q, k, v] + [x for x in (mask, alibi, sinks) if x is not None] + [g, out, lse]
    grads = jax.ffi.ffi_call(name, results, vmap_method="expand_dims")(
        *ops, *_numbers(cfg), *_extra(seed, mod_args))
    dq, dk, dv = (_sum_to(d, x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v)))
    dmask = _sum_to(grads[3], mask.shape).astype(mask.dtype) if mask_grad else None
    dsinks = None
    if sinks is not None:
        # d sink_h = -sum_{b,i} exp(sink_h - lse_{b,h,i}) * rowsum(dO * O)_{b,h,i} (with
        # dropout too: O is the dropped output, and the sink's probability is not dropped)
        d = jnp.einsum("...e,...e->...", g.astype(ct), out.astype(ct))
        s = sinks[..., None]  # (.., Hq, 1) against lse's (..., Hq, L)
        w = jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - lse))
        dsinks = _sum_to(-(w * d).sum(axis=-1), sinks.shape).astype(sinks.dtype)
    # no gradient for the seed or the mod_args (numbers the user's functions read)
    return dq, dk, dv, dmask, None, dsinks, None, tuple(None for _ in mod_args)


_attention.defvjp(_fwd, _bwd, symbolic_zeros=True)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 return_lse=False, seed=None, dropout_rng=None, window=None,
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
        Probability in [0, 1) of dropping each attention probability, as in the NumPy API
        (the same counter-based mask, :mod:`sdpa_numba.dropout`). With ``dropout_p > 0``,
        ``dropout_rng`` or ``seed`` must be given; the backward redraws the forward's mask
        from the same seed.
    return_lse : bool, keyword-only
        Also return ``lse`` (shape ``(..., Hq, L)``, compute dtype). No gradient flows through
        it (NotImplementedError if one is asked).
    seed : int or jax.Array, keyword-only, optional
        Dropout's 64-bit seed: an int in ``[0, 2**64)`` (the NumPy API's: the same seed draws
        the same mask, bit for bit) or a uint32 array of shape ``(2,)`` (its low and high
        words), which may be traced. Read only when ``dropout_p > 0``.
    dropout_rng : jax.Array, keyword-only, optional
        A JAX PRNG key (``jax.random.key(n)``, or a legacy ``jax.random.PRNGKey``): the seed
        is ``jax.random.bits(dropout_rng, (2,), uint32)``, traced under ``jax.jit``. Under
        ``jax.vmap`` over the inputs with one key, every slice draws the mask the unmapped
        call draws; map over keys (``in_axes``) for independent masks.
    score_mod, mask_mod, score_mod_grad : Numba @njit function, keyword-only, optional
        As in the NumPy API (``score_mod(score, b, h, i, j, *mod_args)``, ``mask_mod(b, h, i,
        j, *mod_args)``; ``b`` is the flat batch index, the same under ``jax.vmap`` as in the
        unmapped call). Compiled into the handlers: each function (by identity) is a new
        specialization, whose forward handler and kernel compile once per process (tens of
        seconds; the NumPy API's kernel for the same function, dtype and mask kind is the
        same compiled kernel). ``jax.grad`` through a ``score_mod`` needs ``score_mod_grad``
        (``d score_mod / d score``; ValueError otherwise), which compiles the backward's.
        A ``mask_mod`` runs on every element (no block mask is built: that would need the
        ``mod_args`` values at trace time).
    mod_args : tuple, keyword-only
        Arrays (1 to 8 dims; JAX or NumPy, may be traced) and numbers passed to the
        functions as their last arguments, as FFI operands: new values never recompile. A
        0-d array reaches them as a scalar of its dtype; a Python int as an int64, a float
        as a float64 (as the NumPy API types them). No gradient flows to them
        (NotImplementedError when one is asked).
    block_mask
        Not supported under JAX (NotImplementedError): pass its ``mask_mod``.

    Returns
    -------
    out : jax.Array, shape (..., Hq, L, Ev), the inputs' dtype
    lse : jax.Array, only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad shapes, dtypes, flags or functions, at trace time, with the NumPy API's
        messages.
    NotImplementedError
        For ``block_mask``, for gradients of ``alibi_slopes`` or through ``lse``, and for
        arrays on a device other than the CPU.

    Notes
    -----
    Gradients: query, key, value, a float ``attn_mask`` (computed only when asked) and
    ``sinks``. The kernels' numbers are the NumPy API's: the same results bit for bit on the
    same inputs (and seed).
    """
    _unsupported(block_mask=block_mask)
    dropout_p = check_dropout(dropout_p)
    seed_op = seed_operand(seed, dropout_rng) if dropout_p > 0 else None
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
    mods, mod_ops = mod_operands(score_mod, mask_mod, score_mod_grad, mod_args,
                                 p.compute_dtype, _check_platform)
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
            int(p.is_causal), max(math.prod(p.batch), 1), threshold(dropout_p))
    cfg = _Cfg(p.dtype, p.mask_kind, alibi is not None, sinks_ is not None, ints,
               (float(p.scale), float(r.softcap), 1.0 / (1.0 - dropout_p)), out_shape,
               out_shape[:-1], mods, dropout_p > 0)
    out, lse = _attention(cfg, q, k, v, mask, alibi, sinks_, seed_op, mod_ops)
    out = out.reshape(p.out_shape)
    if not return_lse:
        return out
    return out, lse.reshape(p.out_shape[:-1])
