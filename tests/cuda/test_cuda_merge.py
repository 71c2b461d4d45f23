"""The merge of attention states by lse as device functions, called from a user's kernel."""

import math

import numpy as np
import pytest
from numba import cuda

from sdpa_numba import merge_attention_states, reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.gpu import merge_row, merge_rows, merge_weights
from sdpa_cuda_testing import dev, rel_err
from sdpa_numba.gpu.arrays import as_strided


@cuda.jit
def user_merge(o, l, out_pair, lse_pair, out_all, lse_all, w):
    """Row r: parts 0 and 1 with merge_row, all parts with merge_rows."""
    r = cuda.grid(1)
    if r >= o.shape[1]:
        return
    lse_pair[r] = merge_row(o[0, r], l[0, r], o[1, r], l[1, r], out_pair[r])
    lse_all[r] = merge_rows(o[:, r], l[:, r], out_all[r])
    if r == 0:
        wa, wb, x = merge_weights(l[0, 0], l[1, 0])
        w[0] = wa
        w[1] = wb
        w[2] = x


def test_merge_device_functions_from_a_users_kernel(rng):
    # Parts: attention over 3 disjoint key ranges of one head (the middle one empty).
    q = rng.standard_normal((6, 5))
    k = rng.standard_normal((13, 5))
    v = rng.standard_normal((13, 4))
    parts = [sdpa(q, k[a:b], v[a:b], return_lse=True) for a, b in ((0, 6), (6, 6), (6, 13))]
    o = np.stack([p[0] for p in parts])
    l = np.stack([p[1] for p in parts])
    o[1] = np.nan  # the empty part's rows are never read
    # Reordered so that merge_row sees parts a and c (a split of all the keys).
    o, l = o[[0, 2, 1]], l[[0, 2, 1]]
    l[:, 5] = [-np.inf, -np.inf, -np.inf]  # a row with no keys anywhere
    out_pair, out_all = np.full((6, 4), np.nan), np.full((6, 4), np.nan)
    lse_pair, lse_all, w = np.full(6, np.nan), np.full(6, np.nan), np.full(3, np.nan)
    d = [dev(x) for x in (o, l, out_pair, lse_pair, out_all, lse_all, w)]
    user_merge[1, 8](*d)
    out_pair, lse_pair, out_all, lse_all, w = (x.copy_to_host() for x in d[2:])
    ref, ref_lse = reference.attention(q, k, v)
    for out, lse in ((out_pair, lse_pair), (out_all, lse_all)):
        assert rel_err(out[:5], ref[:5]) < 1e-12
        np.testing.assert_allclose(lse[:5], ref_lse[:5], rtol=1e-12)
        np.testing.assert_array_equal(out[5], 0)
        assert lse[5] == -np.inf
    m = max(l[0, 0], l[1, 0])
    x = m + math.log(math.exp(l[0, 0] - m) + math.exp(l[1, 0] - m))
    np.testing.assert_allclose(w, [math.exp(l[0, 0] - x), math.exp(l[1, 0] - x), x])
    host, host_lse = merge_attention_states(o[:2], l[:2])
    np.testing.assert_allclose(out_pair, host, rtol=1e-14)


def _split_states(rng, shape, n_keys, cuts, dtype=np.float64):
    """Attention over ``cuts``' disjoint key ranges (host arrays) and over all the keys."""
    q = rng.standard_normal((*shape, 5))
    k = rng.standard_normal((*shape[:-1], n_keys, 5))
    v = rng.standard_normal((*shape[:-1], n_keys, 4))
    parts = [sdpa(q, k[..., a:b, :], v[..., a:b, :], return_lse=True) for a, b in cuts]
    whole = sdpa(q, k, v, return_lse=True)
    return [(o.astype(dtype), l) for o, l in parts], whole


