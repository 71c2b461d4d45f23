"""The merge of attention states by lse as device functions, called from a user's kernel."""

import math

import numpy as np
from numba import cuda

from sdpa_numba import merge_attention_states, reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.gpu import merge_row, merge_rows, merge_weights
from sdpa_cuda_testing import dev, rel_err


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
