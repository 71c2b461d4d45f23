"""merge_attention_states: attention over disjoint key sets combined by lse equals attention
over their union (against the dense API and the float64 reference)."""

import numpy as np
import pytest
from numba import njit

import sdpa_numba
from checks import TOL, randn, rel_err
from sdpa_numba import cpu, merge_attention_states, reference
from sdpa_numba import scaled_dot_product_attention as sdpa

SHAPE_Q, E, EV = (2, 3, 5), 9, 7  # (B, H, L), odd sizes


def _split(rng, dtype, cuts, S=23):
    """q, k, v and the dense API's (out, lse) over the key ranges between ``cuts``."""
    q = randn(rng, (*SHAPE_Q, E), dtype)
    k = randn(rng, (*SHAPE_Q[:2], S, E), dtype)
    v = randn(rng, (*SHAPE_Q[:2], S, EV), dtype)
    bounds = [0, *cuts, S]
    parts = [sdpa(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
             for a, b in zip(bounds[:-1], bounds[1:])]
    return q, k, v, parts


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_merging_a_split_of_keys_gives_the_whole(rng, dtype):
    q, k, v, [(oa, la), (ob, lb)] = _split(rng, dtype, [8])
    copies = [x.copy() for x in (oa, la, ob, lb)]
    out, lse = merge_attention_states(oa, la, ob, lb)
    for x, c in zip((oa, la, ob, lb), copies):
        np.testing.assert_array_equal(x, c)  # inputs untouched
    assert out.dtype == dtype and out.shape == oa.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    ref, ref_lse = reference.attention(q, k, v)
    whole, whole_lse = sdpa(q, k, v, return_lse=True)
    tol = 1e-12 if dtype == np.float64 else TOL[dtype] * 2
    assert rel_err(out, ref) < tol
    assert rel_err(out, whole.astype(np.float64)) < tol
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12 if dtype == np.float64 else 1e-5)


def test_n_ary_merge_of_a_split_with_an_empty_part_gives_the_whole(rng):
    # Three parts, the middle one empty (S = 0 gives out 0, lse -inf), one of a single key.
    q, k, v, parts = _split(rng, np.float64, [10, 10, 22])
    assert np.all(parts[1][1] == -np.inf)
    outs = np.stack([o for o, _ in parts])
    lses = np.stack([l for _, l in parts])
    out, lse = merge_attention_states(outs, lses)
    ref, ref_lse = reference.attention(q, k, v)
    assert rel_err(out, ref) < 1e-12
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)
    # A list of parts is stacked: the same result.
    out2, lse2 = merge_attention_states([o for o, _ in parts], [l for _, l in parts])
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(lse2, lse)


def test_merge_order_does_not_matter(rng):
    q, k, v, parts = _split(rng, np.float64, [3, 11, 17])
    outs = np.stack([o for o, _ in parts])
    lses = np.stack([l for _, l in parts])
    out, lse = merge_attention_states(outs, lses)
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2]):
        o, l = merge_attention_states(outs[perm], lses[perm])
        assert rel_err(o, out) < 1e-14
        np.testing.assert_allclose(l, lse, rtol=1e-14)
    # Pairwise, as a tree, against all at once.
    o01, l01 = merge_attention_states(*parts[0], *parts[1])
    o23, l23 = merge_attention_states(*parts[3], *parts[2])
    o, l = merge_attention_states(o23, l23, o01, l01)
    assert rel_err(o, out) < 1e-14
    np.testing.assert_allclose(l, lse, rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merging_with_an_empty_part_is_the_identity(rng, dtype):
    o = randn(rng, (4, 6, 5), dtype)
    l = randn(rng, (4, 6), dtype) * 10
    junk = np.full_like(o, np.nan)  # an empty part's row is never read
    empty = np.full_like(l, -np.inf)
    for args in ((o, l, junk, empty), (junk, empty, o, l)):
        out, lse = merge_attention_states(*args)
        np.testing.assert_array_equal(out, o)
        np.testing.assert_array_equal(lse, l)
    out, lse = merge_attention_states(np.stack([junk, o, junk]), np.stack([empty, l, empty]))
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse, l)


def test_edge_values_of_lse():
    o = np.arange(12.0).reshape(4, 3) + 1
    la = np.array([-np.inf, np.nan, np.inf, 0.0])
    lb = np.array([-np.inf, 0.0, 0.0, 1000.0])  # row 3: part a underflows to weight 0
    out, lse = merge_attention_states(o, la, 2 * o, lb)
    np.testing.assert_array_equal(out[0], 0)
    assert lse[0] == -np.inf
    assert np.all(np.isnan(out[1])) and np.isnan(lse[1])  # NaN stays visible
    assert np.all(np.isnan(out[2])) and np.isnan(lse[2])  # +inf: no finite scores give it
    np.testing.assert_array_equal(out[3], 2 * o[3])
    assert lse[3] == 1000.0
    out, lse = merge_attention_states(np.stack([o, o]), np.stack([la, lb]))
    np.testing.assert_array_equal(out[0], 0)
    assert lse[0] == -np.inf
    assert np.all(np.isnan(out[1:3])) and np.all(np.isnan(lse[1:3]))
    # No parts at all: every row empty.
    out, lse = merge_attention_states(np.ones((0, 2, 3)), np.ones((0, 2)))
    np.testing.assert_array_equal(out, 0)
    assert np.all(lse == -np.inf)


