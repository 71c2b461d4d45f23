"""The score recipe's variants on the CUDA kernels (simulator), forward and backward.

Kernel level, against a float64 reference written here in torch (autograd gives the
reference gradients, the sinks' included): recipes are built with
:func:`sdpa_numba.score.recipe.recipe` and passed to :func:`sdpa_numba.gpu.forward` /
:func:`sdpa_numba.gpu.backward.backward`, with a block mask at block sizes unlike the kernels'
tiles. Public level, against :mod:`sdpa_numba.reference`: the keywords through the plan and the
launchers (batch offsets of split launches, GQA, the sinks' gradient). Sizes are tiny and odd
(the simulator is slow); conftest's 4 x 4 blocks make them span several query and key blocks.
User score_mod/mask_mod are the same ``@njit`` functions a CPU caller writes.
"""

import math

import numpy as np
import pytest
from numba import cuda, njit

import sdpa_numba
from sdpa_numba import reference
from sdpa_numba.gpu.arrays import device_array
from sdpa_numba.gpu.backward import backward
from sdpa_numba.gpu.forward import forward
from sdpa_numba.problem import plan
from sdpa_numba.problem.variant_table import sinks_grad
from sdpa_numba.score.recipe import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, NO_LIMIT, recipe
from sdpa_cuda_testing import dev, permuted, rel_err

torch = pytest.importorskip("torch")

B, HQ, H, L, S, E, EV = 2, 2, 1, 7, 9, 5, 3  # GQA: two query heads read one key/value head


# --- user functions (plain @njit, as a CPU caller writes them) ---------------------------

@njit
def user_softcap(s, b, h, i, j, cap):
    return cap * math.tanh(s / cap)


@njit
def user_softcap_grad(s, b, h, i, j, cap):
    t = math.tanh(s / cap)
    return 1.0 - t * t


