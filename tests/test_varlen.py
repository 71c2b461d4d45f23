"""varlen_attention and its backward (packed ragged batches) against per-sequence float64
references (:mod:`varlen_checks`).

Compile cost (float64 unless said): the forward with the plain recipe (dense, causal, windows,
alignment, soft cap) and in float32, with dropout, with one recipe of every optional part
(ALiBi, sinks, score_mod, mask_mod, mod_args); the backward with the plain recipe and with
that recipe plus score_mod_grad.
"""

import math

import numba
import numpy as np
import pytest

from checks import randn, rel_err
from sdpa_numba import reference, varlen_attention, varlen_attention_backward
from varlen_checks import (bias_mod, bias_mod_grad, cu, keep_mod, packed, per_sequence,
                           reference_forward, reference_grads)

TOL = {np.float64: 1e-12, np.float32: 2e-5}
GRAD_TOL = {np.float64: 1e-10}

# Lengths with empty and length-1 sequences, Lq != Lk, and (backward) one whose keys are
# split into several groups.
LQ = [3, 0, 1, 33, 17, 5, 0]
LK = [5, 4, 0, 20, 17, 1, 0]




# --- forward ----------------------------------------------------------------------------------

FORWARD_CASES = {
    "dense": dict(),
    "causal": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, alignment="bottom_right"),
    "window_softcap": dict(window=(3, 2), alignment="bottom_right", softcap=1.5, scale=0.7),
}


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_forward_matches_reference(rng, name):
    kw = FORWARD_CASES[name]
    q, k, v = packed(rng, LQ, LK, 6, 2, 9, 7)
    cq, ck = cu(LQ), cu(LK, np.int64)
    before = [x.copy() for x in (q, k, v, cq, ck)]
    out = np.full((sum(LQ), 6, 7), np.nan)
    res, lse = varlen_attention(q, k, v, cq, ck, out=out, return_lse=True, **kw)
    assert res is out and lse.shape == (6, sum(LQ)) and lse.dtype == np.float64
    ref_out, ref_lse = reference_forward(q, k, v, cq, ck, **kw)
    assert rel_err(res, ref_out) < TOL[np.float64]
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.allclose(lse[finite], ref_lse[finite], rtol=1e-12, atol=1e-12)
    # the rows of the sequence without keys: zeros and -inf
    rows = slice(cq[2], cq[3])
    assert (res[rows] == 0).all() and np.isneginf(lse[:, rows]).all()
    for x, y in zip((q, k, v, cq, ck), before):
        assert np.array_equal(x, y)


def test_forward_float32_strided(rng):
    """float32 inputs that are views with odd strides; the hints max_seqlen_* checked."""
    lq, lk = [70, 1, 0, 130], [40, 3, 2, 130]
    q, k, v = packed(rng, lq, lk, 8, 8, 40, 24, np.float32)
    q = np.asfortranarray(q)
    k = np.concatenate([k, k], axis=2)[:, :, ::2]
    res, lse = varlen_attention(q, k, v, cu(lq), cu(lk), is_causal=True, return_lse=True,
                                max_seqlen_q=130, max_seqlen_k=200)
    ref_out, ref_lse = reference_forward(q, k, v, cu(lq), cu(lk), is_causal=True)
    assert res.dtype == np.float32 and lse.dtype == np.float32
    assert rel_err(res, ref_out) < TOL[np.float32]
    finite = np.isfinite(ref_lse)
    assert np.allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def _all_variants(rng, n_seq, hq):
    bias = rng.standard_normal((n_seq, hq))
    keep = np.array([3, 4, 5, 2, 7, 3, 3][:n_seq], np.int64)
    return dict(alibi_slopes=rng.random((n_seq, hq)) * 0.3,
                sinks=np.array([0.5, -np.inf, -1.0, 2.0]), score_mod=bias_mod,
                mask_mod=keep_mod, mod_args=(bias, keep), window=(None, 1),
                alignment="bottom_right")


