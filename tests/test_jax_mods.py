"""sdpa_numba.jax's dense attention with the user's functions (score_mod, mask_mod,
score_mod_grad with mod_args as FFI operands) and with dropout (a seed or a JAX PRNG key):
bit for bit the NumPy API's forward and backward under jax.jit, grad and vmap; a float64
finite-difference check; bad input refused at trace time naming the argument.

Each new function or dropout on/off is a compiled specialization (tens of seconds here): the
tests share two, float64: (score_mod + mask_mod + mod_args) and (dropout).
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402
from numba import njit  # noqa: E402

import sdpa_numba  # noqa: E402
from sdpa_numba.jax import scaled_dot_product_attention as attention  # noqa: E402
from mod_functions import MODS, tilt, tilt_grad  # noqa: E402


def qkv(rng, b=2, h=3, L=6, S=6, E=9, Ev=5):
    return (rng.standard_normal((b, h, L, E)), rng.standard_normal((b, h, S, E)),
            rng.standard_normal((b, h, S, Ev)))


def docs(rng, b, S):
    return np.sort(rng.integers(0, 3, (b, S)), axis=1).astype(np.int32)


def _numpy(q, k, v, g, mod_args, **kw):
    """The NumPy API's out and gradients (of sum(out * g))."""
    out, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                       mod_args=mod_args, **kw)
    kw.pop("score_mod_grad", None)
    grads = sdpa_numba.scaled_dot_product_attention_backward(
        g, q, k, v, out, lse, mod_args=mod_args, score_mod_grad=tilt_grad, **kw)
    return out, grads


def test_score_and_mask_mod_bitwise(rng):
    q, k, v = qkv(rng, L=5, S=7)
    slopes, ids = rng.standard_normal(3), docs(rng, 2, 7)
    args = (slopes, ids, 0.25)
    g = rng.standard_normal((2, 3, 5, 5))

    def f(q, k, v, slopes, ids):
        return attention(q, k, v, is_causal=True, alignment="bottom_right",
                         mod_args=(slopes, ids, 0.25), score_mod_grad=tilt_grad, **MODS)

    out = jax.jit(f)(q, k, v, slopes, ids)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2)))(
        q, k, v, slopes, ids)
    want, want_grads = _numpy(q, k, v, g, args, is_causal=True, alignment="bottom_right",
                              **MODS)
    np.testing.assert_array_equal(out, want)
    for got, exp in zip(grads, want_grads):
        np.testing.assert_array_equal(got, exp)
    # the functions did change the result (the test can fail)
    assert not np.allclose(out, sdpa_numba.scaled_dot_product_attention(
        q, k, v, is_causal=True, alignment="bottom_right"))
    # new mod_args values: the same compiled call, the NumPy API's numbers again
    ids2 = ids[:, ::-1].copy()
    np.testing.assert_array_equal(
        jax.jit(f)(q, k, v, -slopes, ids2),
        sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                alignment="bottom_right",
                                                mod_args=(-slopes, ids2, 0.25), **MODS))


def test_mods_large_and_vmap(rng):
    # Above the size where the NumPy API builds a block mask (empty blocks skipped): the
    # handler's every-block-partial mask gives the same bits. Then vmap over q and mod_args:
    # each slice sees b in the unmapped call's batch.
    from sdpa_numba.problem.block_mask import BUILD_MIN_SCORES

    b, h, L = 1, 4, 300
    assert b * h * L * L >= BUILD_MIN_SCORES
    q, k, v = qkv(rng, b=b, h=h, L=L, S=L, E=8, Ev=8)
    slopes, ids = rng.standard_normal(h), docs(rng, b, L)
    f = jax.jit(lambda q, slopes, ids: attention(q, k, v, mod_args=(slopes, ids, 0.5),
                                                 **MODS))
    np.testing.assert_array_equal(f(q, slopes, ids), sdpa_numba.scaled_dot_product_attention(
        q, k, v, mod_args=(slopes, ids, 0.5), **MODS))
    q, k, v = qkv(rng, L=5, S=5)
    qs = np.stack([q, q[:, ::-1]])
    idss = np.stack([docs(rng, 2, 5) for _ in range(2)])
    got = jax.jit(jax.vmap(lambda q, ids: attention(q, k, v, mod_args=(slopes[:3], ids, 0.5),
                                                    **MODS)))(qs, idss)
    for n in range(2):
        np.testing.assert_array_equal(got[n], sdpa_numba.scaled_dot_product_attention(
            qs[n], k, v, mod_args=(slopes[:3], idss[n], 0.5), **MODS))


def test_mods_finite_differences(rng):
    q, k, v = qkv(rng, b=1, h=3, L=4, S=5, E=3, Ev=2)
    slopes, ids = rng.standard_normal(3), docs(rng, 1, 5)

    def f(q, k, v):
        return attention(q, k, v, mod_args=(slopes, ids, 0.25), score_mod_grad=tilt_grad,
                         **MODS)

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def _seed_of(key):
    return int(np.asarray(jax.random.bits(key, (2,), jnp.uint32)).view(np.uint64)[0])