@njit
def rel_bias(s, b, h, i, j, table):
    """A relative-position bias table (heads x 2 S - 1), as T5's."""
    return s + table[h, j - i + table.shape[1] // 2]


@njit
def rel_bias_grad(s, b, h, i, j, table):
    return 1.0


@njit
def same_document(b, h, i, j, doc):
    """Document masking: a query sees the keys of its own document (ids per flat batch)."""
    return doc[b, i] == doc[b, j]


@njit
def prefix_lm(b, h, i, j, prefix):
    """Prefix-LM: keys of the prefix are seen by every query, the rest causally."""
    return j < prefix[b] or j <= i


# --- the reference -------------------------------------------------------------------------

def torch_reference(q, k, v, mask, *, scale, offset=0, left=None, right=None, softcap=0.0,
              alibi=None, sinks=None, score_mod=None, mask_mod=None, mod_args=()):
    """Float64 attention with every variant, written plainly from the formulas (torch
    tensors, differentiable in q, k, v, the additive mask and sinks). ``score_mod`` and
    ``mask_mod`` are torch-side callables ``(s, b, h, i, j)`` on index grids."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, 1)
    vv = v.repeat_interleave(group, 1)
    s = scale * q @ kk.transpose(-1, -2)
    Lq, Sk = s.shape[-2:]
    b = torch.arange(s.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(s.shape[1]).view(1, -1, 1, 1)
    i = torch.arange(Lq).view(1, 1, -1, 1)
    j = torch.arange(Sk).view(1, 1, 1, -1)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        slopes = torch.as_tensor(alibi, dtype=torch.float64).reshape(-1, s.shape[1])
        s = s - slopes[:, :, None, None] * (i + offset - j).abs()
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    keep = torch.ones(s.shape, dtype=torch.bool)
    if left is not None:
        keep &= j >= i + offset - left
    if right is not None:
        keep &= j <= i + offset + right
    if mask is not None and mask.dtype == torch.bool:
        keep &= mask
    if mask_mod is not None:
        keep &= mask_mod(b, h, i, j)
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    # Rows without any key (and no sink): out 0, lse -inf; against 0 instead, so that their
    # gradients are 0 rather than NaN.
    dead = (s == -math.inf).all(-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(dead, 0.0), -1)
    p = torch.exp(s - lse[..., None])
    lse = lse.masked_fill(dead[..., 0], -math.inf)
    if sinks is not None:
        p = p[..., :-1]
    return p @ vv, lse


def inputs(rng, dtype=np.float32, mask_kind="none"):
    q = rng.standard_normal((B, HQ, L, E)).astype(dtype)
    k = rng.standard_normal((B, H, S, E)).astype(dtype)
    v = rng.standard_normal((B, H, S, EV)).astype(dtype)
    mask = None
    if mask_kind == "additive":
        mask = rng.standard_normal((B, HQ, L, S)).astype(dtype)
    elif mask_kind == "bool":
        mask = rng.random((B, HQ, L, S)) < 0.8
        mask[0, 1, 3] = False  # a fully masked row
    return q, k, v, mask


def t64(x, grad=False):
    return None if x is None else torch.tensor(np.asarray(x, np.float64) if x.dtype != bool
                                               else x, requires_grad=grad)


def block_states(keep, bq, bk):
    """A block mask (B, HQ, q blocks, k blocks) of int8 states from a boolean (B, HQ, L, S)
    grid, at ``bq`` rows by ``bk`` keys per block."""
    nqb, nkb = -(-keep.shape[2] // bq), -(-keep.shape[3] // bk)
    out = np.empty(keep.shape[:2] + (nqb, nkb), np.int8)
    for qb in range(nqb):
        for kb in range(nkb):
            blk = keep[:, :, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
            out[:, :, qb, kb] = np.where(blk.all((2, 3)), BLOCK_FULL,
                                         np.where(blk.any((2, 3)), BLOCK_PARTIAL, BLOCK_EMPTY))
    return out


# --- the cases -----------------------------------------------------------------------------
# name: (recipe keywords for the kernels, reference keywords, is_causal, mask kind)

DOC = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2]], np.int64)
PREFIX = np.array([3, 5], np.int64)
TABLE = np.random.default_rng(7).standard_normal((HQ, 2 * S - 1)).astype(np.float32)
SLOPES = np.array([0.5, 0.25], np.float32)
SLOPES_B = np.array([[0.5, 0.25], [0.125, 1.0]], np.float32)
SINKS = np.array([0.3, -1.2], np.float32)
BR = S - L  # bottom-right offset


DOC_KEEP = np.array([[[[DOC[b, i] == DOC[b, j] for j in range(S)] for i in range(L)]]
                     for b in range(B)])
PREFIX_KEEP = np.array([[[[j < PREFIX[b] or j <= i for j in range(S)] for i in range(L)]]
                        for b in range(B)])


def _doc_keep(b, h, i, j):
    return torch.as_tensor(DOC_KEEP)


def _prefix_keep(b, h, i, j):
    return torch.as_tensor(PREFIX_KEEP)


def _table_mod(s, b, h, i, j):
    t = torch.as_tensor(TABLE, dtype=torch.float64)
    return s + t[h, j - i + t.shape[1] // 2]


CASES = {
    "window": (dict(left=2, right=1), dict(left=2, right=1), False, "none"),
    "window_left_only_bottom_right": (dict(offset=BR, left=3), dict(offset=BR, left=3), False,
                                      "none"),
    "causal_bottom_right": (dict(offset=BR), dict(offset=BR, right=0), True, "none"),
    "window_causal_bool_mask": (dict(left=1), dict(left=1, right=0), True, "bool"),
    "softcap": (dict(softcap=1.5), dict(softcap=1.5), False, "none"),
    "softcap_window_additive": (dict(softcap=1.5, left=3, right=2, offset=BR),
                                dict(softcap=1.5, left=3, right=2, offset=BR), False,
                                "additive"),
    "alibi": (dict(alibi=SLOPES[None]), dict(alibi=SLOPES), False, "none"),
    "alibi_per_batch_bottom_right": (dict(alibi=SLOPES_B, offset=BR),
                                     dict(alibi=SLOPES_B, offset=BR), False, "none"),
    "sinks": (dict(sinks=SINKS), dict(sinks=True), False, "none"),
    "sinks_masked_rows": (dict(sinks=SINKS, left=0, right=0, offset=-3),
                          dict(sinks=True, left=0, right=0, offset=-3), False, "bool"),
    "score_mod_softcap": (dict(score_mod=user_softcap, score_mod_grad=user_softcap_grad,
                               mod_args=(1.5,)), dict(softcap=1.5), False, "none"),
    "score_mod_table": (dict(score_mod=rel_bias, score_mod_grad=rel_bias_grad,
                             mod_args=(TABLE,)), dict(score_mod=_table_mod), False, "none"),
    "mask_mod_documents": (dict(mask_mod=same_document, mod_args=(DOC,)),
                           dict(mask_mod=_doc_keep), False, "none"),
    "mask_mod_prefix_lm_block_mask": (dict(mask_mod=prefix_lm, mod_args=(PREFIX,),
                                           block_mask="prefix"),
                                      dict(mask_mod=_prefix_keep), False, "additive"),
    "everything": (dict(left=4, offset=BR, softcap=2.0, alibi=SLOPES[None], sinks=SINKS,
                        mask_mod=same_document, mod_args=(DOC,), block_mask="doc"),
                   dict(left=4, right=0, offset=BR, softcap=2.0, alibi=SLOPES, sinks=True,
                        mask_mod=_doc_keep), True, "additive"),
}

#: The block mask's block size in the tests: not the kernels' 4 x 4 tiles, so that a tile
#: overlaps several block-mask blocks.
BLOCK_SIZES = (3, 5)


def kernel_recipe(kw):
    kw = dict(kw)
    bm = kw.pop("block_mask", None)
    if kw.get("left") is None:
        kw["left"] = NO_LIMIT
    if bm is not None:
        kw["block_mask"] = block_states({"prefix": PREFIX_KEEP, "doc": DOC_KEEP}[bm],
                                        *BLOCK_SIZES)
    return recipe(**kw)


def run_case(name, rng, dtype=np.float32):
    rkw, refkw, is_causal, mask_kind = CASES[name]
    q, k, v, mask = inputs(rng, dtype, mask_kind)
    scale = 0.9
    rc = kernel_recipe(rkw)
    ct = np.float64 if dtype == np.float64 else np.float32
    dq_, dk_, dv_, dm_ = (cuda.to_device(x) for x in (q, k, v, mask if mask is not None
                                                      else np.zeros(1)))
    dmask = None if mask is None else dm_
    out = cuda.to_device(np.full((B, HQ, L, EV), np.nan, dtype))
    lse = cuda.to_device(np.full((B, HQ, L), np.nan, ct))
    forward(dq_, dk_, dv_, dmask, is_causal, scale, out, lse, recipe=rc,
            block_sizes=BLOCK_SIZES)

    tq, tk, tv = t64(q, True), t64(k, True), t64(v, True)
    tm = t64(mask, mask is not None and mask.dtype != bool)
    refkw = dict(refkw)
    ts = None
    if refkw.pop("sinks", False):
        ts = torch.tensor(SINKS.astype(np.float64), requires_grad=True)
    ref_out, ref_lse = torch_reference(tq, tk, tv, tm, scale=scale, sinks=ts, **refkw)
    o, lg = out.copy_to_host(), lse.copy_to_host()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(o, ref_out.detach().numpy()) <= tol
    fin = np.isfinite(ref_lse.detach().numpy())
    assert (np.isfinite(lg) == fin).all()
    assert rel_err(lg[fin], ref_lse.detach().numpy()[fin]) <= tol

    # backward, from the kernel's own forward
    g = rng.standard_normal(o.shape).astype(dtype)
    (ref_out * torch.tensor(g.astype(np.float64))).sum().backward()
    grads = [cuda.to_device(np.full(x.shape, np.nan, ct)) for x in (q, k, v)]
    dmask_out = None
    if mask is not None and mask.dtype != bool:
        dmask_out = cuda.to_device(np.full(mask.shape, np.nan, ct))
    backward(dq_, dk_, dv_, dmask, is_causal, scale, cuda.to_device(g), out, lse, *grads,
             dmask=dmask_out, recipe=rc, block_sizes=BLOCK_SIZES)
    for got, want in zip(grads, (tq, tk, tv)):
        assert rel_err(got.copy_to_host(), want.grad.numpy()) <= 20 * tol
    if dmask_out is not None:
        assert rel_err(dmask_out.copy_to_host(), tm.grad.numpy()) <= 20 * tol
    if ts is not None:
        dsinks = sinks_grad(rc, g, o, lg)
        assert rel_err(dsinks, ts.grad.numpy()) <= 20 * tol
    return o, lg


@pytest.mark.parametrize("name", sorted(CASES))
def test_variant(name):
    run_case(name, np.random.default_rng(abs(hash(name)) % 1000))


def test_float64_everything():
    run_case("everything", np.random.default_rng(3), np.float64)


def test_user_softcap_equals_builtin():
    """A score_mod computing the soft cap gives the built-in's result (float64: to rounding)."""
    rng = np.random.default_rng(5)
    o1, l1 = run_case("softcap", rng, np.float64)
    rng = np.random.default_rng(5)
    o2, l2 = run_case("score_mod_softcap", rng, np.float64)
    assert rel_err(o1, o2) <= 1e-14 and rel_err(l1, l2) <= 1e-14


def test_dense_recipe_is_plain_attention():
    """A recipe without parts, and its run-time numbers for no window, is the kernel without a
    recipe, bit for bit (one compiled kernel serves both)."""
    rng = np.random.default_rng(2)
    q, k, v, mask = inputs(rng, np.float32, "additive")
    results = []
    for rc in (None, recipe()):
        out = device_array((B, HQ, L, EV), np.float32)
        lse = device_array((B, HQ, L), np.float32)
        forward(*(cuda.to_device(x) for x in (q, k, v, mask)), True, 0.7, out, lse, recipe=rc)
        results.append((out.copy_to_host(), lse.copy_to_host()))
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])


