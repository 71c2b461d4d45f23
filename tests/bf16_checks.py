"""Helpers of the bfloat16 tests (CPU and CUDA): inputs, the tolerances and the references.

Tolerances, from bfloat16's precision (8 significant bits: a rounding to nearest is off by at
most half an ulp, 2**-8 relative, the unit roundoff) and float32's (the compute dtype):

* out: every element within 1 bf16 ulp of the float64 reference rounded to bfloat16 (the
  kernels round a float32 result that is within ~1e-6 relative of the exact one, so they can
  only differ from the rounded reference where the exact value lies near a rounding tie),
  plus 1e-5 x max|out| for elements near zero, where float32's absolute error exceeds the
  ulp; and the relative Frobenius error at most 2**-8 (+ float32's 1e-5).
* lse: float32's bound (1e-5 relative): it is computed and stored in float32.
* gradients: against a float64 backward that uses the stored bfloat16 ``out`` in
  ``D = rowsum(dO * O)``, as the kernels (and FlashAttention, and torch) do; then the only
  bf16 error is the final rounding of each gradient: relative Frobenius error at most 2**-8,
  plus float32's gradient bound (2e-5). (Against the plain reference, which uses the exact
  O, the error measured up to 4.4e-3: the rounding of O enters dS = P (dP - D) amplified
  wherever dP is close to D.)
"""

import ml_dtypes
import numpy as np

from sdpa_numba import reference
from sdpa_numba.problem import sum_to

BF16 = np.dtype(ml_dtypes.bfloat16)
#: bfloat16's unit roundoff: the largest relative error of a rounding to nearest.
UNIT_ROUNDOFF = 2.0 ** -8
OUT_TOL = UNIT_ROUNDOFF + 1e-5
LSE_TOL = 1e-5
GRAD_TOL = UNIT_ROUNDOFF + 2e-5


def randn(rng, shape):
    return rng.standard_normal(shape).astype(BF16)


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    den = np.linalg.norm(ref)
    return np.linalg.norm(x - ref) / (den if den else 1.0)


def bf16_ulp(x):
    """The spacing of bfloat16 numbers at ``x`` (a bfloat16 array), as float64."""
    return np.spacing(np.abs(np.asarray(x, np.float32))).astype(np.float64) * 2.0 ** 16


def reference_forward(q, k, v, mask=None, dropout_p=0.0, seed=0, **kw):
    if dropout_p > 0:
        return reference.attention_dropout(q, k, v, mask, dropout_p, seed=seed, **kw)
    return reference.attention(q, k, v, mask, **kw)


def check_forward(out, lse, q, k, v, mask=None, **kw):
    """``out`` (bfloat16) and ``lse`` (float32), host arrays, against the float64 reference."""
    ref_out, ref_lse = reference_forward(q, k, v, mask, **kw)
    assert out.dtype == BF16 and out.shape == ref_out.shape
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    got = np.asarray(out, np.float64)
    rounded = ref_out.astype(np.float32).astype(BF16)
    slack = 1e-5 * max(np.abs(ref_out).max(initial=0.0), 1e-30)
    diff = np.abs(got - rounded.astype(np.float64))
    bad = diff > bf16_ulp(rounded) + slack
    assert not bad.any(), (got[bad][:5], ref_out[bad][:5])
    assert rel_err(got, ref_out) <= OUT_TOL, rel_err(got, ref_out)
    masked = np.isneginf(ref_lse)
    assert (np.isneginf(lse) == masked).all()
    assert rel_err(lse[~masked], ref_lse[~masked]) <= LSE_TOL


def reference_backward(g, q, k, v, out, mask=None, dropout_p=0.0, is_causal=False,
                       scale=None, enable_gqa=False, seed=0):
    """float64 gradients, with ``D = rowsum(dO * out)`` from the given (stored) ``out``."""
    q64, k64, v64, scale, rep, p, z, _ = reference._train_forward(
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, seed)
    do = np.asarray(g, np.float64)
    o = np.asarray(out, np.float64)
    dv = np.matmul(np.swapaxes(p * z, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v64, -1, -2)) * z
    d = np.sum(do * o, axis=-1, keepdims=True)
    ds = p * (dp - d)
    dq = np.matmul(ds, k64) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q64) * scale
    if rep > 1:
        dk = dk.reshape(dk.shape[:-3] + (-1, rep) + dk.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(dv.shape[:-3] + (-1, rep) + dv.shape[-2:]).sum(axis=-3)
    dmask = None
    if mask is not None and np.asarray(mask).dtype != bool:
        dmask = sum_to(ds, np.shape(mask))
    red = sum_to
    return (red(dq, np.shape(q)), red(dk, np.shape(k)), red(dv, np.shape(v)), dmask)


def check_grads(got, g, q, k, v, out, mask=None, **kw):
    """Gradients (host arrays) against :func:`reference_backward`."""
    want = reference_backward(g, q, k, v, out, mask, **kw)
    for name, a, b, x in zip(("query", "key", "value", "attn_mask"), got, want,
                             (q, k, v, mask)):
        if b is None:
            continue
        assert a.shape == x.shape and a.dtype == BF16, name
        assert np.isfinite(np.asarray(a, np.float32)).all(), name
        assert rel_err(a, b) <= GRAD_TOL, (name, rel_err(a, b))


def special_float32():
    """float32 bit patterns (uint32) that test a rounding to bfloat16: ties (to even, both
    ways), one below and above ties, every exponent incl. subnormals and zeros, the largest
    finite values (some round to inf), infinities, quiet and signalling NaNs of both signs
    (with payloads only in the bits that are dropped, too), and random patterns."""
    rng = np.random.default_rng(1234)
    hi = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    grid = (hi[:, None] | low[None, :]).ravel()
    exps = (np.arange(256, dtype=np.uint32) << 23)
    mant = rng.integers(0, 1 << 23, (256, 64), dtype=np.uint32)
    by_exp = (exps[:, None] | mant).ravel()
    named = np.array([0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF,
                      0x00800000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0xFF7FFFFF,
                      0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
                      0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F808000], np.uint32)
    rand = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint32)
    bits = np.concatenate([grid, by_exp, by_exp | 0x80000000, named, rand])
    return bits.view(np.float32)


def check_rounding(x, got_bits):
    """``got_bits`` (int16) are ``x`` (float32) rounded to bfloat16: ml_dtypes' conversion
    (round to nearest even) for numbers; for NaN: a quiet NaN of the same sign."""
    got = np.asarray(got_bits).view(np.uint16)
    with np.errstate(invalid="ignore"):  # NaN: compared below, not with ml_dtypes' bits
        want = x.astype(BF16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    g = got[nan]
    assert ((g & 0x7F80) == 0x7F80).all() and ((g & 0x0040) != 0).all()  # a quiet NaN
    np.testing.assert_array_equal(g >> 15, x[nan].view(np.uint32) >> 31)  # its sign
