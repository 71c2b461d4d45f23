"""bfloat16 storage on the CPU kernels: conversions, forward and backward against float64.

Tolerances and references: see bf16_checks.
"""

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from numba import njit  # noqa: E402

from bf16_checks import (BF16, check_forward, check_grads, check_rounding,  # noqa: E402
                         randn, special_float32)
from sdpa_numba import scaled_dot_product_attention as sdpa  # noqa: E402
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward  # noqa: E402
from sdpa_numba.cpu.specializations import specializations  # noqa: E402
from sdpa_numba.cpu.storage import load, store  # noqa: E402


@njit
def _load_all(bits, out):
    for i in range(bits.size):
        out[i] = load(bits[i])


@njit
def _store_all(x, out):
    for i in range(x.size):
        out[i] = store(x[i], out)


def test_load_is_exact_for_every_pattern():
    bits = np.arange(-(1 << 15), 1 << 15, dtype=np.int32).astype(np.int16)
    got = np.empty(bits.size, np.float32)
    _load_all(bits, got)
    # bfloat16 is the top half of a float32: the conversion is exact, NaN payloads included
    want = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    ml = bits.view(BF16).astype(np.float32)
    nan = np.isnan(ml)
    np.testing.assert_array_equal(got[~nan], ml[~nan])
    assert np.isnan(got[nan]).all()


def test_store_rounds_to_nearest_even():
    x = special_float32()
    got = np.empty(x.size, np.int16)
    _store_all(x, got)
    check_rounding(x, got)


def test_float16_storage_is_still_uint16():
    # bfloat16 takes the int16 view: float16's path (uint16) is untouched
    from sdpa_numba.cpu.storage import storage_view

    assert storage_view(np.zeros(2, np.float16)).dtype == np.uint16
    assert storage_view(np.zeros(2, BF16)).dtype == np.int16


CASES = {
    # name: (q shape, k shape, v shape, kwargs)
    "odd": ((2, 3, 17, 5), (2, 3, 65, 5), (2, 3, 65, 3), {}),
    "one_row": ((1, 1, 1, 3), (1, 1, 3, 3), (1, 1, 3, 1), {}),
    "causal_127": ((1, 2, 127, 8), (1, 2, 127, 8), (1, 2, 127, 8), {"is_causal": True}),
    "two_dim": ((5, 3), (17, 3), (17, 7), {"scale": 0.3}),
    "gqa": ((2, 4, 9, 4), (2, 2, 11, 4), (2, 2, 11, 6), {"enable_gqa": True,
                                                         "is_causal": True}),
    "dropout": ((2, 2, 19, 4), (2, 2, 23, 4), (2, 2, 23, 5), {"dropout_p": 0.3, "seed": 7}),
}
MASKS = ["none", "bool", "additive"]


def _mask(rng, kind, L, S):
    if kind == "none":
        return None
    if kind == "bool":
        m = rng.random((L, S)) < 0.7
        m[:, 0] = True
        return m
    return randn(rng, (1, L, S))  # broadcast over heads and batch


#: (case, mask kind) pairs: masks on the 4-D cases only, bool masks not on every one of them.
#: Dropout without a mask only: each mask kind is one more compiled forward with dropout, and
#: dropout with an additive mask is checked in float32 and float16 (test_dropout.py), bfloat16
#: with each mask kind here.
PAIRS = [(c, kind) for c in CASES for kind in MASKS
         if kind == "none" or (len(CASES[c][0]) == 4 and c != "dropout"
                               and not (kind == "bool" and c in ("gqa", "one_row")))]


@pytest.mark.parametrize("case, kind", PAIRS)
def test_forward_and_backward(rng, case, kind):
    qs, ks, vs, kw = CASES[case]
    q, k, v = randn(rng, qs), randn(rng, ks), randn(rng, vs)
    mask = _mask(rng, kind, qs[-2], ks[-2])
    out = np.full(qs[:-1] + vs[-1:], np.nan, BF16)
    res, lse = sdpa(q, k, v, mask, out=out, return_lse=True, **kw)
    assert res is out
    check_forward(out, lse, q, k, v, mask, **kw)
    g = randn(rng, out.shape)
    grads = sdpa_backward(g, q, k, v, out, lse, mask, mask_grad=kind == "additive", **kw)
    check_grads(grads, g, q, k, v, out, mask, **kw)


def test_strided_views_and_broadcast_batch(rng):
    q = randn(rng, (3, 2, 13, 16))[:, :, :, ::2]  # non-contiguous rows
    k = randn(rng, (1, 2, 31, 8))  # batch broadcast
    v = randn(rng, (3, 31, 2, 5)).transpose(0, 2, 1, 3)  # a BLHD view
    out, lse = sdpa(q, k, v, return_lse=True, is_causal=True)
    check_forward(out, lse, q, k, v, is_causal=True)


def test_large_logits_and_inf_mask(rng):
    q = (randn(rng, (1, 2, 9, 4)).astype(np.float32) * 100).astype(BF16)
    k = (randn(rng, (1, 2, 9, 4)).astype(np.float32) * 100).astype(BF16)
    v = randn(rng, (1, 2, 9, 4))
    mask = np.zeros((9, 9), BF16)
    mask[3] = -np.inf  # a fully masked row: zeros and lse = -inf
    out, lse = sdpa(q, k, v, mask, return_lse=True)
    check_forward(out, lse, q, k, v, mask)
    assert (np.asarray(out[:, :, 3], np.float32) == 0).all() and np.isneginf(lse[:, :, 3]).all()


def test_dtype_errors(rng):
    q = randn(rng, (1, 2, 3, 4))
    f = q.astype(np.float32)
    with pytest.raises(TypeError, match="key dtype float32 differs from query dtype bfloat16"):
        sdpa(q, f, f)
    with pytest.raises(TypeError, match="attn_mask dtype float32 must be bool or the query"):
        sdpa(q, q, q, np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="out must have shape"):
        sdpa(q, q, q, out=np.empty((1, 2, 3, 4), np.float16))
    with pytest.raises(TypeError, match="bfloat16"):
        sdpa(q.astype(ml_dtypes.float8_e4m3fn), q, q)


def test_specializations_include_bfloat16():
    specs = [str(s) for s in specializations(["bfloat16"], ["none"], [False])]
    assert specs == ["forward bfloat16, mask none", "backward bfloat16, mask bool"]


def test_other_dtypes_never_import_ml_dtypes():
    import os
    import subprocess
    import sys

    code = ("import sys, numpy as np, sdpa_numba\n"
            "x = np.ones((1, 2, 3, 4), np.float32)\n"
            "sdpa_numba.scaled_dot_product_attention(x, x, x)\n"
            "assert 'ml_dtypes' not in sys.modules\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