# --- through the public API ----------------------------------------------------------------

@njit
def doc_mask(b, h, i, j, doc):
    return doc[b, i] == doc[b, j]


def public_check(q, k, v, mask=None, *, device_q=None, tol=1e-5, **kw):
    """Forward and backward through the public functions on device copies, against the
    reference's; returns nothing (asserts)."""
    dq = dev(q) if device_q is None else device_q
    out, lse = sdpa_numba.scaled_dot_product_attention(dq, dev(k), dev(v), dev(mask),
                                                       return_lse=True, **kw)
    kw_ref = dict(kw)
    kw_ref.pop("block_mask", None)
    ref_out, ref_lse = reference.attention(q, k, v, mask, **kw_ref)
    o, lg = out.copy_to_host(), lse.copy_to_host()
    assert rel_err(o, ref_out) <= tol
    fin = np.isfinite(ref_lse)
    assert (np.isfinite(lg) == fin).all() and rel_err(lg[fin], ref_lse[fin]) <= tol
    g = np.random.default_rng(0).standard_normal(o.shape).astype(q.dtype)
    kw_b = {n: x for n, x in kw.items() if n not in ("return_lse",)}
    grads = sdpa_numba.scaled_dot_product_attention_backward(
        dev(g), dq, dev(k), dev(v), out, lse, dev(mask), **kw_b)
    ref = reference.attention_backward(g, q, k, v, mask, **kw_ref)
    pairs = list(zip(grads[:3], ref[:3]))  # dq, dk, dv (no mask_grad here)
    if "sinks" in kw:
        assert len(grads) == 4
        pairs.append((grads[3], ref[4]))
    else:
        assert len(grads) == 3
    for n, (got, want) in enumerate(pairs):
        got = got if isinstance(got, np.ndarray) else got.copy_to_host()
        assert got.shape == want.shape, n
        assert rel_err(got, want) <= 20 * tol, n


