"""varlen_attention and its backward on CUDA arrays (the dense CUDA kernels on per-sequence
views), under the simulator: against the CPU path, which tests/test_varlen.py checks against
the per-sequence float64 reference."""

import math

import numpy as np
from numba import njit

from sdpa_cuda_testing import dev, rel_err
from sdpa_numba import varlen_attention, varlen_attention_backward

LQ = [3, 0, 1, 6, 2, 0]
LK = [5, 2, 0, 6, 3, 0]


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@njit
def bias_mod(s, b, h, i, j, bias, keep):
    return s + bias[b, h] * math.cos(0.3 * (i - j))


@njit
def bias_mod_grad(s, b, h, i, j, bias, keep):
    return 1.0


@njit
def keep_mod(b, h, i, j, bias, keep):
    return (i + 2 * j + b) % keep[b] != 0


def _inputs(rng, hq=4, h=2, e=5, ev=3):
    q = rng.standard_normal((sum(LQ), hq, e))
    k = rng.standard_normal((sum(LK), h, e))
    v = rng.standard_normal((sum(LK), h, ev))
    g = rng.standard_normal((sum(LQ), hq, ev))
    return q, k, v, g


def _check(rng, **kw):
    q, k, v, g = _inputs(rng)
    cq, ck = cu(LQ), cu(LK)
    out = dev(np.full(g.shape, np.nan))
    res, lse = varlen_attention(dev(q), dev(k), dev(v), cq, dev(ck), out=out, return_lse=True,
                                **kw)
    assert res is out
    ref, ref_lse = varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)  # the CPU path
    res, lse = res.copy_to_host(), lse.copy_to_host()
    assert rel_err(res, ref) < 1e-13
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-13)

    grads = varlen_attention_backward(dev(g), dev(q), dev(k), dev(v), dev(ref), dev(ref_lse),
                                      cq, ck, **kw)
    want = varlen_attention_backward(g, q, k, v, ref, ref_lse, cq, ck, **kw)
    assert len(grads) == len(want)
    for x, y in zip(grads, want):
        x = x if isinstance(x, np.ndarray) else x.copy_to_host()
        assert x.shape == y.shape and rel_err(x, y) < 1e-12


def test_gqa_causal_bottom_right_and_empty_sequences(rng):
    _check(rng, is_causal=True, alignment="bottom_right")


def test_variants_and_dropout_per_sequence(rng):
    n = len(LQ)
    bias = rng.standard_normal((n, 4))
    keep = np.array([3, 4, 5, 2, 7, 3], np.int64)
    _check(rng, alibi_slopes=rng.random((n, 4)) * 0.3, sinks=np.array([0.5, -np.inf, -1.0, 2.0]),
           score_mod=bias_mod, score_mod_grad=bias_mod_grad, mask_mod=keep_mod,
           mod_args=(bias, keep), window=(4, 1), dropout_p=0.25, seed=7)