def test_dropout_bitwise(rng):
    q, k, v = qkv(rng, L=5, S=7)
    g = rng.standard_normal((2, 3, 5, 5))
    key = jax.random.key(3)
    seed = _seed_of(key)

    def f(q, k, v, key):
        return attention(q, k, v, dropout_p=0.3, is_causal=True, dropout_rng=key)

    out = jax.jit(f)(q, k, v, key)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2)))(q, k, v, key)
    want, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True,
                                                        seed=seed, return_lse=True)
    want_grads = sdpa_numba.scaled_dot_product_attention_backward(
        g, q, k, v, want, lse, dropout_p=0.3, is_causal=True, seed=seed)
    np.testing.assert_array_equal(out, want)
    for got, exp in zip(grads, want_grads):
        np.testing.assert_array_equal(got, exp)
    assert not np.allclose(out, sdpa_numba.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=True))
    # the NumPy API's int seed, and its words as a traced uint32 array: the same mask
    words = np.array([seed], np.uint64).view(np.uint32)
    np.testing.assert_array_equal(
        jax.jit(lambda q: attention(q, k, v, dropout_p=0.3, is_causal=True, seed=seed))(q),
        want)
    np.testing.assert_array_equal(
        jax.jit(lambda q, s: attention(q, k, v, dropout_p=0.3, is_causal=True, seed=s))(
            q, words), want)
    # another key, another mask
    assert not np.array_equal(jax.jit(f)(q, k, v, jax.random.key(4)), want)


def test_dropout_vmap(rng):
    q, k, v = qkv(rng, L=5, S=7)
    qs = np.stack([q, 2 * q])
    key = jax.random.key(5)
    one = jax.jit(jax.vmap(lambda q: attention(q, k, v, dropout_p=0.3, is_causal=True,
                                               dropout_rng=key)))(qs)
    keys = jax.random.split(key, 2)
    each = jax.jit(jax.vmap(lambda q, kk: attention(q, k, v, dropout_p=0.3, is_causal=True,
                                                    dropout_rng=kk)))(qs, keys)
    for n in range(2):
        # one key: every slice draws the unmapped call's mask; mapped keys: their own
        np.testing.assert_array_equal(one[n], sdpa_numba.scaled_dot_product_attention(
            qs[n], k, v, dropout_p=0.3, is_causal=True, seed=_seed_of(key)))
        np.testing.assert_array_equal(each[n], sdpa_numba.scaled_dot_product_attention(
            qs[n], k, v, dropout_p=0.3, is_causal=True, seed=_seed_of(keys[n])))


@njit
def _two_args(s, b):
    return s


@njit
def _returns_int(b, h, i, j):
    return 1


@pytest.mark.parametrize("bad, kind, match", [
    (dict(score_mod=lambda s, b, h, i, j: s), TypeError, "score_mod must be a Numba"),
    (dict(score_mod=_two_args), TypeError, "score_mod must take 5 arguments"),
    (dict(mask_mod=_returns_int), TypeError, "mask_mod must return a bool"),
    (dict(score_mod=tilt, mod_args=(np.ones(3), "x", 1.0)), TypeError, r"mod_args\[1\]"),
    (dict(score_mod=tilt, mod_args=[np.ones(3)] * 2 + [1.0] * 2), TypeError,
     "score_mod must take 9 arguments"),
    (dict(mod_args=(np.ones(3),)), ValueError, "mod_args are given without"),
    (dict(score_mod_grad=tilt_grad, mod_args=(np.ones(3), np.ones((1, 1), np.int32), 1.0)),
     ValueError, "score_mod_grad is given without"),
    (dict(score_mod=tilt, mod_args=(np.ones((1,) * 9), np.ones((1, 1), np.int32), 1.0)),
     NotImplementedError, r"mod_args\[0\] has 9"),
    (dict(dropout_p=0.1), ValueError, "dropout_rng"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed must be in"),
    (dict(dropout_p=0.1, seed=np.zeros(2, np.int32)), TypeError, "seed as an array"),
    (dict(dropout_p=0.1, dropout_rng=np.zeros(3, np.uint32)), TypeError, "dropout_rng"),
    (dict(dropout_p=0.1, seed=1, dropout_rng=jax.random.key(0)), ValueError, "not both"),
    (dict(dropout_p=1.0, seed=1), ValueError, "dropout_p"),
])
def test_bad_input_at_trace_time(rng, bad, kind, match):
    q, k, v = qkv(rng)
    f = jax.jit(lambda q, k, v: attention(q, k, v, **bad))
    with pytest.raises(kind, match=match):
        f.trace(q, k, v)  # tracing alone: nothing compiled, nothing run


def test_grad_through_score_mod_needs_its_grad(rng):
    q, k, v = qkv(rng)
    args = (np.ones(3), np.zeros((2, 6), np.int32), 1.0)
    with pytest.raises(ValueError, match="score_mod_grad"):
        jax.grad(lambda q: jnp.sum(attention(q, k, v, score_mod=tilt, mod_args=args)))(q)
    with pytest.raises(NotImplementedError, match="mod_args"):
        jax.grad(lambda s: jnp.sum(attention(q, k, v, score_mod=tilt, score_mod_grad=tilt_grad,
                                             mod_args=(s,) + args[1:])))(args[0])
