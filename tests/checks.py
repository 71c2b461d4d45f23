"""Shared test helpers: random inputs, the error measure, and the reference checks."""

import numpy as np

from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

#: Relative Frobenius error allowed against the float64 reference. Measured with
#: scripts/measure_errors.py (its default 150 trials per dtype, seed 123):
#: worst float32 5.2e-7, float64 1.0e-15 over 450 random problems (odd L, S in 1..200, E in
#: 1..64, causal or not, no / bool / additive mask with -inf); the bounds are ~8-10x that.
#: float16 outputs are held to the element bound F16_EXCESS below; its Frobenius bound (float16
#: rounding alone gives up to 3.4e-4) only guards against gross errors.
TOL = {np.float16: 6e-4, np.float32: 4e-6, np.float64: 1e-14}

#: Compute dtype (accumulators, lse) of each storage dtype, and its machine epsilon.
COMPUTE = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}
EPS = {t: float(np.finfo(COMPUTE[t]).eps) for t in COMPUTE}

#: lse: |lse - ref| <= LSE_EPS * eps(compute dtype) * max(1, |ref|, mag), element by element
#: (lse is float32 for float16 inputs, so it takes float32's eps). ``mag`` is the row's largest
#: |scale| * sum_e |q_e k_je|: a score is a dot product, whose rounding error grows with the sum
#: of its terms' magnitudes, not with the result's (terms that cancel leave a small score with
#: the error of a large one; hypothesis found such a row: S = 1, E = 64, scale 1.94, 57 eps of
#: |lse|). Measured worst in units of max(1, |ref|): 6.1 (float16 inputs), 5.4 (float32), 5.0
#: (float64) on the problems above; the bound is ~7x that.
LSE_EPS = 40.0

#: float16 outputs: |out - ref| <= ulp16(ref) / 2 + F16_EXCESS * eps32 * max|v| element by
#: element: within half a float16 ulp of the float64 reference (i.e. its correct rounding, up
#: to ties) plus the float32 accumulation error. Measured worst excess: 1.28 eps32 * max|v|
#: on the problems above; the bound is ~6x that. (Every output scaled by 0.9995 fails it.)
F16_EXCESS = 8.0


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
    strict = tol == TOL[dtype]  # a caller's own (looser) tol relaxes the element bounds too
    if dtype is np.float16 and strict:
        check_f16(out, ref_out, value)
    check_lse(lse, ref_lse, dtype, LSE_EPS if strict else LSE_EPS * tol / TOL[dtype],
              score_magnitude(query, key, kw.get("scale"), kw.get("enable_gqa", False)))
    for a, c in zip((query, key, value, kw.get("attn_mask")), copies):
        if a is not None:
            np.testing.assert_array_equal(a, c)
    return out, lse


def check_f16(out, ref_out, value, excess=F16_EXCESS):
    """float16 ``out`` within half an ulp of the float64 ``ref_out`` plus the float32
    accumulation error (``excess * eps32 * max|value|``), element by element."""
    if out.size == 0:
        return
    ref16 = np.abs(ref_out).astype(np.float16)
    half_ulp = 0.5 * np.spacing(ref16).astype(np.float64)
    vmax = float(np.abs(np.asarray(value, np.float64)).max()) if np.size(value) else 0.0
    err = np.abs(np.asarray(out, np.float64) - ref_out)
    bound = half_ulp + excess * EPS[np.float16] * vmax
    bad = err > bound
    assert not bad.any(), (f"{bad.sum()} float16 outputs off by more than half an ulp + "
                           f"{excess} eps32 max|v|; worst excess "
                           f"{((err - half_ulp) / (EPS[np.float16] * max(vmax, 1e-300))).max()}")


def score_magnitude(query, key, scale=None, enable_gqa=False):
    """Per query row, the largest ``|scale| * sum_e |q_e k_je|`` over the keys: the size of the
    terms whose rounding errors a score (and so lse) carries. Shape: the lse's."""
    q = np.abs(np.asarray(query, np.float64))
    k = np.abs(np.asarray(key, np.float64))
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    e = q.shape[-1]
    s = abs(scale) if scale is not None else (1.0 / np.sqrt(e) if e else 1.0)
    terms = np.matmul(q, np.swapaxes(k, -1, -2)) * s
    return terms.max(axis=-1) if terms.shape[-1] else np.zeros(terms.shape[:-1])


def check_lse(lse, ref_lse, dtype, factor=LSE_EPS, magnitude=0.0):
    """lse: the same -inf entries as the reference, the rest within ``factor * eps * max(1,
    |ref|, magnitude)`` of it (eps of the compute dtype; ``magnitude`` from
    :func:`score_magnitude`, broadcast to lse's shape)."""
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    if finite.any():
        got = np.asarray(lse, np.float64)[finite]
        want = ref_lse[finite]
        mag = np.broadcast_to(magnitude, ref_lse.shape)[finite]
        err = np.abs(got - want) / (EPS[dtype] * np.maximum(np.maximum(1.0, np.abs(want)), mag))
        assert err.max() <= factor, f"lse off by {err.max():.1f} eps (bound {factor})"


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
