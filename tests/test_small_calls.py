"""The small-call fast paths (issue 33): cached plans, NumPy-only dispatch, the plain recipe's
compiled entries. Correctness only (against the float64 reference, and calls that must still
be refused after a plan for the same shapes was cached); speed lives in
``python scripts/small_calls.py``."""

import importlib

import numpy as np
import pytest

import sdpa_numba as sn
from sdpa_numba import reference
from sdpa_numba.problem.plan import plan

# The module (the package's ``plan`` attribute is the function).
plan_module = importlib.import_module("sdpa_numba.problem.plan")


def _inputs(rng, dtype=np.float32, q=(1, 3, 1, 7), k=(1, 3, 19, 7), v=(1, 3, 19, 5)):
    return tuple(rng.standard_normal(s).astype(dtype) for s in (q, k, v))


def _close(x, ref, dtype):
    tol = 1e-12 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(np.asarray(x, np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeated_small_calls_match_reference(rng, dtype):
    """One row against odd numbers of keys, called many times (the cached plan and entry):
    every call matches the float64 reference and the first call bitwise."""
    q, k, v = _inputs(rng, dtype)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for causal in (False, True):
        ref = reference.attention(q64, k64, v64, is_causal=causal)[0]
        first = sn.scaled_dot_product_attention(q, k, v, is_causal=causal)
        _close(first, ref, dtype)
        for _ in range(3):
            again = sn.scaled_dot_product_attention(q, k, v, is_causal=causal)
            assert again.tobytes() == first.tobytes()


def test_cached_plan_depends_on_every_key(rng):
    """Plans cached for one set of shapes and flags are not handed to another: a new scale,
    causality, GQA, mask kind or backward flag gives its own plan."""
    q, k, v = _inputs(rng)
    base = plan(q, k, v, None, False, None, False)
    assert plan(q, k, v, None, False, None, False) is base  # cached
    assert plan(q, k, v, None, True, None, False).is_causal
    assert plan(q, k, v, None, False, 0.5, False).scale == 0.5
    assert plan(q, k, v, None, False, -0.0, False).scale == 0.0
    assert np.signbit(plan(q, k, v, None, False, -0.0, False).scale)
    assert not np.signbit(plan(q, k, v, None, False, 0.0, False).scale)
    m = np.ones((1, 19), bool)
    assert plan(q, k, v, m, False, None, False).mask_kind == "bool"
    assert plan(q, k, v, m.astype(np.float32), False, None, False).mask_kind == "additive"
    assert plan(q, k, v, None, False, None, False, backward=True) is not base
    q2 = q.astype(np.float64)
    assert plan(q2, *(x.astype(np.float64) for x in (k, v)), None, False, None,
                False).dtype == np.float64


def test_cached_plan_keeps_the_checks(rng):
    """After a plain call is planned and cached, arguments that only look equal to its key's
    (1 for True, a NumPy bool scale, a mask of another dtype) still raise."""
    q, k, v = _inputs(rng)
    sn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        sn.scaled_dot_product_attention(q, k, v, is_causal=1, scale=0.25)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        sn.scaled_dot_product_attention(q, k, v, enable_gqa=0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        sn.scaled_dot_product_attention(q, k, v, scale=np.bool_(True))
    with pytest.raises(ValueError, match="scale must be finite"):
        sn.scaled_dot_product_attention(q, k, v, scale=float("inf"))
    m = np.ones((1, 19), bool)
    sn.scaled_dot_product_attention(q, k, v, m)
    with pytest.raises(TypeError, match="attn_mask dtype"):
        sn.scaled_dot_product_attention(q, k, v, m.astype(np.int8))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        sn.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        sn.scaled_dot_product_attention(q, k, v, dropout_p=float("nan"))


def test_plan_cache_is_bounded(rng, monkeypatch):
    monkeypatch.setattr(plan_module, "PLANS_KEPT", 4)
    monkeypatch.setattr(plan_module, "_PLANS", {})
    q, k, v = _inputs(rng)
    for s in range(1, 11):
        p = plan(q, k, v, None, False, float(s), False)
        assert p.scale == float(s)
        assert len(plan_module._PLANS) <= 4


def test_masked_and_subclassed_arrays_still_refused(rng):
    """The NumPy-only fast path of the dispatch takes exact ndarrays alone."""
    q, k, v = _inputs(rng)
    sn.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="masked array"):
        sn.scaled_dot_product_attention(np.ma.masked_array(q), k, v)
    with pytest.raises(TypeError, match="must be an array"):
        sn.scaled_dot_product_attention(q, k, None)


def test_backward_without_broadcast_matches_reference(rng):
    """The backward's gradients when nothing is broadcast (no reduction, the plain entry)."""
    q, k, v = _inputs(rng, np.float64)
    g = rng.standard_normal((1, 3, 1, 5))
    out, lse = sn.scaled_dot_product_attention(q, k, v, return_lse=True)
    grads = sn.scaled_dot_product_attention_backward(g, q, k, v, out, lse)
    ref = reference.attention_backward(g, q, k, v)
    for x, r in zip(grads, ref):
        assert x.shape == r.shape
        _close(x, r, np.float64)