def test_every_variant_per_sequence(rng):
    """ALiBi per sequence, sinks, a score_mod and a mask_mod reading mod_args by the sequence
    index, a window aligned bottom-right: forward, backward and the sinks' gradient."""
    hq = 4
    q, k, v = packed(rng, LQ, LK, hq, 2, 5, 6)
    cq, ck = cu(LQ), cu(LK)
    kw = _all_variants(rng, len(LQ), hq)
    res, lse = varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    ref_out, ref_lse = reference_forward(q, k, v, cq, ck, **kw)
    assert rel_err(res, ref_out) < TOL[np.float64]
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    assert np.allclose(lse[finite], ref_lse[finite], rtol=1e-12, atol=1e-12)

    g = randn(rng, res.shape, np.float64)
    grads = varlen_attention_backward(g, q, k, v, res, lse, cq, ck,
                                      score_mod_grad=bias_mod_grad, **kw)
    assert len(grads) == 4
    ref = reference_grads(g, q, k, v, cq, ck, score_mod_grad=bias_mod_grad, **kw)
    for got, want in zip(grads[:3], ref[:3]):
        assert rel_err(got, want) < GRAD_TOL[np.float64]
    assert grads[3].dtype == np.float64 and grads[3][1] == 0
    assert rel_err(grads[3], ref[3]) < GRAD_TOL[np.float64]


# --- backward ---------------------------------------------------------------------------------

# a long sequence among short ones: its keys are split into key groups (partial dQs)
LONG_Q = [1, 0, 900, 3, 40]
LONG_K = [2, 5, 1030, 0, 37]


@pytest.mark.parametrize("kw", [dict(is_causal=True, alignment="bottom_right"),
                                dict(window=(100, 20), softcap=2.0)])
def test_backward_matches_reference(rng, kw):
    q, k, v = packed(rng, LONG_Q, LONG_K, 2, 1, 12, 10)
    cq, ck = cu(LONG_Q), cu(LONG_K)
    out, lse = varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    g = randn(rng, out.shape, np.float64)
    grads = varlen_attention_backward(g, q, k, v, out, lse, cq, ck, **kw)
    ref = reference_grads(g, q, k, v, cq, ck, **kw)
    for got, want, x in zip(grads, ref, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype
        assert rel_err(got, want) < GRAD_TOL[np.float64]
    # keys of the sequence without queries get zero gradients
    assert (grads[1][ck[1]:ck[2]] == 0).all() and (grads[2][ck[1]:ck[2]] == 0).all()


def test_dropout_is_the_dense_stream_of_the_sequence_index(rng):
    """Sequence b draws the dense call's mask of batch entry b (the documented seed rule):
    forward and backward against the reference's dropout on the embedded batch."""
    q, k, v = packed(rng, LQ, LK, 4, 2, 6, 5)
    cq, ck = cu(LQ), cu(LK)
    kw = dict(dropout_p=0.3, seed=1234, is_causal=True)
    out, lse = varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    ref_out, ref_lse = per_sequence(reference.attention_dropout, q, k, v, cq, ck,
                                    enable_gqa=True, **kw)
    assert rel_err(out, ref_out) < TOL[np.float64]
    other = varlen_attention(q, k, v, cq, ck, dropout_p=0.3, seed=1235, is_causal=True)
    assert rel_err(other, ref_out) > 1e-3  # the seed matters
    g = randn(rng, out.shape, np.float64)
    grads = varlen_attention_backward(g, q, k, v, out, lse, cq, ck, **kw)
    ref = reference_grads(g, q, k, v, cq, ck, **kw)
    for got, want in zip(grads, ref[:3]):
        assert rel_err(got, want) < GRAD_TOL[np.float64]


def test_thread_count_does_not_change_results(rng):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs at least 2 threads to compare")
    q, k, v = packed(rng, LONG_Q, LONG_K, 2, 1, 12, 10)
    cq, ck = cu(LONG_Q), cu(LONG_K)
    g = randn(rng, (sum(LONG_Q), 2, 10), np.float64)
    before = numba.get_num_threads()
    runs = []
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            out, lse = varlen_attention(q, k, v, cq, ck, is_causal=True, return_lse=True)
            runs.append((out, lse, *varlen_attention_backward(g, q, k, v, out, lse, cq, ck,
                                                              is_causal=True)))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()


# --- bad input --------------------------------------------------------------------------------

def _good():
    rng = np.random.default_rng(0)
    q, k, v = packed(rng, [2, 3], [4, 1], 4, 2, 8, 8)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu([2, 3]), cu_seqlens_k=cu([4, 1]))


def _bad(**change):
    args = _good()
    args.update(change)
    return args


