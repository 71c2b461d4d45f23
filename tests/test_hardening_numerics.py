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