def test_public_window_softcap_alibi_sinks_gqa():
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 4, 6, 5)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 5)).astype(np.float32)
    v = rng.standard_normal((2, 2, 9, 3)).astype(np.float32)
    public_check(q, k, v, enable_gqa=True, window=(3, 1), alignment="bottom_right",
                 softcap=2.5, alibi_slopes=np.array([0.5, 0.25, 0.1, 1.0], np.float32),
                 sinks=np.array([0.2, -1.0, 0.0, 2.0], np.float32), is_causal=True)


@pytest.mark.parametrize("L, S, window", [(11, 2, (1, 0)), (3, 10, (0, 1))])
def test_public_window_past_the_end(L, S, window):
    """Top-left windows that miss every key of some rows (L > S + left) or every row of some
    keys: those rows get zeros and lse -inf, those keys zero gradients. An empty key (row)
    range of a block may start past the last key (row), and must not be aligned down to a
    block boundary (the kernels then read keys past the end of the array)."""
    rng = np.random.default_rng(13)
    q = rng.standard_normal((1, 2, L, 5))
    k = rng.standard_normal((1, 2, S, 5))
    v = rng.standard_normal((1, 2, S, 3))
    public_check(q, k, v, tol=1e-12, window=window)


def test_public_split_launches_carry_the_batch_offset():
    """Batch dims that no view merges: one launch per leading index, each with its batch
    offset, which ALiBi per batch entry and a mask_mod on ``b`` (through its block mask) read."""
    rng = np.random.default_rng(12)
    qh = rng.standard_normal((3, 2, 2, 5, 4)).astype(np.float32)  # seen as batch (2, 3)
    axes = (1, 0, 2, 3, 4)
    q = qh.transpose(axes)
    k = rng.standard_normal((2, 3, 2, 7, 4)).astype(np.float32)
    v = rng.standard_normal((2, 3, 2, 7, 3)).astype(np.float32)
    doc = rng.integers(0, 2, (6, 7)).astype(np.int64)
    slopes = rng.random((2, 3, 2)).astype(np.float32)
    bm = sdpa_numba.create_block_mask(doc_mask, 6, 2, 5, 7, mod_args=(doc,))
    public_check(q, k, v, device_q=permuted(dev(qh), axes), alibi_slopes=slopes,
                 mask_mod=doc_mask, mod_args=(doc,), block_mask=bm)