BAD = [
    (lambda: _bad(cu_seqlens_q=np.array([1, 2, 5])), ValueError, "cu_seqlens_q must start at 0"),
    (lambda: _bad(cu_seqlens_k=np.array([0, 4, 3, 5])), ValueError,
     "cu_seqlens_k must not decrease"),
    (lambda: _bad(cu_seqlens_q=np.array([0, 2, 4])), ValueError, "cu_seqlens_q must end at"),
    (lambda: _bad(cu_seqlens_k=np.array([0.0, 4.0, 5.0])), TypeError, "cu_seqlens_k must be an "
     "integer array"),
    (lambda: _bad(cu_seqlens_q=np.array([True, False])), TypeError, "cu_seqlens_q"),
    (lambda: _bad(cu_seqlens_q=np.array([[0, 2, 5]])), ValueError, r"cu_seqlens_q must have "
     r"shape \(B \+ 1,\)"),
    (lambda: _bad(cu_seqlens_q=5), TypeError, "cu_seqlens_q must be"),
    (lambda: _bad(cu_seqlens_k=np.array([0, 5])), ValueError,
     "cu_seqlens_q and cu_seqlens_k must hold the same number of sequences"),
    (lambda: _bad(q=np.zeros((5, 8))), ValueError, "q must have 3 dims"),
    (lambda: _bad(v=np.zeros((5, 2, 8, 1))), ValueError, "v must have 3 dims"),
    (lambda: _bad(k=np.zeros((5, 2, 7))), ValueError, "k's last dim must equal q's"),
    (lambda: _bad(v=np.zeros((4, 2, 8))), ValueError, "v must have k's rows and heads"),
    (lambda: _bad(k=np.zeros((5, 3, 8)), v=np.zeros((5, 3, 8))), ValueError,
     "multiple of k's"),
    (lambda: _bad(q=np.zeros((5, 4, 8), np.int64)), TypeError, "q dtype int64"),
    (lambda: _bad(k=np.zeros((5, 2, 8), np.float32)), TypeError, "k dtype float32 differs"),
    (lambda: _bad(max_seqlen_q=2), ValueError, r"max_seqlen_q = 2 is smaller than the longest "
     r"sequence \(3\)"),
    (lambda: _bad(max_seqlen_k=2.5), TypeError, "max_seqlen_k must be an int"),
    (lambda: _bad(alignment="middle"), ValueError, "alignment"),
    (lambda: _bad(window=(-1, 0)), ValueError, "window"),
    (lambda: _bad(alibi_slopes=np.zeros((3, 4))), ValueError, "alibi_slopes"),
    (lambda: _bad(sinks=np.zeros(3)), ValueError, "sinks"),
    (lambda: _bad(block_mask=object()), ValueError, "block_mask is not supported by "
     "varlen_attention"),
    (lambda: _bad(out=np.zeros((5, 4, 7))), ValueError, "out must have shape"),
    (lambda: _bad(dropout_p=1.0), ValueError, "dropout_p"),
    (lambda: _bad(is_causal=1), TypeError, "is_causal"),
    (lambda: _bad(scale=math.inf), ValueError, "scale"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input(case):
    make, exc, match = BAD[case]
    args = make()
    with pytest.raises(exc, match=match):
        varlen_attention(**args)


def test_bad_backward_input():
    args = _good()
    out, lse = np.zeros((5, 4, 8)), np.zeros((4, 5))
    q, k, v, cq, ck = (args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    with pytest.raises(ValueError, match="lse must have"):
        varlen_attention_backward(out, q, k, v, out, lse.T, cq, ck)
    with pytest.raises(ValueError, match="grad_out must have"):
        varlen_attention_backward(out[:, :2], q, k, v, out, lse, cq, ck)
    with pytest.raises(ValueError, match="needs the seed"):
        varlen_attention_backward(out, q, k, v, out, lse, cq, ck, dropout_p=0.1)
    with pytest.raises(ValueError, match="score_mod_grad"):
        varlen_attention_backward(out, q, k, v, out, lse, cq, ck, score_mod=bias_mod,
                                  mod_args=(np.zeros((2, 4)), np.ones(2, np.int64)))
    with pytest.raises(ValueError, match="cu_seqlens_k must end at"):
        varlen_attention_backward(out, q, k, v, out, lse, cq, cu([4, 2]))
