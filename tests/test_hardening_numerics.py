"""Hardening: inputs a user can build that once gave silent wrong answers.

Strides that are not a multiple of the item size, huge finite scores and masks, very long
sequences (float32 accumulation).
"""

import numpy as np
import pytest

from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
from sdpa_numba import reference


def field(rng, shape, offset, pad, dtype=np.float32):
    """A float array that is a field of a structured array: ``offset`` bytes of another field
    before it and ``pad`` bytes after it, so that its row stride is
    ``offset + shape[-1] * itemsize + pad`` bytes (not a multiple of the item size unless
    ``offset + pad`` is) and its start is ``offset`` bytes into the buffer."""
    n = shape[-1]
    itemsize = np.dtype(dtype).itemsize
    rec = np.dtype({"names": ["x"], "formats": [(dtype, (n,))], "offsets": [offset],
                    "itemsize": offset + n * itemsize + pad})
    r = np.zeros(shape[:-1], rec)
    r["x"] = rng.standard_normal(shape)
    return r["x"]


# (offset, pad): row strides of 34, 33, 35 bytes (float32), 70 (float64), and odd starts
FIELDS = [(0, 2), (1, 0), (1, 2), (2, 1), (3, 0)]


@pytest.mark.parametrize("offset,pad", FIELDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_strides_not_multiple_of_itemsize(rng, offset, pad, dtype):
    L, S, E = 5, 70, 8  # S past one key block: full blocks are read in place when they can be
    q = field(rng, (2, L, E), offset, pad, dtype)
    k = field(rng, (2, S, E), offset, pad, dtype)
    v = field(rng, (2, S, E), offset, pad, dtype)
    mask = field(rng, (2, L, S), offset, pad, dtype)
    out = field(rng, (2, L, E), offset, pad, dtype)
    out[...] = np.nan
    got, lse = sdpa(q, k, v, attn_mask=mask, out=out, return_lse=True)
    want, want_lse = reference.attention(q, k, v, attn_mask=mask)
    assert got is out
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("offset,pad", FIELDS)
def test_backward_strides_not_multiple_of_itemsize(rng, offset, pad):
    L, S, E = 5, 70, 8
    q, k, v, g = (field(rng, (L if n != "k" else S, E), offset, pad) for n in "qkvg")
    v = field(rng, (S, E), offset, pad)
    k = field(rng, (S, E), offset, pad)
    out, lse = sdpa(q.copy(), k.copy(), v.copy(), return_lse=True)
    o = field(rng, (L, E), offset, pad)
    o[...] = out
    got = sdpa_backward(g, q, k, v, o, lse)
    want = reference.attention_backward(g.copy(), q.copy(), k.copy(), v.copy(), None)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_forward_negative_and_zero_strides(rng):
    q = rng.standard_normal((7, 6)).astype(np.float32)[::-1]
    k = rng.standard_normal((140, 6)).astype(np.float32)[::-2, ::-1]
    v = np.broadcast_to(rng.standard_normal((1, 5)).astype(np.float32), (70, 5))
    got = sdpa(q, k, v)
    np.testing.assert_allclose(got, reference.attention(q, k, v)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">f2"])
def test_big_endian_is_a_type_error(dtype):
    x = np.ones((3, 4), dtype)
    with pytest.raises(TypeError, match="dtype"):
        sdpa(x, x, x)


