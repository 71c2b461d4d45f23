"""The score seam (sdpa_numba.score.recipe) element by element, against plain Python."""

import math

import numpy as np
import pytest
from numba import njit, typeof

from sdpa_numba.score import recipe as R


@njit
def _rel_bias(s, b, h, i, j, table):
    return s + table[h, i - j + table.shape[1] // 2]


@njit
def _rel_bias_grad(s, b, h, i, j, table):
    return 2.0 * s  # not the derivative of _rel_bias: shows that the given function is used


@njit
def _doc_mask(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


@njit
def _all(r, L, S, x32):
    """Every seam function at every (i, j) for b = 1, h = 2 (float32 and float64 scores)."""
    mod = np.empty((L, S))
    mod32 = np.empty((L, S), np.float32)
    slope = np.empty((L, S))
    keep = np.empty((L, S), np.bool_)
    for i in range(L):
        for j in range(S):
            s = 0.37 * (i - 2 * j) + 0.5
            mod[i, j] = R.modified_score(r, s, 1, 2, i, j)
            mod32[i, j] = R.modified_score(r, x32 * np.float32(s), 1, 2, i, j)
            slope[i, j] = R.score_slope(r, s, 1, 2, i, j)
            keep[i, j] = R.keeps(r, 1, 2, i, j)
    return mod, mod32, slope, keep


def _expected(r, L, S):
    mod = np.empty((L, S))
    slope = np.empty((L, S))
    keep = np.empty((L, S), bool)
    b, h = 1, 2
    for i in range(L):
        for j in range(S):
            s = 0.37 * (i - 2 * j) + 0.5
            g = 1.0
            if r.softcap > 0:
                t = math.tanh(s / r.softcap)
                s, g = r.softcap * t, 1 - t * t
            if r.alibi is not None:
                s -= r.alibi[min(b + r.batch_offset, r.alibi.shape[0] - 1), h] * abs(
                    i + r.offset - j)
            if r.score_mod is not None:
                g *= (r.score_mod_grad.py_func(s, b + r.batch_offset, h, i, j, *r.mod_args)
                      if r.score_mod_grad is not None else 1.0)
                s = r.score_mod.py_func(s, b + r.batch_offset, h, i, j, *r.mod_args)
            ii = i + r.offset
            keep[i, j] = ii - r.left <= j <= ii + r.right and (
                r.mask_mod is None or r.mask_mod.py_func(b + r.batch_offset, h, i, j,
                                                         *r.mod_args))
            mod[i, j], slope[i, j] = s, g
    return mod, slope, keep


rng = np.random.default_rng(7)
TABLE = rng.standard_normal((4, 31))
DOC = rng.integers(0, 3, (3, 9))
CASES = {
    "dense": R.recipe(),
    "causal": R.CAUSAL,
    "window-bottom-right": R.recipe(offset=4, left=3, right=1),
    "softcap": R.recipe(softcap=2.5),
    "alibi": R.recipe(alibi=rng.random((2, 4)), offset=-2, batch_offset=1),
    "score_mod": R.recipe(score_mod=_rel_bias, score_mod_grad=_rel_bias_grad, mod_args=(TABLE,),
                          softcap=3.0),
    "mask_mod": R.recipe(mask_mod=_doc_mask, mod_args=(DOC,), right=0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_seam_matches_python(name):
    r = CASES[name]
    L, S = 9, 13
    mod, mod32, slope, keep = _all(r, L, S, np.float32(1))
    emod, eslope, ekeep = _expected(r, L, S)
    np.testing.assert_allclose(mod, emod, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(slope, eslope, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(keep, ekeep)
    # float32 scores stay float32 through every step (no float64 promotion)
    np.testing.assert_allclose(mod32, emod, rtol=2e-6, atol=2e-5)


def test_numbers_share_one_type():
    """Dense, causal, windows, alignment and soft cap are one Numba type: one compilation."""
    t = typeof(R.DENSE)
    for r in (R.CAUSAL, R.recipe(offset=5, left=2, right=0), R.recipe(softcap=30.0),
              R.with_batch_offset(R.DENSE, 3)):
        assert typeof(r) == t


def test_key_range_and_cover():
    @njit
    def ranges(r, L, S, bi, bj):
        out = []
        for i0 in range(0, L, bi):
            i1 = min(L, i0 + bi) - 1
            jb, je = R.key_range(r, i0, i1, S)
            for j0 in range(0, S, bj):
                j1 = min(S, j0 + bj) - 1
                out.append((i0, i1, j0, j1, jb, je, R.window_covers(r, i0, i1, j0, j1)))
        return out

    for r in (R.DENSE, R.CAUSAL, R.recipe(offset=4, left=3, right=1),
              R.recipe(offset=10, left=1, right=0),
              R.recipe(offset=-7, left=0, right=R.NO_LIMIT)):
        for i0, i1, j0, j1, jb, je, covers in ranges(r, 17, 23, 4, 5):
            seen = [(i, j) for i in range(i0, i1 + 1) for j in range(23)
                    if i + r.offset - r.left <= j <= i + r.offset + r.right]
            js = sorted({j for _, j in seen})
            # none: (0, 0), not an empty range past the last key (blocks aligned down from
            # there would be read)
            assert (jb, je) == ((js[0], js[-1] + 1) if js else (0, 0))
            tile = [(i, j) for i in range(i0, i1 + 1) for j in range(j0, j1 + 1)]
            assert covers == all(p in set(seen) for p in tile)


def test_fold_sink():
    f = njit(lambda m, l, s: R.fold_sink(m, l, s))
    m, l, a = f(1.0, 2.0, 0.5)
    assert m == 1.0 and a == 1.0 and l == pytest.approx(2.0 + math.exp(-0.5), rel=1e-15)
    m, l, a = f(1.0, 2.0, 3.0)
    assert m == 3.0 and a == pytest.approx(math.exp(-2.0)) and \
        l == pytest.approx(2.0 * math.exp(-2.0) + 1.0, rel=1e-15)
    assert f(-np.inf, 0.0, 0.25) == (0.25, 1.0, 0.0)  # all keys masked: out 0, lse = sink
    assert f(1.5, 2.0, -np.inf) == (1.5, 2.0, 1.0)  # no sink
