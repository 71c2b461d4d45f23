"""Attention variants (issue 15): the float64 reference, the validation of the keywords, and
the CPU forward against the reference.

The reference's variants are checked against independent forms first (a window as a bool
mask, a sink as an extra key with a zero value row, its backward by finite differences), so
that the kernels' tests below rest on something checked.
"""

import dataclasses
import math

import numpy as np
import pytest
from numba import njit

import sdpa_numba
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward


# --- users' functions (module level: compiled once per process) ------------------------------

@njit
def softcap_mod(s, b, h, i, j, c):
    return c * math.tanh(s / c)


@njit
def softcap_mod_grad(s, b, h, i, j, c):
    t = math.tanh(s / c)
    return 1.0 - t * t


@njit
def alibi_mod(s, b, h, i, j, slopes, offset):
    return s - slopes[h] * abs(i + offset - j)


@njit
def one_grad(s, b, h, i, j, *args):
    return 1.0


@njit
def rel_bias(s, b, h, i, j, table):
    """A relative-position bias table (T5-like): one learned number per (head, i - j)."""
    return s + table[h, i - j + table.shape[1] // 2]


@njit
def doc_mask(b, h, i, j, doc_q, doc_k):
    """Document masking: a query sees the keys of its own document."""
    return doc_q[b, i] == doc_k[b, j]


@njit
def prefix_lm(b, h, i, j, prefix):
    """Prefix-LM: the prefix is seen by everyone, the rest causally."""
    return j < prefix or j <= i


@njit
def causal_mask(b, h, i, j):
    return j <= i


@njit
def square(s, b, h, i, j):
    return s * s


@njit
def not_bool(b, h, i, j):
    return 1.5


def qkv(rng, shape_q, shape_k, ev=None, dtype=np.float64):
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + ((ev or shape_k[-1]),)).astype(dtype)
    return q, k, v


def window_mask(L, S, left, right, offset=0):
    i = np.arange(L)[:, None] + offset
    j = np.arange(S)[None, :]
    keep = np.ones((L, S), bool)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    return keep


# --- the reference against independent forms ------------------------------------------------

@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window,causal", [((3, 1), False), ((None, 2), False),
                                           ((4, None), True), (None, True), ((0, 0), False)])
def test_reference_window_is_a_bool_mask(alignment, window, causal):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, (2, 7, 5), (2, 11, 5))
    offset = 11 - 7 if alignment == "bottom_right" else 0
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    mask = window_mask(7, 11, left, right, offset)
    want = reference.attention(q, k, v, mask)
    got = reference.attention(q, k, v, window=window, alignment=alignment, is_causal=causal)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_reference_sink_is_a_key_with_zero_value():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (3, 6, 4), (3, 9, 4))
    sinks = np.array([0.3, -1.0, 2.0])
    scale = 0.5
    # An extra key whose score is the sink: q_e = 1 on an extra column, k = sink / scale.
    q2 = np.concatenate([q, np.ones((3, 6, 1))], axis=-1)
    k2 = np.concatenate([np.concatenate([k, np.zeros((3, 9, 1))], axis=-1),
                         np.concatenate([np.zeros((3, 1, 4)),
                                         (sinks / scale)[:, None, None]], axis=-1)], axis=1)
    v2 = np.concatenate([v, np.zeros((3, 1, 4))], axis=1)
    want = reference.attention(q2, k2, v2, scale=scale)
    got = reference.attention(q, k, v, scale=scale, sinks=sinks)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13)


def test_reference_fully_masked_rows_with_and_without_sinks():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (2, 4, 3), (2, 5, 3))
    mask = np.ones((4, 5), bool)
    mask[1] = False
    out, lse = reference.attention(q, k, v, mask)
    assert np.all(out[:, 1] == 0) and np.all(lse[:, 1] == -np.inf)
    out, lse = reference.attention(q, k, v, mask, sinks=np.array([0.5, -2.0]))
    assert np.all(out[:, 1] == 0)
    np.testing.assert_array_equal(lse[:, 1], [0.5, -2.0])


