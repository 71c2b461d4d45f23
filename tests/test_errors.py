"""Bad input raises TypeError/ValueError naming the argument, before any kernel runs."""

import numpy as np
import pytest

from sdpa_numba import scaled_dot_product_attention as sdpa


def qkv(L=5, S=7, E=4, Ev=3, H=2, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((H, L, E)).astype(dtype),
            rng.standard_normal((H, S, E)).astype(dtype),
            rng.standard_normal((H, S, Ev)).astype(dtype))


def raises(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        sdpa(*args, **kw)


def test_wrong_ndim():
    q, k, v = qkv()
    raises(ValueError, "query must have at least 2 dims", q[0, 0], k, v)
    raises(ValueError, "key must have at least 2 dims", q, k[0, 0], v)
    raises(ValueError, "value must have at least 2 dims", q, k, v[0, 0])
    raises(ValueError, r"value must have at least 2 dims.*got shape \(\)", q, k, np.float32(1.0))
    raises(TypeError, "value must be an array", q, k, [[1.0]])


def test_mismatched_shapes():
    q, k, v = qkv()
    raises(ValueError, r"key's last dim must equal query's.*\(2, 5, 4\).*\(2, 7, 3\)",
           q, k[..., :3], v)
    raises(ValueError, "value must have as many rows as key", q, k, v[:, :6])
    raises(ValueError, "key and value must have the same number of heads", q, k, v[:1])
    raises(ValueError, "heads of query and key", np.zeros((3, 5, 4), np.float32), k, v)
    raises(ValueError, "batch dims of query, key and value do not broadcast",
           q[None].repeat(2, 0), k[None].repeat(3, 0), v)


def test_gqa_head_counts():
    q, k, v = qkv(H=6)
    raises(ValueError, "enable_gqa needs query heads to be a multiple",
           q, k[:4], v[:4], enable_gqa=True)


def test_dtypes():
    q, k, v = qkv()
    raises(TypeError, "query dtype int64 is not supported", q.astype(np.int64), k, v)
    raises(TypeError, "key dtype float64 differs from query dtype float32",
           q, k.astype(np.float64), v)
    raises(TypeError, "value dtype float16 differs", q, k, v.astype(np.float16))
    raises(TypeError, "query dtype complex64", q.astype(np.complex64), k, v)


def test_not_arrays():
    q, k, v = qkv()
    raises(TypeError, "query must be an array.*list", q.tolist(), k, v)
    raises(TypeError, "attn_mask must be an array.*float", q, k, v, attn_mask=1.0)
    raises(TypeError, "out must be an array.*list", q, k, v, out=[0])


def test_masks():
    q, k, v = qkv()
    raises(TypeError, "attn_mask dtype float64 must be bool or the query dtype float32",
           q, k, v, attn_mask=np.zeros((5, 7)))
    raises(TypeError, "attn_mask dtype int32", q, k, v, attn_mask=np.zeros((5, 7), np.int32))
    raises(ValueError, r"attn_mask of shape \(5, 6\) does not broadcast", q, k, v,
           attn_mask=np.ones((5, 6), bool))
    raises(ValueError, r"attn_mask .* does not broadcast", q, k, v,
           attn_mask=np.ones((3, 2, 5, 7), bool))  # would enlarge the batch
    raises(ValueError, r"attn_mask .* does not broadcast", q, k, v,
           attn_mask=np.ones((3, 5, 7), bool))


@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan])
def test_scale_must_be_finite(scale):
    raises(ValueError, "scale must be finite", *qkv(), scale=scale)


def test_scale_type():
    raises(TypeError, "scale must be a real number", *qkv(), scale="0.5")
    raises(TypeError, "scale must be a real number", *qkv(), scale=True)
    raises(TypeError, "scale must be a real number", *qkv(), scale=1j)


def test_flags():
    raises(TypeError, "is_causal must be a bool", *qkv(), is_causal=1)
    raises(TypeError, "enable_gqa must be a bool", *qkv(), enable_gqa="yes")
    raises(TypeError, "return_lse must be a bool", *qkv(), return_lse=None)


def test_dropout():
    raises(ValueError, r"dropout_p must be in \[0, 1\)", *qkv(), dropout_p=1.0)
    raises(ValueError, r"dropout_p must be in \[0, 1\)", *qkv(), dropout_p=-0.1)
    raises(TypeError, "dropout_p must be a real number", *qkv(), dropout_p="0.1")
    raises(ValueError, "dropout_p must be in", *qkv(), dropout_p=np.nan)


def test_out():
    q, k, v = qkv()
    raises(ValueError, r"out must have shape \(2, 5, 3\) and dtype float32, got \(2, 5, 4\)",
           q, k, v, out=np.empty((2, 5, 4), np.float32))
    raises(ValueError, "out must have shape .* got .* float64", q, k, v,
           out=np.empty((2, 5, 3)))
    ro = np.empty((2, 5, 3), np.float32)
    ro.flags.writeable = False
    raises(ValueError, "out must be writeable", q, k, v, out=ro)
    q, k, v = qkv(L=5, S=5, E=3, Ev=3)
    raises(ValueError, "out overlaps query", q, k, v, out=q)
    raises(ValueError, "out overlaps value", q, k, v, out=v[:, ::-1])


def test_positional_order_matches_torch():
    q, k, v = qkv()
    with pytest.raises(TypeError):
        sdpa(q, k, v, None, 0.0, False, None, False, True)  # return_lse is keyword-only


def test_errors_leave_out_untouched():
    q, k, v = qkv()
    out = np.full((2, 5, 3), 7.0, np.float32)
    with pytest.raises(ValueError):
        sdpa(q, k, v, out=out, scale=np.nan)
    assert (out == 7.0).all()
