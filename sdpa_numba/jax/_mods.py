"""The user's functions (``score_mod``, ``mask_mod``, ``score_mod_grad``), their ``mod_args``
and dropout's seed, checked at trace time and turned into FFI operands.

The functions are part of a handler's specialization (by the dispatcher's identity: each new
function compiles a new handler and kernel); ``mod_args`` and the seed are operands, read by the
handler when it runs (:mod:`._handlers`): new values never recompile, and they may be traced.
"""

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ..dropout import check_seed
from ..problem.variants import check_function

#: The most dims a mod_args array may have (each rank is its own jitted view,
#: :func:`._frame.ranked`).
MAX_MOD_ARG_DIMS = 8


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic)


def mod_operands(score_mod, mask_mod, score_mod_grad, mod_args, cdt, check_platform):
    """``(mods, operands)`` of a call: ``mods`` the handlers' specialization, None without
    functions, else ``(score_mod, mask_mod, score_mod_grad, specs)`` with one ``(dtype, ndim,
    carried)`` per mod_arg; ``operands`` the mod_args as JAX arrays.

    Each mod_arg is a JAX or NumPy array of 1 to 8 dims (reaching the functions as a
    C-contiguous array of its dtype as JAX holds it), a 0-d array (its dtype's scalar, read
    when the call runs), or a Python or NumPy scalar (as the NumPy API types it: a Python int
    is an int64, a float a float64, carried as bytes: JAX without ``jax_enable_x64`` has no
    64-bit arrays). The functions are checked by the NumPy API's :func:`check_function`
    (Numba dispatcher, arity, return type for these argument types); TypeError / ValueError
    name the argument.
    """
    from numba import from_dtype

    if mod_args is None:
        mod_args = ()
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays or numbers, got "
                        f"{type(mod_args).__name__}")
    check_platform([(f"mod_args[{n}]", x) for n, x in enumerate(mod_args)])
    specs, operands, stand_ins = [], [], []
    for n, x in enumerate(mod_args):
        name = f"mod_args[{n}]"
        if _is_array(x):
            a = jnp.asarray(x)
            dt = np.dtype(a.dtype)
            try:
                from_dtype(dt)
            except (NotImplementedError, TypeError, ValueError):
                raise TypeError(f"{name} has dtype {dt}, which Numba cannot pass to a jitted "
                                f"function") from None
            if a.ndim > MAX_MOD_ARG_DIMS:
                raise NotImplementedError(
                    f"sdpa_numba.jax takes mod_args arrays of at most {MAX_MOD_ARG_DIMS} dims; "
                    f"{name} has {a.ndim}")
            specs.append((dt.str, a.ndim, "array"))
            operands.append(a)
            stand_ins.append(dt.type(0) if a.ndim == 0 else np.zeros((1,) * a.ndim, dt))
        elif isinstance(x, (bool, numbers.Number, np.generic)):
            try:
                s = np.asarray(x)
                from_dtype(s.dtype)
            except (NotImplementedError, TypeError, ValueError, OverflowError):
                raise TypeError(f"{name} has a type Numba cannot pass to a jitted function: "
                                f"{type(x).__name__} (use arrays and numbers)") from None
            if s.dtype.kind not in "biuf":
                raise TypeError(f"{name} must be a bool, int or float scalar (or an array), "
                                f"got {type(x).__name__}")
            raw = s.tobytes()
            raw = raw + b"\0" * (-len(raw) % 4)
            specs.append((s.dtype.str, 0, "bytes"))
            operands.append(jnp.asarray(np.frombuffer(raw, np.uint32).copy()))
            stand_ins.append(s[()])
        else:
            raise TypeError(f"{name} has a type Numba cannot pass to a jitted function: "
                            f"{type(x).__name__} (use arrays and numbers)")
    stand_ins = tuple(stand_ins)
    score_mod = check_function("score_mod", score_mod, "score", stand_ins, cdt)
    mask_mod = check_function("mask_mod", mask_mod, "mask", stand_ins, cdt)
    score_mod_grad = check_function("score_mod_grad", score_mod_grad, "score", stand_ins, cdt)
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad is given without a score_mod")
    if specs and score_mod is None and mask_mod is None:
        raise ValueError("mod_args are given without a score_mod or mask_mod to receive them")
    if score_mod is None and mask_mod is None:
        return None, ()
    return (score_mod, mask_mod, score_mod_grad, tuple(specs)), tuple(operands)


def forward_mods(mods):
    """The forward's ``mods``: without ``score_mod_grad`` (as the NumPy API's forward recipe,
    so that the forward's specialization does not depend on it)."""
    return None if mods is None else mods[:2] + (None,) + mods[3:]


def check_mods_grad(mods, mod_args, function):
    """At ``custom_vjp``'s forward: NotImplementedError for a gradient asked of the
    ``mod_args`` (rather than a silent zero); ValueError for a ``score_mod`` without its
    ``score_mod_grad``."""
    if any(x.perturbed for x in mod_args):
        raise NotImplementedError(f"sdpa_numba.jax.{function} has no gradient for mod_args "
                                  f"(numbers the user's functions read): differentiate the "
                                  f"other inputs")
    if mods is not None and mods[0] is not None and mods[2] is None:
        raise ValueError(f"the backward of a score_mod needs score_mod_grad(score, b, h, i, "
                         f"j, *mod_args): d score_mod / d score (pass it to "
                         f"sdpa_numba.jax.{function} to differentiate)")


def seed_operand(seed, dropout_rng):
    """Dropout's seed as an FFI operand: two uint32 words, low first (the NumPy API's 64-bit
    seed), from ``seed`` (an int in ``[0, 2**64)``, as the NumPy API's, or a uint32 array of
    shape ``(2,)``, possibly traced) or ``dropout_rng`` (a JAX PRNG key, typed or legacy: the
    words are ``jax.random.bits(dropout_rng, (2,), uint32)``). Exactly one must be given."""
    if seed is not None and dropout_rng is not None:
        raise ValueError("give dropout_rng or seed, not both")
    if dropout_rng is not None:
        if not _is_array(dropout_rng):
            raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key(n)), got "
                            f"{type(dropout_rng).__name__}")
        typed = jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
        if not typed and (np.dtype(dropout_rng.dtype) != np.uint32
                          or tuple(dropout_rng.shape) != (2,)):
            raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key(n), or a "
                            f"legacy jax.random.PRNGKey: uint32 of shape (2,)), got "
                            f"{np.dtype(dropout_rng.dtype)} of shape "
                            f"{tuple(dropout_rng.shape)}")
        if typed and dropout_rng.shape != ():
            raise ValueError(f"dropout_rng must be a single key (shape ()), got shape "
                             f"{tuple(dropout_rng.shape)} (use jax.vmap to map over keys)")
        return jax.random.bits(dropout_rng, (2,), jnp.uint32)
    if seed is None:
        raise ValueError("dropout_p > 0 under JAX needs dropout_rng (a jax.random.key) or "
                         "seed (an int, or uint32 words of shape (2,)): a fresh seed would "
                         "make the function impure")
    if _is_array(seed):
        if np.dtype(seed.dtype) != np.uint32 or tuple(seed.shape) != (2,):
            raise TypeError(f"seed as an array must be uint32 of shape (2,) (the 64-bit "
                            f"seed's low and high words), got {np.dtype(seed.dtype)} of shape "
                            f"{tuple(seed.shape)}")
        return jnp.asarray(seed)
    s = check_seed(seed)
    return jnp.asarray(np.array([s], np.uint64).view(np.uint32))