def test_reference_order_of_the_score():
    """scale -> softcap -> ALiBi -> score_mod -> additive mask, written out for one entry."""
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (2, 3, 4), (2, 5, 4))
    slopes = np.array([0.25, 0.5])
    add = rng.standard_normal((2, 3, 5))
    table = rng.standard_normal((2, 9))
    out, _ = reference.attention(q, k, v, add, scale=0.7, softcap=1.5, alibi_slopes=slopes,
                                 score_mod=rel_bias, mod_args=(table,), alignment="bottom_right")
    s = 0.7 * np.einsum("hle,hse->hls", q, k)
    s = 1.5 * np.tanh(s / 1.5)
    i = np.arange(3)[:, None] + 2
    j = np.arange(5)[None, :]
    s = s - slopes[:, None, None] * np.abs(i - j)
    s = s + table[np.arange(2)[:, None, None], (i - 2) - j + 4]
    s = s + add
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out, (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-13)


def _loss(out, g):
    return float(np.sum(out * g))


@pytest.mark.parametrize("case", ["softcap-sinks", "score_mod-alibi-window"])
def test_reference_backward_by_finite_differences(case):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, (2, 4, 3), (2, 6, 3))
    g = rng.standard_normal((2, 4, 3))
    if case == "softcap-sinks":
        kw = dict(softcap=1.3, sinks=np.array([0.4, -0.2]), is_causal=True,
                  alignment="bottom_right")
        grad_kw = {}
    else:
        kw = dict(score_mod=square, alibi_slopes=np.array([0.3, 0.1]), window=(2, 1))
        grad_kw = dict(score_mod_grad=njit(lambda s, b, h, i, j: 2.0 * s))
    grads = reference.attention_backward(g, q, k, v, **kw, **grad_kw)
    h = 1e-6

    def numeric(x, name):
        d = np.zeros_like(x)
        for idx in np.ndindex(*x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            args = {"q": q, "k": k, "v": v, "sinks": kw.get("sinks")}
            args_p, args_m = dict(args, **{name: xp}), dict(args, **{name: xm})
            fp = _loss(reference.attention(args_p["q"], args_p["k"], args_p["v"],
                                           **dict(kw, sinks=args_p["sinks"]))[0], g)
            fm = _loss(reference.attention(args_m["q"], args_m["k"], args_m["v"],
                                           **dict(kw, sinks=args_m["sinks"]))[0], g)
            d[idx] = (fp - fm) / (2 * h)
        return d

    for got, x, name in zip(grads[:3], (q, k, v), ("q", "k", "v")):
        np.testing.assert_allclose(got, numeric(x, name), rtol=1e-6, atol=1e-8)
    if "sinks" in kw:
        assert len(grads) == 5 and grads[3] is None
        np.testing.assert_allclose(grads[4], numeric(kw["sinks"], "sinks"), rtol=1e-6,
                                   atol=1e-8)
    else:
        assert len(grads) == 4


def test_reference_backward_needs_score_mod_grad():
    q = np.ones((2, 3))
    with pytest.raises(ValueError, match="score_mod_grad"):
        reference.attention_backward(q, q, q, q, score_mod=square)


# --- validation: clear errors before any kernel runs ----------------------------------------

def _q(dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((2, 3, 5, 4)).astype(dtype),
            rng.standard_normal((2, 3, 7, 4)).astype(dtype),
            rng.standard_normal((2, 3, 7, 4)).astype(dtype))


ERRORS = [
    (dict(window=(-1, 0)), ValueError, "window's left side must be >= 0"),
    (dict(window=(0, -3)), ValueError, "window's right side must be >= 0"),
    (dict(window=(1.5, 0)), TypeError, "window's left side must be an int"),
    (dict(window=(True, 0)), TypeError, "window's left side must be an int"),
    (dict(window=3), TypeError, "window must be None or a pair"),
    (dict(window=(1, 2, 3)), TypeError, "window must be None or a pair"),
    (dict(alignment="bottom"), ValueError, "alignment must be 'top_left' or 'bottom_right'"),
    (dict(alignment=1), TypeError, "alignment must be"),
    (dict(softcap=0.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=-2.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=math.inf), ValueError, "softcap must be finite and > 0"),
    (dict(softcap=math.nan), ValueError, "softcap must be finite and > 0"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=np.ones(4)), ValueError, r"alibi_slopes of shape \(4\) must have"),
    (dict(alibi_slopes=np.ones((3, 3))), ValueError, "alibi_slopes of shape"),
    (dict(alibi_slopes=np.ones((1, 2, 3))), ValueError, "alibi_slopes of shape"),
    (dict(alibi_slopes=np.ones(3, np.int64)), TypeError, "alibi_slopes must be float32 or"),
    (dict(alibi_slopes=np.array([1.0, np.nan, 1.0])), ValueError, "alibi_slopes must be finite"),
    (dict(alibi_slopes=2.0), TypeError, "alibi_slopes must be an array"),
    (dict(sinks=np.ones((2, 3))), ValueError, r"sinks of shape \(2, 3\) must have shape"),
    (dict(sinks=np.ones(3, np.float16)), TypeError, "sinks must be float32 or float64"),
    (dict(sinks=np.array([0.0, np.inf, 0.0])), ValueError, "sinks must be finite or -inf"),
    (dict(score_mod=lambda s, b, h, i, j: s), TypeError, "score_mod must be a Numba @njit"),
    (dict(score_mod=causal_mask), TypeError, r"score_mod must take 5 arguments"),
    (dict(score_mod=rel_bias), TypeError, r"score_mod must take 5 arguments"),
    (dict(mask_mod=square), TypeError, r"mask_mod must take 4 arguments"),
    (dict(mask_mod=not_bool), TypeError, "mask_mod must return a bool"),
    (dict(score_mod=njit(lambda s, b, h, i, j: s > 0)), TypeError,
     "score_mod must return a float score"),
    (dict(score_mod=njit(lambda s, b, h, i, j: undefined_name)), TypeError,  # noqa: F821
     "score_mod does not compile"),
    (dict(score_mod=rel_bias, mod_args=[1.0]), TypeError, "score_mod does not compile"),
    (dict(score_mod=rel_bias, mod_args=({"a": 1},)), TypeError, r"mod_args\[0\] has a type"),
    (dict(score_mod=rel_bias, mod_args=np.ones(3)), TypeError, "mod_args must be a tuple"),
    (dict(mod_args=(np.ones(3),)), ValueError, "mod_args are given without"),
    (dict(score_mod_grad=one_grad), ValueError, "score_mod_grad is given without a score_mod"),
    (dict(block_mask=np.ones((1, 1, 1, 1), np.int8)), TypeError,
     "block_mask must be a sdpa_numba.BlockMask"),
]


