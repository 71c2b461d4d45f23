"""Shared checks of attention_with_kvcache (the CPU and the CUDA suites): per-sequence float64
references of decode against a contiguous or paged cache."""

import numpy as np

from checks import TOL, rel_err
from sdpa_numba.reference import attention


def ref_sequence(q, k, v, causal, scale=None):
    """Reference of one sequence: q (Lq, Hq, E) against k (n, H, E), v (n, H, Ev)."""
    lq, n = q.shape[0], k.shape[0]
    mask = None
    if causal:  # bottom-right: token t sees keys j <= n - lq + t
        mask = np.arange(n)[None, :] <= (n - lq + np.arange(lq))[:, None]
    o, lse = attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2),
                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 0, 2), lse


def logical(cache, table, b, n):
    """The first ``n`` key rows of sequence ``b`` of a paged cache, in key order."""
    ps = cache.shape[1]
    j = np.arange(n)
    return cache[table[b, j // ps], j % ps]


def check_against_reference(q, kc, vc, seqlens, out, lse, causal, table=None, tol=None,
                            scale=None):
    tol = TOL[q.dtype.type] if tol is None else tol
    for b in range(q.shape[0]):
        n = seqlens[b]
        k = kc[b, :n] if table is None else logical(kc, table, b, n)
        v = vc[b, :n] if table is None else logical(vc, table, b, n)
        ro, rl = ref_sequence(q[b], k, v, causal, scale)
        assert rel_err(out[b], ro) < tol, b
        finite = np.isfinite(rl)
        np.testing.assert_array_equal(lse[b][~finite], rl[~finite])
        np.testing.assert_allclose(lse[b][finite], rl[finite],
                                   rtol=1e-12 if q.dtype == np.float64 else 1e-5)
