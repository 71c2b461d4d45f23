"""The public device functions, called from a user's own @cuda.jit kernels."""

import math

import numba
import numpy as np
import pytest
from numba import cuda

from sdpa_numba import reference
from sdpa_numba.gpu import (attend_row, attend_row_recipe, online_softmax_finalize,
                            online_softmax_update)
from sdpa_numba.score.recipe import recipe
from sdpa_cuda_testing import TOL, dev, rel_err

BN = 3  # keys per block in the user's kernels: tiny, so rows cross several blocks
MAX_EV = 8


@cuda.jit
def user_attention_f64(q, k, v, scale, causal, out, lse):
    """One thread per query row of a single head, float64."""
    i = cuda.grid(1)
    if i >= q.shape[0]:
        return
    s = cuda.local.array(BN, numba.float64)
    acc = cuda.local.array(MAX_EV, numba.float64)
    for d in range(v.shape[1]):
        acc[d] = 0
    m = -math.inf
    l = 0.0
    n = k.shape[0]
    if causal:
        n = min(n, i + 1)
    for j0 in range(0, n, BN):
        j1 = min(n, j0 + BN)
        m, l = attend_row(q[i], k[j0:j1], v[j0:j1], scale, s, m, l, acc)
    lse[i] = online_softmax_finalize(m, l, acc, out[i])


@cuda.jit
def user_attention_f32(q, k, v, scale, out, lse):
    """The same in float32: constants typed as float32 so the math stays float32."""
    i = cuda.grid(1)
    if i >= q.shape[0]:
        return
    s = cuda.local.array(BN, numba.float32)
    acc = cuda.local.array(MAX_EV, numba.float32)
    for d in range(v.shape[1]):
        acc[d] = 0
    m = numba.float32(-math.inf)
    l = numba.float32(0)
    sc = numba.float32(scale)
    for j0 in range(0, k.shape[0], BN):
        j1 = min(k.shape[0], j0 + BN)
        m, l = attend_row(q[i], k[j0:j1], v[j0:j1], sc, s, m, l, acc)
    lse[i] = online_softmax_finalize(m, l, acc, out[i])


@cuda.jit
def user_masked_attention(q, k, v, keep, out, lse):
    """Scores computed by the user, masked with -inf, folded with online_softmax_update."""
    i = cuda.grid(1)
    if i >= q.shape[0]:
        return
    s = cuda.local.array(BN, numba.float64)
    acc = cuda.local.array(MAX_EV, numba.float64)
    ev = v.shape[1]
    for d in range(ev):
        acc[d] = 0
    m = -math.inf
    l = 0.0
    for j0 in range(0, k.shape[0], BN):
        n = min(BN, k.shape[0] - j0)
        for j in range(n):
            x = 0.0
            for e in range(q.shape[1]):
                x += q[i, e] * k[j0 + j, e]
            s[j] = x if keep[i, j0 + j] else -math.inf
        m, l, alpha = online_softmax_update(s, 0, n, m, l)
        for d in range(ev):
            a = alpha * acc[d]
            for j in range(n):
                a += s[j] * v[j0 + j, d]
            acc[d] = a
    lse[i] = online_softmax_finalize(m, l, acc, out[i])


def _launch(kernel, L, *args):
    kernel[(L + 3) // 4, 4](*args)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(7, 10), (10, 4), (5, 0)])
def test_attend_row_from_user_kernel(causal, L, S):
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((L, 5)), rng.standard_normal((S, 5)), \
        rng.standard_normal((S, 6))
    out, lse = dev(np.full((L, 6), np.nan)), dev(np.full(L, np.nan))
    _launch(user_attention_f64, L, dev(q), dev(k), dev(v), 0.4, causal, out, lse)
    ref, ref_lse = reference.attention(q, k, v, scale=0.4, is_causal=causal)
    assert rel_err(out.copy_to_host(), ref) <= TOL[np.dtype(np.float64)]
    got_lse = lse.copy_to_host()
    assert (np.isneginf(got_lse) == np.isneginf(ref_lse)).all()
    fin = np.isfinite(ref_lse)
    assert rel_err(got_lse[fin], ref_lse[fin]) <= TOL[np.dtype(np.float64)]


def test_attend_row_float32():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((9, 4), (11, 4), (11, 7)))
    out, lse = dev(np.full((9, 7), np.nan, np.float32)), dev(np.full(9, np.nan, np.float32))
    _launch(user_attention_f32, 9, dev(q), dev(k), dev(v), 0.5, out, lse)
    ref, ref_lse = reference.attention(q, k, v, scale=0.5)
    assert rel_err(out.copy_to_host(), ref) <= TOL[np.dtype(np.float32)]
    assert rel_err(lse.copy_to_host(), ref_lse) <= TOL[np.dtype(np.float32)]


