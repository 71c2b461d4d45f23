"""Regression: queries whose product with ``scale`` overflows, while the scores do not.

The kernels fold the score's factor into the packed queries; with q = 1e38, scale 4 and
k = 1e-3 (float32) that fold overflowed and the output was NaN where torch gives 1.0. The
queries here are large (their product with ``scale`` overflows the compute dtype for most
elements), the keys small (subnormal: a score of order one needs |k| < 1 / FLT_MAX), so the
scores, the outputs and the gradients are ordinary numbers, checked against the float64
reference (:mod:`sdpa_numba.reference`, which computes ``scale · q · k`` in float64).
"""

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward

from varlen_checks import cu, reference_forward

SCALE = 2.0 ** 20
F32_MAX = float(np.finfo(np.float32).max)


def overflowing(rng, shape, dtype=np.float32):
    """``(q, k)``: ``scale · q`` overflows ``dtype`` for most elements of q; the scores
    ``scale · q · k`` are of order one."""
    q = (rng.standard_normal(shape[0]) * 1e33).astype(dtype)
    k = (rng.standard_normal(shape[1]) * 4e-40).astype(dtype)
    assert np.isinf(q.astype(np.float32) * np.float32(SCALE)).mean() > 0.5
    return q, k


def test_forward_example_of_the_issue():
    q = np.full((1, 1, 1, 1), 1e38, np.float32)
    k = np.full((1, 1, 1, 1), 1e-3, np.float32)
    v = np.ones((1, 1, 1, 1), np.float32)
    out, lse = sdpa(q, k, v, scale=4.0, return_lse=True)
    assert out[0, 0, 0, 0] == 1.0
    np.testing.assert_allclose(lse, 4e35, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward(rng, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    q, k = overflowing(rng, ((2, 3, 37, 24), (2, 3, 45, 24)), dtype)
    v = rng.standard_normal((2, 3, 45, 24)).astype(dtype)
    out = np.full(q.shape, np.nan, dtype)
    got, lse = sdpa(q, k, v, scale=SCALE, out=out, return_lse=True)
    want, want_lse = reference.attention(q, k, v, scale=SCALE)
    tol = 1e-5 if dtype == np.float32 else 2 ** -8
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_forward_infinite_query_keeps_its_row():
    # An infinite query in the same block of packed queries as overflowing ones: its row
    # is NaN (as torch's), the others are right.
    q, k = overflowing(rng_ := np.random.default_rng(5), ((1, 1, 9, 16), (1, 1, 20, 16)))
    q[0, 0, 3, 2] = np.inf
    v = rng_.standard_normal((1, 1, 20, 16)).astype(np.float32)
    got = sdpa(q, k, v, scale=SCALE)
    want, _ = reference.attention(np.where(np.isinf(q), 0, q), k, v, scale=SCALE)
    rows = [i for i in range(9) if i != 3]
    np.testing.assert_allclose(got[0, 0, rows], want[0, 0, rows], rtol=1e-5, atol=1e-5)
    assert np.isnan(got[0, 0, 3]).all()


def grads_close(got, want, n_terms):
    """Gradients against the float64 reference. dK = scale · dSᵀ Q (of the order of
    scale · q · dO: dO is small, so that it fits float32) and dV to 1e-4; dQ = scale · dS K
    is summed from subnormal terms (K is subnormal), each off by up to half a subnormal ulp
    (2**-150) before the factor: ``n_terms`` of them per element."""
    for g, w, floor in zip(got, want, (SCALE * n_terms * 2.0 ** -150, 0, 0)):
        assert np.abs(w).max() < F32_MAX / 4  # partial sums stay finite
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max() + floor)


def test_backward(rng):
    q, k = overflowing(rng, ((1, 2, 33, 16), (1, 2, 40, 16)))
    v = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    # a small dO: dK = scale · dSᵀ Q, of the order of scale · q · dO, fits float32
    g = (rng.standard_normal((1, 2, 33, 16)) * 1e-2).astype(np.float32)
    out, lse = sdpa(q, k, v, scale=SCALE, return_lse=True)
    got = sdpa_backward(g, q, k, v, out, lse, scale=SCALE)
    grads_close(got, reference.attention_backward(g, q, k, v, scale=SCALE), 40 * 16)


def test_varlen_forward(rng):
    lq, lk = [5, 17], [9, 30]
    cq, ck = cu(lq), cu(lk)
    q, k = overflowing(rng, ((sum(lq), 2, 16), (sum(lk), 2, 16)))
    v = rng.standard_normal((sum(lk), 2, 16)).astype(np.float32)
    got, lse = sdpa_numba.varlen_attention(q, k, v, cq, ck, scale=SCALE, return_lse=True)
    want, want_lse = reference_forward(q, k, v, cq, ck, scale=SCALE)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq", [2, 8])  # MHA (one row per key head), GQA (four)
def test_kvcache_decode(rng, hq):
    B, S, H, E = 2, 70, 2, 32
    q, kc = overflowing(rng, ((B, 1, hq, E), (B, S, H, E)))
    vc = rng.standard_normal((B, S, H, E)).astype(np.float32)
    lens = np.array([70, 41], np.int32)
    got = sdpa_numba.attention_with_kvcache(q, kc, vc, lens, scale=SCALE)
    check_decode(got, q, kc, vc, lens)


def check_decode(got, q, kc, vc, lens):
    """One decode step (``Lq = 1``, so causality changes nothing) against the reference on
    each sequence's first ``lens[b]`` keys."""
    for b in range(len(lens)):
        n = lens[b]
        want, _ = reference.attention(q[b].transpose(1, 0, 2)[None],
                                      kc[b, :n].transpose(1, 0, 2)[None],
                                      vc[b, :n].transpose(1, 0, 2)[None],
                                      scale=SCALE, enable_gqa=True)
        np.testing.assert_allclose(got[b].transpose(1, 0, 2), want[0], rtol=1e-5, atol=1e-5)