@pytest.mark.parametrize("kw,exc,match", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_bad_variants(kw, exc, match):
    q, k, v = _q()
    with pytest.raises(exc, match=match):
        sdpa(q, k, v, **kw)
    out, lse = np.zeros((2, 3, 5, 4), np.float32), np.zeros((2, 3, 5), np.float32)
    with pytest.raises(exc, match=match):
        sdpa_backward(out, q, k, v, out, lse, **kw)


def test_backward_of_a_score_mod_needs_its_gradient():
    q, k, v = _q()
    out, lse = np.zeros((2, 3, 5, 4), np.float32), np.zeros((2, 3, 5), np.float32)
    with pytest.raises(ValueError, match="needs score_mod_grad"):
        sdpa_backward(out, q, k, v, out, lse, score_mod=square)


def test_block_mask_must_fit_the_call():
    q, k, v = _q()
    bm = sdpa_numba.create_block_mask(causal_mask, None, None, 5, 8)
    with pytest.raises(ValueError, match=r"block_mask was made for \(B, H, L, S\) = \(1, 1, 5, "
                                         r"8\); this call needs B 1 or 2"):
        sdpa(q, k, v, block_mask=bm)
    bm = sdpa_numba.create_block_mask(causal_mask, 3, None, 5, 7)
    with pytest.raises(ValueError, match="block_mask was made for"):
        sdpa(q, k, v, block_mask=bm)
    bm = sdpa_numba.create_block_mask(causal_mask, 2, 3, 5, 7)
    with pytest.raises(ValueError, match="another mask_mod"):
        sdpa(q, k, v, block_mask=bm, mask_mod=prefix_lm, mod_args=(2,))
    # A block mask at other block sizes than the kernels read (one block of 8 x 8 here).
    other = dataclasses.replace(bm, states=bm.states[:, :, :1, :1], q_block=8, k_block=8)
    with pytest.raises(ValueError, match=r"block_mask has blocks of 8 x 8; the kernels read "
                                         r"blocks of 64 x 64"):
        sdpa(q, k, v, block_mask=other)


def test_create_block_mask_errors_and_states():
    with pytest.raises(TypeError, match="mask_mod must be a Numba"):
        sdpa_numba.create_block_mask(lambda b, h, i, j: True, 1, 1, 4, 4)
    with pytest.raises(TypeError, match="mask_mod must take 6 arguments"):
        sdpa_numba.create_block_mask(prefix_lm, 1, 1, 4, 4, mod_args=(1, 2))
    with pytest.raises(ValueError, match="L must be >= 0"):
        sdpa_numba.create_block_mask(causal_mask, 1, 1, -1, 4)
    with pytest.raises(TypeError, match="S must be an int"):
        sdpa_numba.create_block_mask(causal_mask, 1, 1, 4, 4.0)
    bm = sdpa_numba.create_block_mask(causal_mask, None, None, 130, 200)
    E, P, F = sdpa_numba.BLOCK_EMPTY, sdpa_numba.BLOCK_PARTIAL, sdpa_numba.BLOCK_FULL
    # Rows 0-63, 64-127, 128-129 against keys 0-63, 64-127, 128-191, 192-199.
    want = [[P, E, E, E], [F, P, E, E], [F, F, P, E]]
    np.testing.assert_array_equal(bm.states[0, 0], want)
    assert bm.states.dtype == np.int8 and bm.states.shape == (1, 1, 3, 4)


# --- the CPU forward against the reference --------------------------------------------------
# Few compiled specializations: windows, alignment, causality and the soft cap are run-time
# numbers of the plain recipe (the kernels every other test compiles); ALiBi with sinks, one
# score_mod, the bias table, one mask_mod and its block mask are one specialization each.

from checks import TOL, check, rel_err  # noqa: E402


@njit
def cap_alibi_mod(s, b, h, i, j, c, slopes, offset):
    """The built-in soft cap then ALiBi, written by a user."""
    s = c * math.tanh(s / c)
    return s - slopes[b, h] * abs(i + offset - j)


@njit
def doc_prefix(b, h, i, j, doc_q, doc_k, prefix):
    """Document masking and prefix-LM in one function: keys of the query's document that are
    in the prefix or not after the query."""
    return doc_q[b, i] == doc_k[b, j] and (j < prefix or j <= i)


WINDOWS = [(None, False), ((70, 3), False), ((None, 0), False), ((5, None), True),
           ((0, 0), False), ((200, 10), True), (None, True), ((64, 64), False)]
SIZES = [(150, 301), (300, 129), (37, 37), (1, 65)]


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window,causal", WINDOWS)
@pytest.mark.parametrize("L,S", SIZES)
def test_window_alignment_causal(rng, L, S, window, causal, alignment):
    """Every window x alignment x causality on odd sizes that span several blocks and two task
    chunks; GQA and batch dims; rows that see no key (bottom-right with L > S) give 0, -inf."""
    q, k, v = qkv(rng, (2, 4, L, 24), (2, 2, S, 24), ev=20, dtype=np.float32)
    out, lse = check(q, k, v, window=window, is_causal=causal, alignment=alignment,
                     enable_gqa=True)
    if alignment == "bottom_right" and (causal or (window and window[1] == 0)) and L > S:
        assert np.all(lse[..., : L - S] == -np.inf) and np.all(out[..., : L - S, :] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("softcap,scale", [(0.7, None), (30.0, None), (5.0, 10.0)])
def test_softcap(rng, dtype, softcap, scale):
    """The soft cap (float32: the vectorized tanh) alone, saturated (scale 10), with windows."""
    q, k, v = qkv(rng, (3, 77, 40), (3, 130, 40), dtype=dtype)
    check(q, k, v, softcap=softcap, scale=scale)
    check(q, k, v, softcap=softcap, scale=scale, window=(40, 2), is_causal=True,
          alignment="bottom_right")


def test_softcap_tanh_accuracy():
    """The float32 tanh of the soft cap: within 4e-7 of tanh relative, on a dense grid (the
    bound of its docstring, 2.4e-7, measured on this grid), odd, NaN in NaN out."""
    from sdpa_numba.cpu.tanh import tanh

    @njit(fastmath={"nsz", "arcp", "contract", "afn", "reassoc"}, error_model="numpy")
    def apply(x, y):
        for n in range(x.size):
            y[n] = tanh(x[n])

    x = np.concatenate([np.linspace(-50, 50, 400_001), np.geomspace(1e-30, 20, 50_001),
                        -np.geomspace(1e-30, 20, 50_001)]).astype(np.float32)
    y = np.empty_like(x)
    apply(x, y)
    ref = np.tanh(x.astype(np.float64))
    nz = ref != 0
    assert (np.abs(y[nz] - ref[nz]) / np.abs(ref[nz])).max() < 4e-7
    assert y[x == 0].max() == 0
    special = np.array([np.nan, np.inf, -np.inf], np.float32)
    ys = np.empty_like(special)
    apply(special, ys)
    assert np.isnan(ys[0]) and abs(ys[1] - 1) < 3e-7 and abs(ys[2] + 1) < 3e-7


def test_recipe_type_shortcut():
    """The launcher's cheap recipe type is ``typeof``'s, for plain recipes and others."""
    from numba import typeof

    from sdpa_numba.cpu.launch import PLAIN_RECIPE, recipe_type
    from sdpa_numba.score.recipe import recipe, with_batch_offset

    plain = [recipe(left=256, right=0), recipe(softcap=50.0), recipe(offset=7, left=3),
             with_batch_offset(recipe(right=0, softcap=2.0), 5)]
    other = [recipe(alibi=np.ones((1, 2), np.float32)), recipe(sinks=np.zeros(2, np.float32)),
             recipe(mod_args=(np.ones(3),)), recipe(left=3)._replace(left=np.int32(3)),
             recipe(softcap=1.0)._replace(softcap=np.float32(1.0))]
    for r in plain:
        assert recipe_type(r) is PLAIN_RECIPE and typeof(r) == PLAIN_RECIPE
    for r in other:
        assert recipe_type(r) == typeof(r) != PLAIN_RECIPE


@pytest.mark.parametrize("a", [0.3, 1.0, 50.0, 1e4])
def test_scaled_tanh_accuracy(a):
    """``scaled_tanh(x, a)``, the forward's soft cap with ``a`` folded into the polynomial:
    within 4e-7 of ``a · tanh(x)`` relative on a dense grid (3.1e-7 measured), odd, NaN in NaN
    out, never beyond ``a``."""
    from sdpa_numba.cpu.tanh import scaled_tanh

    @njit(fastmath={"nsz", "arcp", "contract", "afn", "reassoc"}, error_model="numpy")
    def apply(x, a, y):
        for n in range(x.size):
            y[n] = scaled_tanh(x[n], a)

    x = np.concatenate([np.linspace(-50, 50, 400_001), np.geomspace(1e-30, 20, 50_001),
                        -np.geomspace(1e-30, 20, 50_001), [np.nan, np.inf, -np.inf]])
    x = x.astype(np.float32)
    a32 = np.float32(a)
    y = np.empty_like(x)
    apply(x, a32, y)
    ref = float(a32) * np.tanh(x[:-3].astype(np.float64))
    nz = ref != 0
    assert (np.abs(y[:-3][nz] - ref[nz]) / np.abs(ref[nz])).max() < 4e-7
    assert y[x == 0].max() == 0 and np.abs(y[:-3]).max() <= a32
    assert np.isnan(y[-3]) and abs(y[-2] / a32 - 1) < 3e-7 and abs(y[-1] / a32 + 1) < 3e-7


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks_with_windows(rng, kind):
    """attn_mask (bool and float, broadcast) with a window, bottom-right causal and a soft cap:
    the order of the score (soft cap, then the mask added, then the window)."""
    q, k, v = qkv(rng, (2, 3, 90, 16), (2, 3, 140, 16), dtype=np.float32)
    mask = rng.random((3, 1, 140)) > 0.3
    if kind == "additive":
        mask = np.where(mask, rng.standard_normal((3, 1, 140)), -np.inf).astype(np.float32)
    check(q, k, v, attn_mask=mask, window=(50, 7), alignment="bottom_right", softcap=3.0)
    check(q, k, v, attn_mask=mask, window=(20, None), is_causal=True)


def test_dropout_with_window(rng):
    q, k, v = qkv(rng, (2, 2, 70, 16), (2, 2, 150, 16), dtype=np.float32)
    kw = dict(window=(30, 0), alignment="bottom_right", softcap=4.0)
    out = np.full((2, 2, 70, 16), np.nan, np.float32)
    got, lse = sdpa(q, k, v, dropout_p=0.3, seed=11, out=out, return_lse=True, **kw)
    want, want_lse = reference.attention_dropout(q, k, v, dropout_p=0.3, seed=11, **kw)
    assert rel_err(got, want) <= TOL[np.float32]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slopes_shape", ["heads", "batch"])
def test_alibi_and_sinks(rng, slopes_shape):
    """ALiBi slopes ((Hq,) or per batch entry) with sinks (one head without: -inf), windows,
    bottom-right, GQA; rows that see no key get 0 and lse = their head's sink."""
    L, S = 150, 70
    q, k, v = qkv(rng, (2, 4, L, 16), (2, 2, S, 16), dtype=np.float32)
    slopes = (rng.random(4) if slopes_shape == "heads" else rng.random((2, 4))).astype(
        np.float32)
    sinks = np.array([0.5, -np.inf, 2.0, -1.0], np.float32)
    out, lse = check(q, k, v, alibi_slopes=slopes, sinks=sinks, enable_gqa=True,
                     alignment="bottom_right", window=(20, 0))
    dark = slice(0, L - S)  # bottom-right causal: these rows see no key
    assert np.all(out[:, :, dark] == 0)
    np.testing.assert_array_equal(lse[:, :, dark], np.broadcast_to(sinks[:, None], (2, 4, L - S)))
    check(q, k, v, alibi_slopes=slopes, sinks=sinks.astype(np.float64), enable_gqa=True,
          softcap=2.0)


def test_score_mod_agrees_with_the_built_ins(rng):
    """A user's score_mod doing the soft cap and ALiBi gives the built-ins' result; b is the
    flat batch index (the slopes differ per batch entry of a 2-D batch)."""
    q, k, v = qkv(rng, (2, 3, 2, 67, 16), (2, 3, 2, 99, 16), dtype=np.float32)
    slopes = rng.random((6, 2)).astype(np.float32)
    built_in = check(q, k, v, softcap=2.5, alibi_slopes=slopes.reshape(2, 3, 2),
                     window=(30, 5), alignment="bottom_right")[0]
    mod_args = (np.float32(2.5), slopes, 99 - 67)
    user = check(q, k, v, score_mod=cap_alibi_mod, mod_args=mod_args, window=(30, 5),
                 alignment="bottom_right")[0]
    assert rel_err(user, built_in.astype(np.float64)) < 2e-6
    # mod_args are run-time values: other contents, no recompilation, other results.
    from sdpa_numba.cpu import launch

    n = len(launch._entries)
    check(q, k, v, score_mod=cap_alibi_mod, mod_args=(np.float32(1.0), 2 * slopes, 0))
    assert len(launch._entries) == n


def test_relative_position_bias_table(rng):
    q, k, v = qkv(rng, (3, 80, 8), (3, 80, 8), dtype=np.float32)
    table = rng.standard_normal((3, 2 * 80 + 1))
    check(q, k, v, score_mod=rel_bias, mod_args=(table,), is_causal=True)


def _doc_ids(rng, n_batch, n, n_docs):
    return np.sort(rng.integers(0, n_docs, (n_batch, n)), axis=1)


@pytest.mark.parametrize("case", ["documents", "prefix-lm", "empty-rows"])
def test_mask_mod(rng, case):
    """Document masking and prefix-LM through mask_mod (mod_args per batch entry)."""
    L = S = 150
    q, k, v = qkv(rng, (2, 2, L, 16), (2, 2, S, 16), dtype=np.float32)
    doc = _doc_ids(rng, 2, L, 4)
    if case == "documents":
        args = (doc, doc, 10**6)
    elif case == "prefix-lm":
        zero = np.zeros((2, L), np.int64)
        args = (zero, zero, 40)
    else:  # batch entry 0: the keys' documents are none of the queries': rows fully masked
        doc_k = doc.copy()
        doc_k[0] += 10
        args = (doc, doc_k, 10**6)
    out, lse = check(q, k, v, mask_mod=doc_prefix, mod_args=args)
    if case == "empty-rows":
        assert np.all(np.isneginf(lse[0])) and np.all(out[0] == 0)
        assert np.isfinite(lse[1]).all()


def test_block_mask_skips_blocks_with_the_same_bits(rng):
    """A block mask (per batch entry, heads broadcast) gives bitwise the mask_mod's result
    without one (an empty block adds exactly nothing, a full one needs no per-element test),
    is reused across calls, and can carry the mask_mod alone."""
    L, S = 200, 260
    doc_q, doc_k = _doc_ids(rng, 2, L, 3), _doc_ids(rng, 2, S, 3)
    args = (doc_q, doc_k, 10**6)
    bm = sdpa_numba.create_block_mask(doc_prefix, 2, None, L, S, mod_args=args)
    states = bm.states
    assert states.shape == (2, 1, 4, 5)
    assert (states == sdpa_numba.BLOCK_EMPTY).any() and (states == sdpa_numba.BLOCK_FULL).any()
    for trial in range(2):
        q, k, v = qkv(rng, (2, 3, L, 16), (2, 3, S, 16), dtype=np.float32)
        want, want_lse = sdpa(q, k, v, mask_mod=doc_prefix, mod_args=args, return_lse=True)
        out = np.full_like(want, np.nan)
        got, lse = sdpa(q, k, v, block_mask=bm, mod_args=args, out=out, return_lse=True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(lse, want_lse)
        ref, _ = reference.attention(q, k, v, mask_mod=doc_prefix, mod_args=args)
        assert rel_err(got, ref) <= TOL[np.float32]


def _expected_states(keep, win, bq, bk):
    """Block states of a bool (B, L, S) array of the kept scores (in-window and mask_mod)
    and a (L, S) array ``win`` of the in-window ones, by brute force."""
    n_b, L, S = keep.shape
    out = np.empty((n_b, 1, -(-L // bq), -(-S // bk)), np.int8)
    for b in range(n_b):
        for qb in range(out.shape[2]):
            for kb in range(out.shape[3]):
                blk = keep[b, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
                w = win[qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
                out[b, 0, qb, kb] = (sdpa_numba.BLOCK_EMPTY if not blk.any() else
                                     sdpa_numba.BLOCK_FULL if blk.sum() == w.sum() else
                                     sdpa_numba.BLOCK_PARTIAL)
    return out


def test_block_mask_built_per_call_states():
    """A call with a mask_mod and no block mask builds one: under the call's window (a block
    the window leaves nothing of is empty), per batch entry since doc_prefix reads ``b``, once
    for all heads since it does not read ``h``; small problems get every block partial."""
    from sdpa_numba.problem import block_mask as bmod
    from sdpa_numba.problem.variants import variants_recipe
    from sdpa_numba.problem.block_mask import with_block_mask

    assert (bmod._reads(doc_prefix.py_func, 0), bmod._reads(doc_prefix.py_func, 1)) == (True,
                                                                                      False)
    assert not bmod._reads(causal_mask.py_func, 0) and not bmod._reads(causal_mask.py_func, 1)
    assert bmod._reads(lambda *a: a[2] < a[3], 0)  # b not named: may be read
    rng = np.random.default_rng(3)
    L, S, left, offset = 300, 420, 150, 120
    doc_q, doc_k = _doc_ids(rng, 2, L, 3), _doc_ids(rng, 2, S, 3)
    args = (doc_q, doc_k, 50)
    r = with_block_mask(variants_recipe((2,), 4, L, S, np.float32, True, window=(left, None),
                                        alignment="bottom_right", mask_mod=doc_prefix,
                                        mod_args=args), (2,), 4, L, S)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    win = (j >= i + offset - left) & (j <= i + offset)
    keep = np.array([[[doc_prefix.py_func(b, 0, ii, jj, *args) for jj in range(S)]
                      for ii in range(L)] for b in range(2)]) & win
    want = _expected_states(keep, win, bmod.Q_BLOCK, bmod.K_BLOCK)
    assert r.block_mask.shape == (2, 1, 5, 7)
    np.testing.assert_array_equal(r.block_mask, want)
    assert {0, 1, 2} <= set(np.unique(want))
    # below the threshold: every block partial, one (b, h) for all (no mask_mod evaluated)
    r = with_block_mask(variants_recipe((1,), 1, 100, 100, np.float32, False,
                                        mask_mod=doc_prefix, mod_args=args), (1,), 1, 100, 100)
    assert 100 * 100 < bmod.BUILD_MIN_SCORES
    np.testing.assert_array_equal(r.block_mask, np.full((1, 1, 2, 2), sdpa_numba.BLOCK_PARTIAL))


@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_built_per_call_gives_the_same_bits(rng, monkeypatch, causal):
    """Built per call or not (every block partial), forward and backward give the same bits:
    an empty block adds exactly nothing, a full one needs no per-element test."""
    from sdpa_numba.problem import block_mask as bmod

    L, S = 200, 330
    doc_q, doc_k = _doc_ids(rng, 2, L, 3), _doc_ids(rng, 2, S, 3)
    args = (doc_q, doc_k, 40)
    q, k, v = qkv(rng, (2, 3, L, 16), (2, 3, S, 16), dtype=np.float32)
    g = rng.standard_normal((2, 3, L, 16)).astype(np.float32)
    kw = dict(mask_mod=doc_prefix, mod_args=args, is_causal=causal, window=(90, None),
              alignment="bottom_right")
    results = []
    for threshold in (0, math.inf):
        monkeypatch.setattr(bmod, "BUILD_MIN_SCORES", threshold)
        out, lse = sdpa(q, k, v, return_lse=True, **kw)
        results.append((out, lse, *sdpa_backward(g, q, k, v, out, lse, **kw)))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    ref, _ = reference.attention(q, k, v, **kw)
    assert rel_err(results[0][0], ref) <= TOL[np.float32]
