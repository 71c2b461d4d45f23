"""The CPU backward's variants (issue 15) against a float64 reference written from the formulas.

Kernel level: the backward (through the launcher's compiled entries, :func:`_entry`, so that
the specializations are the public path's, cached on disk) gets a recipe built with
:func:`sdpa_numba.score.recipe.recipe`, and the forward's ``out`` and ``lse`` come from the
reference below (rounded to the storage / compute dtype). The reference itself is checked
against finite differences.

Compile cost: plain recipes (window, alignment, causal, soft cap) share the dense backward's
specializations (float64 bool / additive mask, float32 bool); new ones: one recipe type with
ALiBi, a score_mod (relative-position bias), mask_mod (document mask), mod_args and a block
mask; one with a score_mod equal to the soft cap.
"""

import math

import numpy as np
import pytest
from numba import njit, typeof

from sdpa_numba.block_mask import K_BLOCK as MASK_BK, Q_BLOCK as MASK_BQ
from sdpa_numba.cpu.launch_backward import _entry
from sdpa_numba.problem.variant_table import sinks_grad
from sdpa_numba.dropout import NO_DROPOUT, keep_mask, params
from sdpa_numba.score import recipe as R

TOL = {np.float64: 1e-12, np.float32: 2e-5}


# --- the user's functions ---------------------------------------------------------------------

