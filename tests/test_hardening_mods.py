"""Hardening: a user's ``score_mod`` / ``mask_mod`` that raises.

Numba loses an exception raised inside a ``prange`` body (the worker thread leaves its loop,
the launch returns as if nothing happened): the parallel kernels returned garbage with no
error. Now the exception reaches the caller, with the user's message, from every parallel
CPU kernel, as it does from the serial ones.
"""

import numpy as np
import pytest
from numba import njit

import sdpa_numba
from sdpa_numba import (attention_with_kvcache, scaled_dot_product_attention,
                        scaled_dot_product_attention_backward, varlen_attention,
                        varlen_attention_backward)


@njit
def score_raises_at_row_3(s, b, h, i, j):
    if i == 3:
        raise ValueError("score_mod refuses row 3")
    return s


@njit
def score_grad(s, b, h, i, j):
    return 1.0


@njit
def mask_raises_at_key_2(b, h, i, j):
    if j == 2:
        raise ValueError("mask_mod refuses key 2")
    return True


@njit
def score_raises_at_head_1(s, b, h, i, j):
    if h == 1:
        raise ValueError("score_mod refuses head 1")
    return s


MODS = [({"score_mod": score_raises_at_row_3}, "score_mod refuses row 3"),
        ({"mask_mod": mask_raises_at_key_2}, "mask_mod refuses key 2")]


def _qkv(rng, shape_q=(2, 3, 37, 16), shape_k=(2, 3, 29, 16)):
    return (rng.standard_normal(shape_q).astype(np.float32),
            rng.standard_normal(shape_k).astype(np.float32),
            rng.standard_normal(shape_k).astype(np.float32))


@pytest.mark.parametrize("mods,message", MODS)
def test_forward_raises_the_users_exception(rng, mods, message):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, k, v, **mods)


@pytest.mark.parametrize("mods,message", MODS)
def test_backward_raises_the_users_exception(rng, mods, message):
    q, k, v = _qkv(rng)
    # The forward's out and lse, from a function that does not raise.
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    if "score_mod" in mods:
        mods = {**mods, "score_mod_grad": score_grad}
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention_backward(out, q, k, v, out, lse, **mods)


@pytest.mark.parametrize("mods,message", MODS)
def test_varlen_raises_the_users_exception(rng, mods, message):
    total, hq, e = 23, 2, 8
    q, k, v = (rng.standard_normal((total, hq, e)).astype(np.float32) for _ in range(3))
    cu = np.array([0, 9, total], np.int32)
    with pytest.raises(ValueError, match=message):
        varlen_attention(q, k, v, cu, cu, **mods)
    out, lse = varlen_attention(q, k, v, cu, cu, return_lse=True)
    if "score_mod" in mods:
        mods = {**mods, "score_mod_grad": score_grad}
    with pytest.raises(ValueError, match=message):
        varlen_attention_backward(out, q, k, v, out, lse, cu, cu, **mods)


@pytest.mark.parametrize("mods,message", [({"score_mod": score_raises_at_head_1},
                                            "score_mod refuses head 1"), MODS[1]])
def test_kvcache_raises_the_users_exception(rng, mods, message):
    # (the cache's rows count from its first key: row 3 is never a decode query's)
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    kc = rng.standard_normal((2, 40, 2, 8)).astype(np.float32)
    vc = rng.standard_normal((2, 40, 2, 8)).astype(np.float32)
    seqlens = np.array([40, 33], np.int32)
    with pytest.raises(ValueError, match=message):
        attention_with_kvcache(q, kc, vc, seqlens, **mods)


@pytest.mark.parametrize("mods,message", MODS)
def test_parallel_kernel_from_jitted_code_raises(rng, mods, message):
    # sdpa_numba.cpu.forward called from a user's @njit function: the exception reaches it,
    # as a raising function called by any jitted code does.
    from sdpa_numba.score.recipe import recipe

    q, k, v = _qkv(rng)
    out = np.empty(q.shape, np.float32)
    lse = np.empty(q.shape[:3], np.float32)
    r = recipe(**mods)

    @njit
    def caller(q, k, v, out, lse, r):
        sdpa_numba.cpu.forward(q, k, v, None, False, 0.25, out, lse, None, r)

    with pytest.raises(ValueError, match=message):
        caller(q, k, v, out, lse, r)


def test_functions_that_do_not_raise_give_the_reference(rng):
    # The guard changes nothing for functions that never raise: the same bits as the
    # serial kernel, which has no guard.
    from sdpa_numba.score.recipe import recipe

    @njit
    def halve(s, b, h, i, j):
        return s * 0.5

    q, k, v = _qkv(rng)
    got = scaled_dot_product_attention(q, k, v, score_mod=halve, scale=0.3)
    out = np.empty(q.shape[2:], np.float32)
    lse = np.empty(q.shape[2], np.float32)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            sdpa_numba.cpu.forward_head(q[b, h], k[b, h], v[b, h], None, False, 0.3, out, lse,
                                        recipe(score_mod=halve), b, h)
            np.testing.assert_array_equal(got[b, h], out)