def test_online_softmax_update_with_masked_rows():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((6, 3)), rng.standard_normal((8, 3)), \
        rng.standard_normal((8, 5))
    keep = rng.random((6, 8)) > 0.4
    keep[2] = False  # a fully masked row
    keep[4, :4] = False  # masked for the first blocks only
    out, lse = dev(np.full((6, 5), np.nan)), dev(np.full(6, np.nan))
    _launch(user_masked_attention, 6, dev(q), dev(k), dev(v), dev(keep), out, lse)
    ref, ref_lse = reference.attention(q, k, v, attn_mask=keep, scale=1.0)
    got, got_lse = out.copy_to_host(), lse.copy_to_host()
    assert (got[2] == 0).all() and got_lse[2] == -np.inf
    assert rel_err(got, ref) <= TOL[np.dtype(np.float64)]
    fin = np.isfinite(ref_lse)
    assert rel_err(got_lse[fin], ref_lse[fin]) <= TOL[np.dtype(np.float64)]


@numba.njit
def rel_bias(s, b, h, i, j, table, doc_q, doc_k):
    """A user's score_mod: a relative-position bias per head (T5-like). (Both functions take
    every entry of mod_args.)"""
    return s + table[h, i - j + table.shape[1] // 2]


@numba.njit
def same_doc(b, h, i, j, table, doc_q, doc_k):
    """A user's mask_mod: a query sees the keys of its own document."""
    return doc_q[i] == doc_k[j]


@cuda.jit
def user_variants_attention(q, k, v, scale, table, doc_q, doc_k, out, lse):
    """One thread per (head, query row): a recipe made in the kernel (bottom-right sliding
    window, soft cap, a score_mod and a mask_mod with their arrays), scores formed by it."""
    h, i = cuda.grid(2)
    if h >= q.shape[0] or i >= q.shape[1]:
        return
    S = k.shape[1]
    r = recipe(offset=S - q.shape[1], left=6, right=1, softcap=2.5, score_mod=rel_bias,
               mask_mod=same_doc, mod_args=(table, doc_q, doc_k))
    s = cuda.local.array(BN, numba.float64)
    acc = cuda.local.array(MAX_EV, numba.float64)
    for d in range(v.shape[2]):
        acc[d] = 0
    m = -math.inf
    l = 0.0
    for j0 in range(0, S, BN):
        j1 = min(S, j0 + BN)
        m, l = attend_row_recipe(q[h, i], k[h, j0:j1], v[h, j0:j1], scale, s, m, l, acc, r,
                                 0, h, i, j0)
    lse[h, i] = online_softmax_finalize(m, l, acc, out[h, i])


def test_attend_row_recipe_from_user_kernel():
    rng = np.random.default_rng(10)
    H, L, S, E, Ev = 2, 9, 13, 5, 6
    q, k, v = (rng.standard_normal(sh) for sh in ((H, L, E), (H, S, E), (H, S, Ev)))
    table = rng.standard_normal((H, 2 * S + 1))
    doc_k = np.repeat(np.arange(3), 5)[:S].astype(np.int64)
    doc_q = doc_k[S - L:].copy()
    doc_q[0] = 7  # a row of a document without keys: fully masked
    out, lse = dev(np.full((H, L, Ev), np.nan)), dev(np.full((H, L), np.nan))
    user_variants_attention[(1, (L + 3) // 4), (H, 4)](
        dev(q), dev(k), dev(v), 0.4, dev(table), dev(doc_q), dev(doc_k), out, lse)
    ref, ref_lse = reference.attention(
        q, k, v, scale=0.4, window=(6, 1), alignment="bottom_right", softcap=2.5,
        score_mod=rel_bias, mask_mod=same_doc, mod_args=(table, doc_q, doc_k))
    got, got_lse = out.copy_to_host(), lse.copy_to_host()
    assert (got[:, 0] == 0).all() and np.isneginf(got_lse[:, 0]).all()
    assert rel_err(got, ref) <= TOL[np.dtype(np.float64)]
    fin = np.isfinite(ref_lse)
    assert (np.isneginf(got_lse) == ~fin).all()
    assert rel_err(got_lse[fin], ref_lse[fin]) <= TOL[np.dtype(np.float64)]