def test_merge_attention_states_on_device_arrays_two_and_n_ary(rng):
    parts, (ref, ref_lse) = _split_states(rng, (2, 3, 7), 13, ((0, 5), (5, 5), (5, 13)))
    (oa, la), (oe, le), (ob, lb) = parts
    oe[...] = np.nan  # the empty part's outputs are never read
    out, lse = merge_attention_states(dev(oa), dev(la), dev(ob), dev(lb))
    assert isinstance(lse, type(dev(la)))  # the caller's kind of array
    out, lse = out.copy_to_host(), lse.copy_to_host()
    host, host_lse = merge_attention_states(oa, la, ob, lb)
    # (the CPU kernels may contract to FMAs: the same up to rounding)
    np.testing.assert_allclose(out, host, rtol=1e-14, atol=1e-16)
    np.testing.assert_allclose(lse, host_lse, rtol=1e-15)
    assert rel_err(out, ref) < 1e-12
    outs, lses = np.stack([oa, oe, ob]), np.stack([la, le, lb])
    for args in ((dev(outs), dev(lses)), ([dev(oa), dev(oe), dev(ob)], [dev(la), dev(le),
                                                                       dev(lb)])):
        out, lse = merge_attention_states(*args)
        out, lse = out.copy_to_host(), lse.copy_to_host()
        host, host_lse = merge_attention_states(outs, lses)
        np.testing.assert_allclose(out, host, rtol=1e-14, atol=1e-16)
        np.testing.assert_allclose(lse, host_lse, rtol=1e-15)
        assert rel_err(out, ref) < 1e-12
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


def test_device_merge_edges_strides_and_float32(rng):
    parts, _ = _split_states(rng, (3, 2, 4), 9, ((0, 4), (4, 9)), np.float32)
    (oa, la), (ob, lb) = parts
    la, lb = la.astype(np.float32), lb.astype(np.float32)
    la[0, 0, 1] = lb[0, 0, 1] = -np.inf  # no key in either part: 0 and -inf
    la[1, 1, 2] = -np.inf  # one empty part: the other as it is
    # Views whose leading dims do not merge into rows: one launch per leading index.
    oa_t, ob_t = oa.transpose(1, 0, 2, 3), ob.transpose(1, 0, 2, 3)
    la_t, lb_t = la.transpose(1, 0, 2), lb.transpose(1, 0, 2)
    d = [cuda.to_device(np.ascontiguousarray(x)) for x in (oa, la, ob, lb)]
    views = [as_strided(x, (x.shape[1], x.shape[0], *x.shape[2:]),
                        (x.strides[1], x.strides[0], *x.strides[2:])) for x in d]
    out, lse = merge_attention_states(*views)
    host, host_lse = merge_attention_states(oa_t, la_t, ob_t, lb_t)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out.copy_to_host(), host, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse.copy_to_host(), host_lse, rtol=1e-6)
    assert np.all(host[0, 0, 1] == 0) and host_lse[0, 0, 1] == -np.inf
    # float16 outputs, combined in float32
    o16 = [oa.astype(np.float16), ob.astype(np.float16)]
    out, lse = merge_attention_states(dev(o16[0]), dev(la), dev(o16[1]), dev(lb))
    host, host_lse = merge_attention_states(o16[0], la, o16[1], lb)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.copy_to_host().astype(np.float32), host, rtol=1e-3,
                               atol=1e-3)
    np.testing.assert_allclose(lse.copy_to_host(), host_lse, rtol=1e-6)


def test_device_merge_bad_input(rng):
    o = rng.standard_normal((2, 3))
    l = rng.standard_normal(2)
    with pytest.raises(TypeError, match="host and device"):
        merge_attention_states(dev(o), l, dev(o), dev(l))
    with pytest.raises(ValueError, match=r"out_b's shape \(2, 2\) differs"):
        merge_attention_states(dev(o), dev(l), dev(o[:, :2]), dev(l))
    with pytest.raises(ValueError, match="lse_b must have shape"):
        merge_attention_states(dev(o), dev(l), dev(o), dev(l[:1]))
    with pytest.raises(TypeError, match="lses must be a float array"):
        merge_attention_states(dev(o[None]), dev(np.zeros((1, 2), np.int32)))
