"""Hardening of the CUDA kernels (simulator): huge finite scores and masks, and block sums.

Blocks are tiny (conftest.TINY: 4 keys per block).
"""

import numpy as np

import sdpa_numba
from sdpa_numba import reference
from sdpa_cuda_testing import dev


def _run(q, k, v, mask=None, scale=None):
    out, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v),
                                                       attn_mask=dev(mask), scale=scale,
                                                       return_lse=True)
    return out.copy_to_host(), lse.copy_to_host()


def test_huge_finite_mask_and_scores():
    rng = np.random.default_rng(5)
    L, S, E = 4, 9, 3
    q, k, v = (rng.standard_normal((n, E)).astype(np.float32) for n in (L, S, S))
    mask = np.zeros((L, S), np.float32)
    mask[1] = np.finfo(np.float32).min  # every key: uniform
    mask[2, 2:] = np.finfo(np.float32).min
    out, lse = _run(q, k, v, mask)
    want, want_lse = reference.attention(q, k, v, attn_mask=mask)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
    top = float(np.finfo(np.float32).max)
    q2 = np.array([[1.0], [-1.0]], np.float32)
    k2 = (np.linspace(0.72, 0.95, S).reshape(S, 1) * top).astype(np.float32)
    v2 = v[:, :2].copy()
    out, lse = _run(q2, k2, v2, scale=1.0)
    want, want_lse = reference.attention(q2, k2, v2, scale=1.0)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_block_sums_before_the_running_total():
    """A first key of value 2**24 and then keys of value 1, equal scores: added one at a time
    to the running total, each 1 is lost (2**24 + 1 rounds to 2**24 in float32); a key block's
    sum (4) is not."""
    S = 36
    q = np.zeros((1, 2), np.float32)
    k = np.zeros((S, 2), np.float32)
    v = np.ones((S, 1), np.float32)
    v[0] = 2.0**24
    v[1:4] = 0
    out, _ = _run(q, k, v)
    want = (2.0**24 + S - 4) / S
    np.testing.assert_allclose(out[0, 0], want, rtol=2e-7)