# Huge finite scores: any finite score is finite; only -inf masks.

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_forward_huge_finite_mask(rng, dtype):
    """Hugging Face masks with np.finfo(dtype).min: a row masked so everywhere is the softmax
    over equal scores (uniform), as torch gives, not a fully masked row."""
    L, S, E = 6, 70, 8
    q, k, v = (rng.standard_normal((2, n, E)).astype(dtype) for n in (L, S, S))
    mask = np.zeros((2, L, S), dtype)
    big = np.finfo(dtype).min
    mask[0, 1] = big  # every key: uniform over all of them
    mask[1, 2, 5:] = big  # all but five: those five
    mask[1, 3, ::2] = big
    mask[0, 4, :-1] = -np.inf
    mask[0, 4, -1] = big  # one key left, at a finite (huge) score
    out, lse = sdpa(q, k, v, attn_mask=mask, return_lse=True)
    want, want_lse = reference.attention(q, k, v, attn_mask=mask)
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    if dtype != np.float16:  # (float16's min, -65504, leaves the scores' differences)
        np.testing.assert_allclose(out[0, 1], v[0].astype(np.float64).mean(0), rtol=tol,
                                   atol=tol)
    assert np.isfinite(lse).all()
    np.testing.assert_allclose(lse, want_lse.astype(lse.dtype), rtol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_scores_near_the_largest_float(rng, dtype):
    """q·k·scale between FLT_MAX / log2(e) and FLT_MAX (and as negative): finite scores."""
    top = float(np.finfo(dtype).max)
    S, Ev = 67, 5
    q = np.array([[1.0], [-1.0], [0.5]], dtype)
    k = np.linspace(0.72, 0.95, S).reshape(S, 1) * top
    k[10] = 0.95 * top  # two equal top scores for the first row
    k = k.astype(dtype)
    v = rng.standard_normal((S, Ev)).astype(dtype)
    out, lse = sdpa(q, k, v, scale=1.0, return_lse=True)
    want, want_lse = reference.attention(q, k, v, scale=1.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_huge_finite_scores(rng, dtype):
    """Masks of np.finfo(dtype).min and scores near -FLT_MAX and FLT_MAX: finite, right
    gradients. (Not a row whose every score is that large: its lse, m + log(l), rounds to m,
    which the probabilities recomputed from lse cannot undo; torch's flash backward is off the
    same way.)"""
    L, S, E = 6, 130, 4
    q, k, v, g = (rng.standard_normal((n, E)).astype(dtype) for n in (L, S, S, L))
    top = float(np.finfo(dtype).max)
    mask = np.zeros((L, S), dtype)
    mask[1, 1:] = np.finfo(dtype).min
    mask[2, 3:] = np.finfo(dtype).min
    mask[3, ::2] = np.finfo(dtype).min
    # second head: scores up to 0.9 FLT_MAX, and down to -0.9 FLT_MAX, a clear maximum each
    q[0, 0], q[1, 0] = 1, -1
    q[0, 1:] = q[1, 1:] = 0
    k2 = k.copy()
    k2[:, 0] = np.linspace(0.3, 0.9, S) * top
    q, k, v, g = np.stack([q, q]), np.stack([k, k2]), np.stack([v, v]), np.stack([g, g])
    mask = np.stack([mask, np.zeros_like(mask)])
    q[1, 2:] = 0  # rows whose scores are all 0
    out, lse = sdpa(q, k, v, attn_mask=mask, scale=1.0, return_lse=True)
    got = sdpa_backward(g, q, k, v, out, lse, mask, scale=1.0, mask_grad=True)
    want = reference.attention_backward(g, q, k, v, mask, scale=1.0)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for a, b in zip(got, want):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


def test_online_softmax_update_huge_scores():
    from sdpa_numba import cpu

    top = np.finfo(np.float32).max
    s = np.array([[-top, -top, -top], [0.9 * top, 0.8 * top, 0.9 * top]], np.float32)
    v = np.arange(6, dtype=np.float32).reshape(3, 2)
    m = np.full(2, -np.inf, np.float32)
    l = np.zeros(2, np.float32)
    acc = np.zeros((2, 2), np.float32)
    cpu.online_softmax_update(s, v, m, l, acc)
    out = np.empty((2, 2), np.float32)
    lse = np.empty(2, np.float32)
    cpu.online_softmax_finalize(m, l, acc, out, lse)
    np.testing.assert_allclose(out, [[2, 3], [2, 3]], rtol=1e-6)
    assert np.isfinite(lse).all()


# Long sequences: float32 sums over millions of keys.

def _long_uniform(S):
    """One query against S keys of equal scores: the output is the mean of V's rows, which are
    all the same (broadcast views: no memory)."""
    q = np.zeros((1, 1, 1, 2), np.float32)
    k = np.broadcast_to(np.ones((1, 1, 1, 2), np.float32), (1, 1, S, 2))
    row = np.array([3.0, 0.1, 1 / 3], np.float32)
    v = np.broadcast_to(row, (1, 1, S, 3))
    out, lse = sdpa(q, k, v, return_lse=True)
    return out[0, 0, 0], lse[0, 0, 0], row.astype(np.float64)


def test_long_sequence_equal_scores():
    """S = 2**25 (the longest float32 target, ~3 s): one key at a time, it gave 3.667 for 3.0
    at S = 2**24."""
    S = 2**25
    out, lse, want = _long_uniform(S)
    assert np.abs(out - want).max() / np.abs(want).max() <= 1e-5, out
    assert abs(lse - np.log(S)) <= 1e-6 * np.log(S)


def test_long_sequence_random_keys(rng):
    S = 2**22
    q = rng.standard_normal((1, 2)).astype(np.float32)
    k = rng.standard_normal((S, 2)).astype(np.float32)
    v = (rng.standard_normal((S, 2)) + 1).astype(np.float32)
    out, lse = sdpa(q, k, v, return_lse=True)
    want, want_lse = reference.attention(q, k, v)
    # one key at a time: 1.9e-5 here; summed by blocks, then folded: under 1e-6
    assert np.linalg.norm(out - want) / np.linalg.norm(want) <= 5e-6
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_folds_do_not_depend_on_chunking(rng):
    """Past 4096 keys the running totals are folded into outer ones every so many key
    blocks: forward_head's chunks and the parallel forward's still give the same bits, causal
    included (a row's fold points depend on S only)."""
    from sdpa_numba import cpu

    L, S, E = 700, 5000, 8
    q = rng.standard_normal((1, 1, L, E)).astype(np.float32)
    k = rng.standard_normal((1, 1, S, E)).astype(np.float32)
    v = rng.standard_normal((1, 1, S, E)).astype(np.float32)
    for causal in (False, True):
        out = np.empty((1, 1, L, E), np.float32)
        lse = np.empty((1, 1, L), np.float32)
        cpu.forward(q, k, v, None, causal, 0.3, out, lse)
        out1 = np.empty((L, E), np.float32)
        lse1 = np.empty(L, np.float32)
        cpu.forward_head(q[0, 0], k[0, 0], v[0, 0], None, causal, 0.3, out1, lse1)
        assert out1.tobytes() == out[0, 0].tobytes()
        assert lse1.tobytes() == lse[0, 0].tobytes()
        want, want_lse = reference.attention(q, k, v, is_causal=causal, scale=0.3)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