def test_parallel_and_serial_merges_are_bitwise_equal(rng, monkeypatch):
    import sdpa_numba.cpu.launch_merge as merge_module

    o = randn(rng, (3, 200, 33))  # more rows than one parallel task
    l = randn(rng, (3, 200)) * 5
    serial = merge_attention_states(o, l)
    serial2 = merge_attention_states(o[0], l[0], o[1], l[1])
    monkeypatch.setattr(merge_module, "PARALLEL_BYTES", 0)
    for a, b in zip(merge_attention_states(o, l), serial):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(merge_attention_states(o[0], l[0], o[1], l[1]), serial2):
        np.testing.assert_array_equal(a, b)


def test_bad_input_is_refused_naming_the_argument():
    o, l = np.zeros((2, 3)), np.zeros(2)
    with pytest.raises(TypeError, match="out_b and lse_b go together"):
        merge_attention_states(o, l, o)
    with pytest.raises(TypeError, match="out_b dtype"):
        merge_attention_states(o, l, o.astype(np.float32), l)
    with pytest.raises(TypeError, match="out_a dtype"):
        merge_attention_states(o.astype(np.int32), l, o.astype(np.int32), l)
    with pytest.raises(ValueError, match="out_b's shape"):
        merge_attention_states(o, l, np.zeros((2, 4)), l)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        merge_attention_states(o, l, o, np.zeros(3))
    with pytest.raises(TypeError, match="lse_a must be a float"):
        merge_attention_states(o, l.astype(np.int64), o, l)
    with pytest.raises(ValueError, match="outs must have at least 2 dims"):
        merge_attention_states(np.zeros(3), np.zeros(()))
    with pytest.raises(ValueError, match="lses must have shape"):
        merge_attention_states(np.zeros((2, 3, 4)), np.zeros((3, 3)))


def test_lists_that_do_not_stack_are_refused_naming_the_argument():
    # NumPy's own messages ("need at least one array to stack") named no argument.
    o, l = np.zeros((2, 3)), np.zeros(2)
    with pytest.raises(ValueError, match="outs is an empty list"):
        merge_attention_states([], [])
    with pytest.raises(ValueError, match="lses is an empty tuple"):
        merge_attention_states([o, o], ())
    with pytest.raises(ValueError, match=r"outs\[1\] has shape \(2, 4\), outs\[0\] \(2, 3\)"):
        merge_attention_states([o, np.zeros((2, 4))], [l, l])
    with pytest.raises(ValueError, match=r"lses\[2\] has shape \(3\)"):
        merge_attention_states([o, o, o], [l, l, np.zeros(3)])
    with pytest.raises(TypeError, match=r"outs\[1\] has dtype float32"):
        merge_attention_states([o, o.astype(np.float32)], [l, l])
    with pytest.raises(TypeError, match="out_a must be an array, got a list"):
        merge_attention_states([o], l, o, l)


def test_merge_functions_from_a_users_njit(rng):
    @njit
    def user(o, l, out):
        lse = np.empty(out.shape[0])
        half = o.shape[0] // 2
        for r in range(out.shape[0]):
            # Two parts, each merged from halves by merge_rows, then merged by merge_row.
            a = np.empty(out.shape[1])
            b = np.empty(out.shape[1])
            la = cpu.merge_rows(o[:half, r], l[:half, r], a)
            lb = cpu.merge_rows(o[half:, r], l[half:, r], b)
            lse[r] = cpu.merge_row(a, la, b, lb, out[r])
        wa, wb, x = cpu.merge_weights(l[0, 0], l[1, 0])
        return lse, wa, wb, x

    o = randn(rng, (5, 7, 11), np.float64)
    l = randn(rng, (5, 7), np.float64)
    l[2, 3] = -np.inf
    o[2, 3] = np.nan  # an empty part is not read
    out = np.full((7, 11), np.nan)
    lse, wa, wb, x = user(o, l, out)
    ref, ref_lse = merge_attention_states(o, l)
    assert rel_err(out, ref) < 1e-14
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-14)
    m = max(l[0, 0], l[1, 0])
    np.testing.assert_allclose(x, m + np.log(np.exp(l[0, 0] - m) + np.exp(l[1, 0] - m)))
    np.testing.assert_allclose(wa, np.exp(l[0, 0] - x))
    np.testing.assert_allclose(wb, np.exp(l[1, 0] - x))


def test_merge_is_exported():
    assert sdpa_numba.merge_attention_states is merge_attention_states
    assert "merge_attention_states" in sdpa_numba.__all__