@njit
def same_doc_1d(b, h, i, j, doc):
    return doc[i] == doc[j]


def test_public_block_mask_built_per_call(monkeypatch):
    """A mask_mod without a block mask, built per call (device mod_args copied to the host for
    it): empty and full blocks skipped; the same bits as every block partial, forward and
    backward, and the reference's values."""
    from sdpa_numba.problem import block_mask as bmod

    rng = np.random.default_rng(13)
    L = 70
    doc = np.repeat([0, 1], [64, 6]).astype(np.int64)  # blocks: full, empty, empty, full
    q, k, v, g = (rng.standard_normal((1, 1, L, 4)).astype(np.float32) for _ in range(4))
    kw = dict(mask_mod=same_doc_1d, mod_args=(dev(doc),))
    results = []
    for threshold in (0, math.inf):
        monkeypatch.setattr(bmod, "BUILD_MIN_SCORES", threshold)
        out, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v),
                                                           return_lse=True, **kw)
        grads = sdpa_numba.scaled_dot_product_attention_backward(dev(g), dev(q), dev(k),
                                                                 dev(v), out, lse, **kw)
        results.append([x.copy_to_host() for x in (out, lse, *grads)])
    monkeypatch.setattr(bmod, "BUILD_MIN_SCORES", 0)
    np.testing.assert_array_equal(
        plan(q, k, v, None, False, None, False, **kw).recipe.block_mask,
        np.array([[[[2, 0], [0, 2]]]]))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    ref, _ = reference.attention(q, k, v, mask_mod=same_doc_1d, mod_args=(doc,))
    assert rel_err(results[0][0], ref) <= 1e-5