@njit
def rel_bias(s, b, h, i, j, table, qdoc, kdoc):
    """T5-style relative-position bias: a learned table indexed by head and clipped distance."""
    d = min(max(i - j, -(table.shape[1] // 2)), table.shape[1] // 2)
    return s + table[h, d + table.shape[1] // 2]


@njit
def rel_bias_grad(s, b, h, i, j, table, qdoc, kdoc):
    return 1.0


@njit
def same_doc(b, h, i, j, table, qdoc, kdoc):
    """Document masking: a query sees the keys of its own document only."""
    return qdoc[b, i] == kdoc[b, j]


@njit
def cap_mod(s, b, h, i, j, c):
    """The soft cap as a score_mod."""
    return c * math.tanh(s / c)


@njit
def cap_mod_grad(s, b, h, i, j, c):
    t = math.tanh(s / c)
    return 1.0 - t * t


# --- the reference ----------------------------------------------------------------------------

def reference(q, k, v, g, scale, rec, mask=None, sinks=None, keep=None, p_drop=0.0):
    """Forward and backward in float64 for (B, Hq, L, E) queries and (B, H, S, E) keys:
    ``(out, lse, dq, dk, dv, dmask, dsinks)``; ``keep`` the dropout's keep mask."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    B, Hq, L, _ = q.shape
    H, S = k.shape[1], k.shape[2]
    grp = Hq // H
    kk, vv = np.repeat(k, grp, axis=1), np.repeat(v, grp, axis=1)
    s = scale * q @ kk.swapaxes(-1, -2)
    slope = np.ones_like(s)
    if rec.softcap > 0:
        t = np.tanh(s / rec.softcap)
        s, slope = rec.softcap * t, 1 - t * t
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    ii = i + rec.offset
    if rec.alibi is not None:
        s = s - rec.alibi[:, :, None, None] * np.abs(ii - j)
    if rec.score_mod is not None:
        s = s.copy()
        for idx in np.ndindex(s.shape):
            b, h, r, c = idx
            slope[idx] *= rec.score_mod_grad.py_func(s[idx], b, h, r, c, *rec.mod_args)
            s[idx] = rec.score_mod.py_func(s[idx], b, h, r, c, *rec.mod_args)
    keep_s = np.broadcast_to((ii - rec.left <= j) & (j <= ii + rec.right), s.shape).copy()
    if mask is not None and mask.dtype == np.bool_:
        keep_s &= mask
    elif mask is not None:
        s = s + mask
    if rec.mask_mod is not None:
        for idx in np.ndindex(s.shape):
            b, h, r, c = idx
            keep_s[idx] &= rec.mask_mod.py_func(b, h, r, c, *rec.mod_args)
    s = np.where(keep_s, s, -np.inf)
    sink = (np.full(Hq, -np.inf) if sinks is None else np.asarray(sinks, np.float64))
    sink = np.broadcast_to(sink[None, :, None], (B, Hq, L))
    m = np.maximum(s.max(axis=-1, initial=-np.inf), sink)
    mu = np.where(np.isfinite(m), m, 0.0)
    total = np.exp(s - mu[..., None]).sum(-1) + np.exp(sink - mu)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + mu, -np.inf)
    lf = np.where(np.isfinite(lse), lse, 0.0)[..., None]
    p = np.where(keep_s, np.exp(s - lf), 0.0)
    z = np.ones_like(p) if keep is None else keep / (1 - p_drop)
    out = (p * z) @ vv
    dv = ((p * z).swapaxes(-1, -2) @ g).reshape(B, H, grp, S, -1).sum(2)
    dp = g @ vv.swapaxes(-1, -2)
    dd = (g * out).sum(-1)
    ds = p * (dp * z - dd[..., None])
    dss = ds * slope
    dq = scale * dss @ kk
    dk = (scale * dss.swapaxes(-1, -2) @ q).reshape(B, H, grp, S, -1).sum(2)
    dsinks = -(np.exp(sink - lf[..., 0]) * dd).sum(axis=(0, 2))
    return out, lse, dq, dk, dv, ds, dsinks


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (nb if nb > 0 else 1.0)


def run(q, k, v, g, scale, rec, mask=None, is_causal=False, dropout=None, want_dmask=False,
        sinks=None, want=None):
    """The backward kernel on NaN-poisoned gradients; returns (dq, dk, dv, dmask, reference)
    (``want``: the reference's results, if already known)."""
    dt = q.dtype
    ct = np.float64 if dt == np.float64 else np.float32
    B, Hq, L, _ = q.shape
    keep, p_drop = None, 0.0
    if dropout is not None:
        p_drop, seed = dropout
        keep = keep_mask(seed, p_drop, (B,), Hq, L, k.shape[2])
    rec_ref = rec._replace(right=min(rec.right, 0)) if is_causal else rec
    if want is None:
        want = reference(q, k, v, g, scale, rec_ref, mask, sinks, keep, p_drop)
    out, lse = want[0].astype(dt), want[1].astype(ct)
    kind = "bool" if mask is None or mask.dtype == np.bool_ else "additive"
    entry = _entry(np.dtype(dt), kind, typeof(rec))
    dq = np.full(q.shape, np.nan, ct)
    dk = np.full(k.shape, np.nan, ct)
    dv = np.full(v.shape, np.nan, ct)
    dm = np.full((B, Hq, L, k.shape[2]), np.nan, ct) if want_dmask else None
    m = None if mask is None else np.ascontiguousarray(np.broadcast_to(mask,
                                                                           (B, Hq, L, k.shape[2])))
    drop = NO_DROPOUT if dropout is None else params(p_drop, dropout[1])
    entry(q, k, v, m, is_causal, scale, g, out, lse, dq, dk, dv, drop, dm, rec)
    return dq, dk, dv, dm, want


def inputs(rng, B, Hq, H, L, S, E, Ev, dt=np.float64):
    return (rng.standard_normal((B, Hq, L, E)).astype(dt),
            rng.standard_normal((B, H, S, E)).astype(dt),
            rng.standard_normal((B, H, S, Ev)).astype(dt),
            rng.standard_normal((B, Hq, L, Ev)).astype(dt))


def assert_close(got, want, dt=np.float64, what=""):
    for name, a, b in zip(("dq", "dk", "dv"), got, want[2:5]):
        assert np.isfinite(a).all(), f"{what} {name}: unwritten or non-finite elements"
        assert rel(a, b) <= TOL[dt], f"{what} {name}: {rel(a, b):.3g}"


# --- the reference against finite differences -------------------------------------------------

def test_reference_against_finite_differences():
    """The reference's gradients (soft cap, ALiBi, a score_mod with its derivative, window,
    sinks) against central differences of its forward: the loss sum(g * out)."""
    rng = np.random.default_rng(0)
    q, k, v, g = inputs(rng, 1, 2, 1, 4, 5, 3, 2)
    table = rng.standard_normal((2, 7))
    doc = np.zeros((1, 5), np.int64)
    rec = R.recipe(offset=1, left=2, right=1, softcap=1.5, alibi=np.array([[0.3, 0.7]]),
                   score_mod=rel_bias, score_mod_grad=rel_bias_grad,
                   mod_args=(table, doc, doc))
    sinks = np.array([0.2, -0.4])

    def loss(q, k, v, sinks):
        return (g * reference(q, k, v, g, 0.6, rec, sinks=sinks)[0]).sum()

    _, _, dq, dk, dv, _, dsinks = reference(q, k, v, g, 0.6, rec, sinks=sinks)
    for x, dx in ((q, dq), (k, dk), (v, dv), (sinks, dsinks)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            h = 1e-6
            x[idx] += h
            up = loss(q, k, v, sinks)
            x[idx] -= 2 * h
            down = loss(q, k, v, sinks)
            x[idx] += h
            num[idx] = (up - down) / (2 * h)
        assert rel(dx, num) < 1e-7


# --- the work lists -----------------------------------------------------------------------------

def test_query_range_inverts_key_range():
    """query_range gives exactly the rows that see some key of a range (brute force)."""

    @njit
    def both(r, j0, j1, L, S):
        return R.query_range(r, j0, j1, L), R.key_range(r, j0, j1, S)

    L, S = 23, 31
    for r in (R.DENSE, R.CAUSAL, R.recipe(offset=S - L, left=4, right=0),
              R.recipe(offset=-5, left=0, right=3), R.recipe(offset=40, right=0),
              R.recipe(left=2, right=2)):
        for j0 in range(0, S, 3):
            for j1 in range(j0, S, 5):
                (ib, ie), _ = both(r, j0, j1, L, S)
                rows = [i for i in range(L)
                        if any(i + r.offset - r.left <= j <= i + r.offset + r.right
                               for j in range(j0, j1 + 1))]
                assert (ib, ie) == ((rows[0], rows[-1] + 1) if rows else (0, 0)), (r, j0, j1)


# --- windows, alignment, causal, GQA, masks, dropout (plain recipes: the dense specializations) -

WINDOWS = {
    # name: (B, Hq, H, L, S, recipe keywords, is_causal)
    "window-top-left": (2, 2, 2, 67, 150, dict(left=20, right=5), False),
    "window-bottom-right-gqa": (1, 4, 2, 70, 203, dict(offset=203 - 70, left=33, right=0),
                                False),
    "causal-flag-bottom-right": (1, 2, 1, 130, 77, dict(offset=77 - 130, left=9), True),
    "left-only": (1, 3, 3, 65, 65, dict(left=0), False),
    "right-only-L-gt-S": (1, 2, 2, 200, 129, dict(right=3), False),
    "rows-past-the-keys": (1, 2, 2, 90, 40, dict(offset=30, left=2, right=2), False),
    "softcap-window": (1, 2, 1, 97, 260, dict(softcap=2.0, left=100, right=50), False),
    "softcap-causal": (2, 2, 2, 129, 129, dict(softcap=0.7), True),
}


@pytest.mark.parametrize("name", list(WINDOWS))
def test_plain_recipes(name):
    B, Hq, H, L, S, kw, causal = WINDOWS[name]
    rng = np.random.default_rng(len(name))
    q, k, v, g = inputs(rng, B, Hq, H, L, S, 16, 7)
    rec = R.recipe(**kw)
    dq, dk, dv, _, want = run(q, k, v, g, 0.4, rec, is_causal=causal)
    assert_close((dq, dk, dv), want, what=name)


def test_window_with_bool_mask_dropout_and_float32():
    rng = np.random.default_rng(3)
    q, k, v, g = inputs(rng, 2, 4, 2, 77, 140, 8, 5)
    mask = rng.random((77, 140)) > 0.3
    rec = R.recipe(offset=140 - 77, left=40, right=0)
    dq, dk, dv, _, want = run(q, k, v, g, 0.5, rec, mask=mask, dropout=(0.25, 99))
    assert_close((dq, dk, dv), want, what="float64")
    q, k, v, g = (x.astype(np.float32) for x in (q, k, v, g))
    got = run(q, k, v, g, 0.5, rec._replace(softcap=np.float64(3.0)), mask=mask)
    assert_close(got[:3], got[4], np.float32, what="float32")


def test_softcap_alone_float32_with_dropout_and_causal():
    """The soft cap with nothing else that changes scores takes the backward's lane-wise tile
    pass (float32 tanh, the slope into its own tile): with dropout, causal tiles both on and
    off the diagonal, and odd sizes (query and key padding)."""
    rng = np.random.default_rng(5)
    q, k, v, g = (x.astype(np.float32) for x in inputs(rng, 1, 2, 1, 75, 301, 16, 9))
    rec = R.recipe(offset=301 - 75, softcap=4.0)
    for dropout in (None, (0.2, 7)):
        got = run(q, k, v, g, 0.6, rec, is_causal=True, dropout=dropout)
        assert_close(got[:3], got[4], np.float32, what=f"dropout {dropout}")


def test_additive_mask_grad_with_softcap_and_window():
    """dmask is the gradient of the final scores (after the soft cap), not of the capped ones'
    inputs; -inf in the mask and a fully masked row."""
    rng = np.random.default_rng(4)
    q, k, v, g = inputs(rng, 1, 2, 2, 33, 150, 8, 8)
    mask = rng.standard_normal((33, 150))
    mask[5] = -np.inf
    mask[:, 7] = -np.inf
    rec = R.recipe(softcap=1.3, left=60, right=60)
    dq, dk, dv, dm, want = run(q, k, v, g, 0.8, rec, mask=mask, want_dmask=True)
    assert_close((dq, dk, dv), want)
    assert rel(dm, want[5]) <= 1e-12
    assert (dq[:, :, 5] == 0).all()


def test_long_keys_in_chunks_and_groups():
    """More keys than a task holds at once (CHUNK_BLOCKS): query blocks whose first chunk is
    not the task's first; and few heads (key groups, summed dQ partials)."""
    rng = np.random.default_rng(5)
    q, k, v, g = inputs(rng, 1, 16, 16, 70, 4300, 4, 3)  # 16 heads: one group, chunks
    rec = R.recipe(offset=4300 - 70, left=150, right=0)
    assert_close(run(q, k, v, g, 0.5, rec)[:3], run(q, k, v, g, 0.5, rec)[4], what="chunks")
    q, k, v, g = inputs(rng, 1, 2, 1, 150, 1500, 4, 3)  # 1 head: key groups
    for rec in (R.recipe(left=300, right=10), R.recipe(offset=1500 - 150, left=500, right=0)):
        got = run(q, k, v, g, 0.5, rec)
        assert_close(got[:3], got[4], what="groups")


def test_sinks_through_lse():
    """Sinks change only lse (the kernel's P = exp(s - lse)); rows with every key masked keep
    lse = sink and get zero gradients. The sinks' own gradient is the launcher's."""
    rng = np.random.default_rng(6)
    q, k, v, g = inputs(rng, 1, 2, 2, 40, 70, 8, 8)
    sinks = np.array([0.5, 2.0])
    rec = R.recipe(offset=-20, left=5, right=0)  # rows 0..19 see no key
    dq, dk, dv, _, want = run(q, k, v, g, 0.5, rec, sinks=sinks)
    assert_close((dq, dk, dv), want)
    assert (dq[:, :, :20] == 0).all() and np.isfinite(want[1]).all()
    dsinks = sinks_grad(rec._replace(sinks=sinks), g, want[0], want[1])
    assert dsinks.shape == (2,) and rel(dsinks, want[6]) <= 1e-13


# --- ALiBi, score_mod, mask_mod, block mask (new specializations) ------------------------------

def block_mask_of(mask_mod, B, Hq, L, S, mod_args):
    """The block states of ``mask_mod`` at the forward's granularity (plain Python)."""
    nq, nk = -(-L // MASK_BQ), -(-S // MASK_BK)
    bm = np.empty((B, Hq, nq, nk), np.int8)
    for b, h, qb, kb in np.ndindex(bm.shape):
        vals = {mask_mod.py_func(b, h, i, j, *mod_args)
                for i in range(qb * MASK_BQ, min(L, (qb + 1) * MASK_BQ))
                for j in range(kb * MASK_BK, min(S, (kb + 1) * MASK_BK))}
        bm[b, h, qb, kb] = (R.BLOCK_FULL if vals == {True} else
                            R.BLOCK_EMPTY if vals == {False} else R.BLOCK_PARTIAL)
    return bm


def test_alibi_score_mod_mask_mod_block_mask():
    """Document masking through mask_mod with a block mask of all three states, ALiBi
    (bottom-right, per batch), a relative-position bias table through mod_args, GQA, window;
    the same with every block PARTIAL (every element tested) agrees, and so does a launch over
    the second batch entry alone (batch offset)."""
    rng = np.random.default_rng(7)
    B, Hq, H, L, S = 2, 4, 2, 150, 330
    q, k, v, g = inputs(rng, B, Hq, H, L, S, 8, 6)
    kdoc = np.zeros((B, S), np.int64)  # documents: runs of keys
    kdoc[:, 100:] = 1
    kdoc[:, 260:] = 2
    kdoc[1, 200:] = 3
    qdoc = np.ascontiguousarray(kdoc[:, S - L:])  # queries: the last L positions
    mod_args = (rng.standard_normal((Hq, 9)), qdoc, kdoc)
    bm = block_mask_of(same_doc, B, Hq, L, S, mod_args)
    assert {R.BLOCK_EMPTY, R.BLOCK_PARTIAL, R.BLOCK_FULL} <= set(np.unique(bm))
    rec = R.recipe(offset=S - L, left=200, right=0, alibi=rng.random((B, Hq)),
                   score_mod=rel_bias, score_mod_grad=rel_bias_grad, mask_mod=same_doc,
                   mod_args=mod_args, block_mask=bm)
    got = run(q, k, v, g, 0.35, rec)
    assert_close(got[:3], got[4], what="block mask")
    partial = np.full_like(bm, R.BLOCK_PARTIAL)
    again = run(q, k, v, g, 0.35, rec._replace(block_mask=partial))
    for a, b in zip(got[:3], again[:3]):
        assert rel(a, b) <= 1e-14
    half = run(q[1:], k[1:], v[1:], g[1:], 0.35, R.with_batch_offset(rec, 1),
               want=[x[1:] for x in got[4]])
    for a, b in zip(half[:3], got[:3]):
        assert rel(a, b[1:]) <= 1e-14


def test_score_mod_softcap_agrees_with_builtin():
    rng = np.random.default_rng(8)
    q, k, v, g = inputs(rng, 1, 2, 1, 70, 133, 16, 16)
    builtin = run(q, k, v, g, 0.9, R.recipe(softcap=1.7, left=50, right=10))
    mod = run(q, k, v, g, 0.9, R.recipe(left=50, right=10, score_mod=cap_mod,
                                          score_mod_grad=cap_mod_grad, mod_args=(1.7,)))
    assert_close(mod[:3], mod[4], what="score_mod")
    for a, b in zip(builtin[:3], mod[:3]):
        assert rel(a, b) <= 1e-13




# --- the public backward (sdpa_numba.scaled_dot_product_attention_backward) -------------------

def _public_case(name):
    rng = np.random.default_rng(sum(map(ord, name)))

    def r(*shape):
        return rng.standard_normal(shape)

    if name == "window-gqa-bool-mask":
        return (r(2, 4, 67, 16), r(2, 2, 150, 16), r(2, 2, 150, 8),
                dict(attn_mask=rng.random((67, 150)) > 0.2, window=(20, 5), enable_gqa=True))
    if name == "bottom-right-causal-softcap-L-gt-S":
        return (r(1, 2, 130, 8), r(1, 2, 77, 8), r(1, 2, 77, 8),
                dict(is_causal=True, alignment="bottom_right", softcap=2.0, window=(9, None)))
    if name == "alibi-sinks-batch-dims":
        return (r(2, 3, 2, 40, 8), r(2, 3, 2, 70, 8), r(2, 3, 2, 70, 4),
                dict(alibi_slopes=rng.random((2, 3, 2)), sinks=np.array([0.3, -1.0]),
                     window=(None, 0), alignment="bottom_right"))
    if name == "additive-mask-grad-softcap":
        mask = r(1, 33, 150)
        mask[:, 4] = -np.inf
        return (r(2, 2, 33, 8), r(2, 2, 150, 8), r(2, 2, 150, 8),
                dict(attn_mask=mask, mask_grad=True, softcap=1.3, window=(60, 60)))
    if name == "dropout-window":
        return (r(1, 2, 70, 8), r(1, 2, 140, 8), r(1, 2, 140, 8),
                dict(dropout_p=0.3, seed=11, window=(30, 30)))
    if name == "score_mod-softcap":
        return (r(1, 2, 70, 16), r(1, 1, 133, 16), r(1, 1, 133, 16),
                dict(enable_gqa=True, window=(50, 10), score_mod=cap_mod,
                     score_mod_grad=cap_mod_grad, mod_args=(1.7,)))
    raise KeyError(name)


PUBLIC = ["window-gqa-bool-mask", "bottom-right-causal-softcap-L-gt-S",
          "alibi-sinks-batch-dims", "additive-mask-grad-softcap", "dropout-window",
          "score_mod-softcap"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_backward(name):
    """The public backward with variants (out and lse from the reference) against
    reference.attention_backward: dq, dk, dv, the mask's and the sinks' gradients."""
    from sdpa_numba import reference
    from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward

    q, k, v, kw = _public_case(name)
    kw = dict(kw)
    mask = kw.pop("attn_mask", None)
    mask_grad = kw.pop("mask_grad", False)
    p, seed = kw.pop("dropout_p", 0.0), kw.pop("seed", 0)
    fwd_kw = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    out, lse = reference.attention_dropout(q, k, v, mask, p, seed=seed, **fwd_kw)
    g = np.random.default_rng(1).standard_normal(out.shape)
    got = sdpa_backward(g, q, k, v, out, lse, mask, p, seed=seed if p else None,
                        mask_grad=mask_grad, **kw)
    want = reference.attention_backward(g, q, k, v, mask, p, seed=seed, **kw)
    expect = list(want[:3]) + ([want[3]] if mask_grad else []) + (
        [want[4]] if "sinks" in kw else [])
    assert len(got) == len(expect)
    for a, b in zip(got, expect):
        assert a.shape == b.shape and np.isfinite(a).all()
        assert rel(a, b) <= 1e-12, (name, rel(a, b))


def test_public_backward_needs_score_mod_grad():
    from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward

    x = np.zeros((1, 1, 3, 4))
    with pytest.raises(ValueError, match="score_mod_grad"):
        sdpa_backward(x, x, x, x, x, np.zeros((1, 1, 3)), score_mod=cap_mod, mod_args=(1.0,))


def test_score_and_slope_is_modified_score_and_score_slope():
    """The backward's fused per-element function gives bitwise what the two it fuses give."""

    @njit
    def grid(r):
        a = np.empty((3, 7, 9))
        for i in range(7):
            for j in range(9):
                s = 0.61 * (i - 1.5 * j) + 0.2
                a[0, i, j], a[1, i, j] = R.score_and_slope(r, s, 1, 0, i, j)
                a[2, i, j] = R.modified_score(r, s, 1, 0, i, j) - a[0, i, j] + \
                    R.score_slope(r, s, 1, 0, i, j) - a[1, i, j]
        return a

    r = R.recipe(softcap=2.5, alibi=np.array([[0.1], [0.4]]), score_mod=cap_mod,
                 score_mod_grad=cap_mod_grad, mod_args=(3.0,), offset=2)
    a = grid(r)
    assert np.isfinite(a).all() and (a[2] == 0).all()
