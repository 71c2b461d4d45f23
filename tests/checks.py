"""Shared test helpers: random inputs, the error measure, and the reference checks."""

import numpy as np

from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

#: Relative Frobenius error allowed against the float64 reference (DESIGN.md §6).
TOL = {np.float16: 1e-3, np.float32: 1e-5, np.float64: 1e-12}


def randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    denom = np.linalg.norm(ref)
    return np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0)


def check(query, key, value, tol=None, **kw):
    """Run sdpa_numba into a NaN-poisoned ``out=`` and compare out and lse with the reference.

    Also checks that the inputs were not modified. Returns ``(out, lse)``.
    """
    dtype = query.dtype.type
    tol = TOL[dtype] if tol is None else tol
    copies = [None if a is None else a.copy() for a in (query, key, value, kw.get("attn_mask"))]
    ref_out, ref_lse = attention(query, key, value, **kw)
    out = np.full(ref_out.shape, np.nan, dtype)
    res, lse = sdpa(query, key, value, out=out, return_lse=True, **kw)
    assert res is out
    assert out.shape == ref_out.shape and out.dtype == query.dtype
    assert lse.shape == ref_lse.shape
    assert lse.dtype == (np.float64 if dtype is np.float64 else np.float32)
    assert not np.isnan(out).any(), "an output element was not written (or is NaN)"
    assert rel_err(out, ref_out) <= tol, rel_err(out, ref_out)
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    if finite.any():
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=10 * tol,
                                   atol=10 * tol * max(1.0, np.abs(ref_lse[finite]).max()))
    for a, c in zip((query, key, value, kw.get("attn_mask")), copies):
        if a is not None:
            np.testing.assert_array_equal(a, c)
    return out, lse


#: Relative Frobenius error allowed for gradients against the float64 reference.
GRAD_TOL = {np.float64: 1e-12, np.float32: 2e-5, np.float16: 5e-3}


def check_backward(backward, g, q, k, v, out, lse, mask=None, tol=None, **kw):
    """Gradients from ``backward`` (the public backward's signature, host arrays in and out)
    against the float64 reference: each of its input's shape and dtype, finite, within
    ``tol``. A float mask's gradient is asked for and checked too. Returns the gradients."""
    mask_grad = mask is not None and mask.dtype != bool
    got = backward(g, q, k, v, out, lse, mask, mask_grad=mask_grad, **kw)
    want = reference.attention_backward(g, q, k, v, mask, **kw)
    tol = GRAD_TOL[q.dtype.type] if tol is None else tol
    for name, a, b, x in zip(("query", "key", "value", "attn_mask"), got, want,
                             (q, k, v, mask)):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert np.isfinite(a).all(), name
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    return got
